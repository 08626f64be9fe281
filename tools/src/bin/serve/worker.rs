//! The engine's thread: it owns the scheduler (continuous batching in `engine`), feeds it the
//! queued requests between steps, turns its events into each request's stream, and cancels a
//! sequence whose client went away at the next step boundary. Each sequence has its own cache
//! blocks, so a request never sees another's rows (seed §7).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::mpsc;
use std::time::Instant;

use engine::prefix::PrefixStats;
use engine::scheduler::{Scheduler, SchedulerConfig, SeqEvent, SeqId};
use engine::{Engine, FinishReason, GenerateRequest, TokenConstraint};
use loader::tokenizer::Tokenizer;
use tokio::sync::mpsc::UnboundedSender;

use crate::metrics::Metrics;
use crate::toolcall::{CALL_CLOSE, CALL_OPEN, CallParser, Piece};

pub struct Job {
    pub req: GenerateRequest,
    /// The choice this job generates (`n` > 1 makes one job a choice, sent back to back).
    pub index: usize,
    /// Jobs of one request share it; a choice after the first waits for the first's prompt
    /// blocks and reuses them.
    pub group: u64,
    /// Whether the output starts inside a reasoning span (a chat prompt that ends in `<think>`).
    pub reasoning: Option<bool>,
    /// Top alternatives per token when log-probabilities were asked for.
    pub logprobs: Option<usize>,
    pub events: UnboundedSender<Event>,
    /// Set when the client goes away; the decode stops at the next token boundary.
    pub cancel: Arc<AtomicBool>,
    pub arrived: Instant,
    /// What the output must match (a schema, a grammar, a required call).
    pub constraint: Option<Box<dyn TokenConstraint>>,
    /// Finds tool calls in the answer when the request declared tools.
    pub calls: Option<CallParser>,
}

#[derive(Debug)]
pub enum Event {
    Token(Delta),
    Done(Done),
    Error(String),
    /// Refused by a shutdown before any token: the route answers 503.
    Unavailable,
}

/// What a shutdown (SIGTERM or SIGINT) asks of the engine thread.
#[derive(Debug, Default)]
pub struct Shutdown {
    /// No new work: a request that has no token yet is refused (503); running ones go on.
    pub draining: AtomicBool,
    /// The drain's time is up: running sequences end at the next token boundary, their
    /// streams with a final chunk (`finish_reason` "length": cut short by the server).
    pub cut: AtomicBool,
}

#[derive(Debug, Default)]
pub struct Delta {
    /// The choice it belongs to.
    pub index: usize,
    pub reasoning: String,
    pub content: String,
    pub logprob: Option<TokenLogprob>,
    /// Calls, or parts of calls, that came with this token.
    pub tool_calls: Vec<CallPart>,
}

/// A call's part of a stream: the first part of a call has its id and name.
#[derive(Clone, Debug, PartialEq)]
pub struct CallPart {
    pub index: usize,
    /// Id and name.
    pub head: Option<(String, String)>,
    pub arguments: String,
}

impl Delta {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty()
            && self.content.is_empty()
            && self.logprob.is_none()
            && self.tool_calls.is_empty()
    }

    /// Moves the content through the call parser: its calls out, its text back.
    fn parse_calls(&mut self, parser: &mut CallParser, end: bool) {
        let mut pieces = parser.push(&std::mem::take(&mut self.content));
        if end {
            pieces.extend(parser.finish());
        }
        for p in pieces {
            let part = match p {
                Piece::Text(t) => {
                    self.content.push_str(&t);
                    continue;
                }
                Piece::Call(c) => CallPart {
                    index: c.index,
                    head: Some((c.id, c.name)),
                    arguments: c.arguments,
                },
                Piece::CallStart { index, id, name } => CallPart {
                    index,
                    head: Some((id, name)),
                    arguments: String::new(),
                },
                Piece::CallArguments { index, text } => CallPart {
                    index,
                    head: None,
                    arguments: text,
                },
            };
            self.tool_calls.push(part);
        }
    }
}

#[derive(Clone, Debug)]
pub struct TokenLogprob {
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
    pub top: Vec<(String, Vec<u8>, f32)>,
}

#[derive(Clone, Copy, Debug)]
pub struct Done {
    pub index: usize,
    pub finish: FinishReason,
    /// The answer ended in tool calls (`finish_reason` "tool_calls").
    pub tool_calls: bool,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
}

/// The reasoning and tool-call markers of the vocabulary (spec §8.1).
#[derive(Clone, Copy, Debug, Default)]
pub struct ThinkIds {
    pub start: Option<u32>,
    pub end: Option<u32>,
    /// `<tool_call>` and `</tool_call>` where they are special tokens (decoding drops a
    /// special token's text, so the worker puts the marker back for the call parser).
    pub call_open: Option<u32>,
    pub call_close: Option<u32>,
}

impl ThinkIds {
    pub fn of(tok: &Tokenizer) -> ThinkIds {
        let special = |piece: &str| tok.piece_to_id(piece).filter(|&id| tok.is_special(id));
        ThinkIds {
            start: tok.piece_to_id("<think>"),
            end: tok.piece_to_id("</think>"),
            call_open: special(CALL_OPEN),
            call_close: special(CALL_CLOSE),
        }
    }

    /// The text a token released, with a tool-call marker's own text where the token is one.
    fn with_call_marker<'a>(&self, id: u32, text: &'a str) -> std::borrow::Cow<'a, str> {
        let marker = if Some(id) == self.call_open {
            CALL_OPEN
        } else if Some(id) == self.call_close {
            CALL_CLOSE
        } else {
            return text.into();
        };
        format!("{}{marker}", text.strip_suffix(marker).unwrap_or(text)).into()
    }

    /// Whether generation after `prompt` starts inside reasoning: the last marker is `<think>`.
    pub fn opens_reasoning(&self, prompt: &[u32]) -> bool {
        let last = prompt
            .iter()
            .rev()
            .find(|&&t| Some(t) == self.start || Some(t) == self.end);
        last.is_some() && last.copied() == self.start
    }
}

/// Splits generated text into reasoning and content by the marker ids (spec §8.1). Markers are
/// single tokens, so a marker is never split across pieces; the one `\n` before `</think>` is
/// template structure, so a trailing newline of the reasoning is held until it is decided.
pub struct Splitter {
    ids: ThinkIds,
    in_reasoning: bool,
    held_newline: bool,
}

const THINK_START: &str = "<think>";
const THINK_END: &str = "</think>";

impl Splitter {
    pub fn new(ids: ThinkIds, in_reasoning: bool) -> Splitter {
        Splitter {
            ids,
            in_reasoning,
            held_newline: false,
        }
    }

    /// `text` is what became final with token `id` (`None` for text flushed at the end).
    pub fn push(&mut self, id: Option<u32>, text: &str, out: &mut Delta) {
        let is_end = id.is_some() && id == self.ids.end;
        let is_start = id.is_some() && id == self.ids.start;
        // Text released with a marker belongs before it; a decoder that keeps specials adds the marker's own text.
        let text = match (is_start, is_end) {
            (true, _) => text.strip_suffix(THINK_START).unwrap_or(text),
            (_, true) => text.strip_suffix(THINK_END).unwrap_or(text),
            _ => text,
        };
        self.emit(text, out);
        if is_end && self.in_reasoning {
            self.held_newline = false;
            self.in_reasoning = false;
        } else if is_start && !self.in_reasoning {
            self.in_reasoning = true;
        }
    }

    fn emit(&mut self, text: &str, out: &mut Delta) {
        if text.is_empty() {
            return;
        }
        if !self.in_reasoning {
            out.content.push_str(text);
            return;
        }
        if std::mem::take(&mut self.held_newline) {
            out.reasoning.push('\n');
        }
        match text.strip_suffix('\n') {
            Some(head) => {
                out.reasoning.push_str(head);
                self.held_newline = true;
            }
            None => out.reasoning.push_str(text),
        }
    }

    /// Releases a held newline when the reasoning never closed.
    pub fn finish(&mut self, out: &mut Delta) {
        if std::mem::take(&mut self.held_newline) {
            out.reasoning.push('\n');
        }
    }
}

/// A token's text for log-probability reports: the piece with `▁` as a space, a byte piece as
/// its byte, and otherwise the decoded token.
fn token_text(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    if let Some(p) = tok.token_to_piece(id) {
        if let Some(hex) = p.strip_prefix("<0x").and_then(|r| r.strip_suffix('>'))
            && let Ok(b) = u8::from_str_radix(hex, 16)
        {
            return (String::from_utf8_lossy(&[b]).into_owned(), vec![b]);
        }
        if p.contains('\u{2581}') {
            let s = p.replace('\u{2581}', " ");
            let b = s.clone().into_bytes();
            return (s, b);
        }
    }
    let s = tok.decode(&[id], false).unwrap_or_default();
    let b = s.clone().into_bytes();
    (s, b)
}

/// The model's log-probability of `id` (log-softmax of the raw logits) and the `top` best.
fn token_logprob(tok: &Tokenizer, id: u32, logits: &[f32], top: usize) -> TokenLogprob {
    let max = logits
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    let lse = max
        + logits
            .iter()
            .filter(|v| v.is_finite())
            .map(|&v| ((v - max) as f64).exp())
            .sum::<f64>()
            .ln() as f32;
    let lp = |i: usize| logits.get(i).map_or(f32::NEG_INFINITY, |&v| v - lse);
    let mut best: Vec<usize> = Vec::new();
    if top > 0 {
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        let k = top.min(idx.len());
        if k > 0 {
            idx.select_nth_unstable_by(k - 1, |&a, &b| logits[b].total_cmp(&logits[a]));
            idx.truncate(k);
            idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        }
        best = idx;
    }
    let (token, bytes) = token_text(tok, id);
    TokenLogprob {
        token,
        bytes,
        logprob: lp(id as usize),
        top: best
            .into_iter()
            .map(|i| {
                let (t, b) = token_text(tok, i as u32);
                (t, b, lp(i))
            })
            .collect(),
    }
}

/// Starts the engine thread; requests go in through the returned queue.
pub fn spawn(
    engine: Engine,
    tokenizer: Arc<Tokenizer>,
    config: SchedulerConfig,
    think: ThinkIds,
    metrics: Arc<Metrics>,
    shutdown: Arc<Shutdown>,
) -> std::io::Result<mpsc::Sender<Job>> {
    let (tx, rx) = mpsc::channel::<Job>();
    let pool = engine.pool();
    let block_bytes = engine.cache_bytes() / pool.blocks.max(1);
    metrics.kv_cache_blocks.store(pool.blocks as u64, Relaxed);
    std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || {
            let mut w = Worker {
                sched: Scheduler::new(engine, config, Some(tokenizer.clone())),
                tokenizer,
                think,
                metrics,
                live: HashMap::new(),
                groups: HashMap::new(),
                prefix: PrefixStats::default(),
                block_bytes,
                shutdown,
            };
            w.prefix.budget = w.metrics.prefix_budget();
            w.run(rx);
        })?;
    Ok(tx)
}

/// A request the scheduler is running, and its stream's state.
struct Live {
    job: Job,
    splitter: Option<Splitter>,
    last: Option<Instant>,
    /// Cancelled by the shutdown's deadline (its stream still gets a final chunk).
    cut: bool,
}

struct Worker {
    sched: Scheduler,
    tokenizer: Arc<Tokenizer>,
    think: ThinkIds,
    metrics: Arc<Metrics>,
    live: HashMap<SeqId, Live>,
    /// The first choice's sequence of each request with more than one.
    groups: HashMap<u64, SeqId>,
    prefix: PrefixStats,
    block_bytes: usize,
    shutdown: Arc<Shutdown>,
}

impl Worker {
    /// A drain refuses what has not started (no token yet); the deadline cuts the rest.
    fn apply_shutdown(&mut self) {
        if !self.shutdown.draining.load(Relaxed) {
            return;
        }
        let cut = self.shutdown.cut.load(Relaxed);
        let mut refused = Vec::new();
        for (&id, l) in self.live.iter_mut() {
            if l.last.is_none() {
                refused.push(id);
            } else if cut && !l.cut {
                l.cut = true;
                self.sched.cancel(id);
            }
        }
        for id in refused {
            self.sched.cancel(id);
            self.groups.retain(|_, first| *first != id);
            if let Some(l) = self.live.remove(&id) {
                let _ = l.job.events.send(Event::Unavailable);
            }
        }
    }

    fn run(&mut self, rx: mpsc::Receiver<Job>) {
        loop {
            // Idle: wait for a request. Busy: take whatever arrived since the last step.
            if !self.sched.has_work() {
                match rx.recv() {
                    Ok(job) => self.admit(job),
                    Err(_) => return,
                }
            }
            while let Ok(job) = rx.try_recv() {
                self.admit(job);
            }
            self.apply_shutdown();
            for (&id, l) in &self.live {
                if l.job.cancel.load(Relaxed) || l.job.events.is_closed() {
                    self.sched.cancel(id);
                }
            }
            if !self.sched.has_work() {
                continue;
            }
            let events = self.sched.step();
            for ev in events {
                self.dispatch(ev);
            }
            let st = self.sched.stats();
            let m = &self.metrics;
            if st.last_batch > 0 {
                m.observe_batch(st.last_batch);
            }
            m.running.store(st.running as u64, Relaxed);
            m.queued.store(st.waiting as u64, Relaxed);
            m.preemptions.store(st.preemptions, Relaxed);
            m.set_step_time(st.time);
            m.cache_usage_ppm
                .store((st.cache_usage * 1e6) as u64, Relaxed);
            let p = self.sched.pool().stats();
            self.prefix.entries = p.cached_blocks;
            self.prefix.bytes = p.cached_blocks * self.block_bytes;
            m.set_prefix(self.prefix);
        }
    }

    fn admit(&mut self, mut job: Job) {
        self.metrics.waiting.fetch_sub(1, Relaxed);
        if job.cancel.load(Relaxed) || job.events.is_closed() {
            // Gone while it waited: nothing to decode.
            self.metrics.cancellations.fetch_add(1, Relaxed);
            return;
        }
        if self.shutdown.draining.load(Relaxed) {
            let _ = job.events.send(Event::Unavailable);
            return;
        }
        let id = match (job.index, self.groups.get(&job.group)) {
            (0, _) | (_, None) => self.sched.add(job.req.clone()),
            (_, Some(&first)) => self.sched.add_sharing(job.req.clone(), first),
        };
        if job.index == 0 {
            self.groups.insert(job.group, id);
        }
        if let Some(c) = job.constraint.take() {
            self.sched.constrain(id, c);
        }
        let splitter = job.reasoning.map(|r| Splitter::new(self.think, r));
        self.live.insert(
            id,
            Live {
                job,
                splitter,
                last: None,
                cut: false,
            },
        );
    }

    fn dispatch(&mut self, ev: SeqEvent) {
        match ev {
            SeqEvent::Token {
                seq,
                id,
                text,
                logits,
            } => {
                let Some(l) = self.live.get_mut(&seq) else {
                    return;
                };
                let now = Instant::now();
                match l.last {
                    None => self.metrics.observe_ttft(now - l.job.arrived),
                    Some(t) => self.metrics.observe_itl(now - t),
                }
                l.last = Some(now);
                let mut d = Delta {
                    index: l.job.index,
                    ..Delta::default()
                };
                let text = self.think.with_call_marker(id, &text);
                match l.splitter.as_mut() {
                    Some(s) => s.push(Some(id), &text, &mut d),
                    None => d.content.push_str(&text),
                }
                if let Some(p) = l.job.calls.as_mut() {
                    d.parse_calls(p, false);
                }
                if let Some(top) = l.job.logprobs {
                    d.logprob = Some(token_logprob(
                        &self.tokenizer,
                        id,
                        logits.as_deref().unwrap_or_default(),
                        top,
                    ));
                }
                if l.job.events.send(Event::Token(d)).is_err() {
                    self.sched.cancel(seq);
                }
            }
            SeqEvent::Finished {
                seq,
                finish,
                rest,
                usage,
            } => {
                let Some(mut l) = self.live.remove(&seq) else {
                    return;
                };
                let finish = if l.cut && finish == FinishReason::Cancelled {
                    FinishReason::Length
                } else {
                    finish
                };
                // Text the stream released only at the end (a held stop-string prefix, a
                // partial UTF-8 sequence).
                let mut d = Delta {
                    index: l.job.index,
                    ..Delta::default()
                };
                match l.splitter.as_mut() {
                    Some(s) => {
                        s.push(None, &rest, &mut d);
                        s.finish(&mut d);
                    }
                    None => d.content.push_str(&rest),
                }
                if let Some(p) = l.job.calls.as_mut() {
                    d.parse_calls(p, true);
                }
                let tool_calls = l.job.calls.as_ref().is_some_and(|p| p.calls() > 0);
                if !d.is_empty() {
                    let _ = l.job.events.send(Event::Token(d));
                }
                let m = &self.metrics;
                m.prompt_tokens
                    .fetch_add(usage.prompt_tokens as u64, Relaxed);
                m.generation_tokens
                    .fetch_add(usage.completion_tokens as u64, Relaxed);
                match finish {
                    FinishReason::Stop => m.success_stop.fetch_add(1, Relaxed),
                    FinishReason::Length => m.success_length.fetch_add(1, Relaxed),
                    FinishReason::Cancelled => m.cancellations.fetch_add(1, Relaxed),
                };
                let p = &mut self.prefix;
                p.queried_tokens += usage.prompt_tokens as u64;
                p.reused_tokens += usage.cached_tokens as u64;
                if usage.cached_tokens > 0 {
                    p.hits += 1;
                } else {
                    p.misses += 1;
                }
                self.groups.retain(|_, first| *first != seq);
                let _ = l.job.events.send(Event::Done(Done {
                    index: l.job.index,
                    finish,
                    tool_calls,
                    prompt_tokens: usage.prompt_tokens,
                    completion_tokens: usage.completion_tokens,
                    cached_tokens: usage.cached_tokens,
                }));
            }
            SeqEvent::Failed { seq, error } => {
                self.groups.retain(|_, first| *first != seq);
                if let Some(l) = self.live.remove(&seq) {
                    self.metrics.errors.fetch_add(1, Relaxed);
                    let _ = l.job.events.send(Event::Error(error));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IDS: ThinkIds = ThinkIds {
        start: Some(9),
        end: Some(10),
        call_open: Some(11),
        call_close: Some(12),
    };

    fn run(start_in_reasoning: bool, pieces: &[(u32, &str)]) -> (String, String) {
        let mut s = Splitter::new(IDS, start_in_reasoning);
        let mut d = Delta::default();
        for &(id, t) in pieces {
            s.push(Some(id), t, &mut d);
        }
        s.finish(&mut d);
        (d.reasoning, d.content)
    }

    #[test]
    fn with_thinking_the_output_starts_in_reasoning_and_the_newline_before_the_marker_is_dropped() {
        let (r, c) = run(
            true,
            &[
                (100, "Let me"),
                (101, " think\n"),
                (10, ""),
                (102, "Paris."),
            ],
        );
        assert_eq!((r.as_str(), c.as_str()), ("Let me think", "Paris."));
    }

    #[test]
    fn inner_newlines_of_the_reasoning_are_kept() {
        let (r, c) = run(true, &[(100, "a\n"), (101, "b\n"), (10, ""), (102, "x")]);
        assert_eq!((r.as_str(), c.as_str()), ("a\nb", "x"));
    }

    #[test]
    fn without_thinking_everything_is_content_and_a_stray_end_marker_is_dropped() {
        let (r, c) = run(false, &[(100, "Hi"), (10, "</think>"), (101, " there")]);
        assert_eq!((r.as_str(), c.as_str()), ("", "Hi there"));
    }

    #[test]
    fn a_start_marker_in_content_opens_reasoning_and_an_unclosed_reasoning_keeps_its_newline() {
        let (r, c) = run(false, &[(100, "A"), (9, ""), (101, "hmm\n")]);
        assert_eq!((r.as_str(), c.as_str()), ("hmm\n", "A"));
    }

    #[test]
    fn a_tool_call_inside_reasoning_stays_reasoning_and_one_after_it_is_a_call() {
        let o = serde_json::json!({"tools": [{"type": "function", "function": {"name": "f"}}]});
        let tools = crate::toolcall::parse(o.as_object().unwrap())
            .unwrap()
            .unwrap();
        let mut parser = CallParser::new(tools.names(), "t".into());
        let mut s = Splitter::new(IDS, true);
        let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::new());
        // The marker tokens decode to nothing (special); the worker puts their text back.
        let pieces = [
            (11, ""),
            (100, r#"{"name": "f", "arguments": {}}"#),
            (12, ""),
            (10, ""),
            (11, ""),
            (101, "\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n"),
            (12, ""),
        ];
        for (k, (id, text)) in pieces.into_iter().enumerate() {
            let mut d = Delta::default();
            s.push(Some(id), &IDS.with_call_marker(id, text), &mut d);
            d.parse_calls(&mut parser, k + 1 == pieces.len());
            reasoning.push_str(&d.reasoning);
            content.push_str(&d.content);
            calls.extend(d.tool_calls);
        }
        assert_eq!(
            reasoning,
            r#"<tool_call>{"name": "f", "arguments": {}}</tool_call>"#
        );
        assert_eq!(content, "");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].head.as_ref().map(|h| h.1.as_str()), Some("f"));
        assert_eq!(calls[0].arguments, r#"{"x": 1}"#);
    }

    #[test]
    fn the_prompt_decides_where_the_output_starts() {
        assert!(IDS.opens_reasoning(&[4, 50, 5, 9]));
        assert!(!IDS.opens_reasoning(&[4, 50, 5, 10]));
        assert!(!IDS.opens_reasoning(&[4, 50]));
    }
}
