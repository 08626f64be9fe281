//! Continuous batching over one [`Engine`]: requests join the running batch between steps
//! and leave when they finish or are cancelled (vLLM's scheduler, in miniature).
//!
//! Queues: `waiting` (first come, first served; a preempted sequence goes back to its front)
//! and `running` (holding cache blocks, in admission order). Each [`Scheduler::step`]:
//! 1. drops cancelled sequences, returning their blocks;
//! 2. admits waiting sequences while fewer than `max_num_seqs` run and the pool has the
//!    blocks their whole prompt needs (after the prefix cache's shared blocks), in order;
//! 3. gives every sequence with one token to go a block when its position starts one; when the
//!    pool is out of blocks the newest running sequence is preempted (its blocks freed, its
//!    tokens so far kept) and recomputed when it is admitted again, so a full pool costs time,
//!    never an error or a different answer;
//! 4. runs one step: a chunk of the oldest sequence still prefilling, within the token budget
//!    `max_num_batched_tokens` less the decode rows (and, beside decode rows, within
//!    `mixed_attention_budget`'s query-key pairs: [`mixed_chunk`]), together with one token of
//!    every decoding sequence (a mixed step, as vLLM's chunked prefill), or either alone.
//!
//! Sampling is per sequence (its own parameters and seeded generator), stop tokens and stop
//! strings per sequence. A step chooses the next token where it ran for every sequence that
//! needs no logits on the host (no logit bias, grammar or requested logits): `PenalizeRows`
//! over the ids it has seen, then `SampleRows` (the argmax, or a draw from the sequence's
//! seeded generator), so only token ids come back; the other sequences' rows are read back and
//! chosen here.
//! A sequence may carry a [`TokenConstraint`]: its mask for the next token is computed on a
//! host thread while the device runs the step, and applied to its logits row before sampling.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use loader::tokenizer::Tokenizer;
use rayon::prelude::*;

use crate::constraint::{TokenConstraint, TokenMask};
use crate::output::TextStream;
use crate::paged::BlockPool;
use crate::sampling::{Sampler, SeenTokens, argmax};
use crate::{DeviceChoice, RowSampling};
use crate::{Engine, EngineError, FinishReason, GenerateRequest, SeqSlice};

/// Limits of a scheduler.
#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    /// Sequences running at once (at most the engine's `max_num_seqs`).
    pub max_num_seqs: usize,
    /// Tokens one step may carry: decode rows plus the prefill chunk.
    pub max_num_batched_tokens: usize,
    /// Share full prompt blocks between sequences by the hash of their token prefix.
    pub prefix_caching: bool,
    /// Choose every token on the host from a logits row copied back (A/B measurements of
    /// the choice where the step ran).
    pub sample_on_host: bool,
    /// Attention a mixed step's chunk may do, in query-key pairs (its tokens times the
    /// positions they reach); 0: no bound. Beside decode rows, a chunk deep in a long prompt
    /// costs every running sequence that step's latency (see [`mixed_chunk`]).
    pub mixed_attention_budget: usize,
    /// Tokens a prompt's chunk may carry in a step that also decodes (0: no bound beyond
    /// `max_num_batched_tokens`). A mixed step lasts as long as its chunk's prefill, and every
    /// running sequence waits for it: this bounds their inter-token latency while prompts are
    /// admitted, at the cost of more, shorter steps for the prompt.
    pub mixed_chunk_tokens: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_num_seqs: 64,
            max_num_batched_tokens: 4096,
            prefix_caching: true,
            sample_on_host: false,
            mixed_attention_budget: 0,
            mixed_chunk_tokens: DEFAULT_MIXED_CHUNK_TOKENS,
        }
    }
}

/// The default of [`SchedulerConfig::mixed_chunk_tokens`]: no bound, throughput first. H200,
/// full checkpoint, 64 streaming clients with 512-token prompts for 60 s: no bound 2,424
/// tok/s with an inter-token p99 of 46.1 ms (a prompt whole beside 64 decode rows, a 45 ms
/// step); 256 tokens 2,160 tok/s, p99 38.0 ms; 128 tokens 1,875 tok/s, p99 32.7 ms.
pub const DEFAULT_MIXED_CHUNK_TOKENS: usize = 0;

/// Tokens a chunk cut by the attention budget is a multiple of (and at least): chunk lengths
/// a long prompt meets stay few (each is a plan the engine builds once), and 16 rows are what
/// the flash attention takes over a deep context.
pub const MIXED_CHUNK_QUANTUM: usize = 16;

/// The most tokens a step's prefill chunk may take: the engine's chunk size within the step's
/// token budget, and beside decode rows (`mixed`) within `mixed_chunk_tokens` (0: no bound).
pub fn chunk_cap(
    prefill_chunk: usize,
    budget: usize,
    mixed: bool,
    mixed_chunk_tokens: usize,
) -> usize {
    let cap = prefill_chunk.max(1).min(budget.max(1));
    if mixed && mixed_chunk_tokens > 0 {
        cap.min(mixed_chunk_tokens)
    } else {
        cap
    }
}

/// Tokens of the prefill chunk a step takes of a prompt with `computed` positions done and
/// `remaining` to go, at most `cap` (the token budget and the engine's chunk size). Beside
/// decode rows (`mixed`) with a `budget` of query-key pairs, the chunk is the longest multiple
/// of `quantum` whose attention, `chunk × (computed + chunk)` pairs, fits it, and at least one
/// quantum so the prompt always advances; the rest of the prompt is taken whole when it fits.
/// H200, 64 decode rows, a 16,384-token prompt joining in 64-token chunks: a step at depth 8k
/// is 33 ms, of which 12 ms the chunk's attention, and the attention grows with the depth.
pub fn mixed_chunk(
    remaining: usize,
    computed: usize,
    cap: usize,
    mixed: bool,
    budget: usize,
    quantum: usize,
) -> usize {
    let chunk = remaining.min(cap.max(1));
    if !mixed || budget == 0 {
        return chunk;
    }
    let fits = |c: usize| c.saturating_mul(computed + c) <= budget;
    if fits(chunk) {
        return chunk;
    }
    let quantum = quantum.max(1);
    // The largest c with c·(computed + c) ≤ budget, then down to whole quanta.
    let mut c = ((computed * computed + 4 * budget) as f64).sqrt() as usize;
    c = c.saturating_sub(computed) / 2;
    while c > 0 && !fits(c) {
        c -= 1;
    }
    while fits(c + 1) {
        c += 1;
    }
    (c / quantum * quantum).clamp(quantum.min(chunk), chunk)
}

/// A sequence's handle.
pub type SeqId = u64;

/// What a step produced for the callers.
#[derive(Clone, Debug, PartialEq)]
pub enum SeqEvent {
    /// A generated token and the text that became final with it; its logits row when the
    /// request asked for logits.
    Token {
        seq: SeqId,
        id: u32,
        text: String,
        logits: Option<Vec<f32>>,
    },
    /// The sequence ended; its blocks are back in the pool. `text` is what the stream had
    /// not yet handed out (held stop-string prefixes, incomplete UTF-8).
    Finished {
        seq: SeqId,
        finish: FinishReason,
        rest: String,
        usage: SeqUsage,
    },
    /// The request cannot run (a prompt longer than the context, an id outside the
    /// vocabulary); nothing was generated.
    Failed { seq: SeqId, error: String },
}

/// Token counts of a finished sequence.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SeqUsage {
    pub prompt_tokens: usize,
    /// Prompt positions served from the prefix cache at first admission.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// Times the sequence was preempted and recomputed.
    pub preemptions: usize,
}

/// Counters since the scheduler started.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SchedulerStats {
    pub running: usize,
    pub waiting: usize,
    pub preemptions: u64,
    pub steps: u64,
    /// Steps that carried a prefill chunk and decode rows together.
    pub mixed_steps: u64,
    /// Sequences in the last decode step.
    pub last_batch: usize,
    /// Referenced blocks over all blocks.
    pub cache_usage: f64,
    pub blocks_total: usize,
    pub blocks_available: usize,
    /// Where the loop's time went.
    pub time: StepTime,
}

/// Steps by kind and the wall time the engine took for them (the step and its outputs'
/// read-back), the host's sampling time, and the engine's plan builds (inside the steps'
/// time): what a server's step rate is made of.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTime {
    pub decode: KindTime,
    /// Steps with a prefill chunk and decode rows.
    pub mixed: KindTime,
    /// Steps with a prefill chunk alone.
    pub prefill: KindTime,
    /// Choosing tokens from logits rows and turning them into text on the host, after the
    /// steps.
    pub host_token_seconds: f64,
    pub plan_builds: crate::PlanBuilds,
}

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct KindTime {
    pub steps: u64,
    pub seconds: f64,
}

impl KindTime {
    fn add(&mut self, seconds: f64) {
        self.steps += 1;
        self.seconds += seconds;
    }
}

struct Seq {
    id: SeqId,
    req: GenerateRequest,
    /// The prompt and every token generated so far.
    tokens: Vec<u32>,
    /// Their distinct ids, for a repetition penalty applied where the step runs.
    seen: SeenTokens,
    /// Positions whose cache rows are written (`tokens[..computed]`).
    computed: usize,
    blocks: Vec<u32>,
    sampler: Sampler,
    out: TextStream<Arc<Tokenizer>>,
    usage: SeqUsage,
    admitted_once: bool,
    cancelled: bool,
    /// Not admitted before this sequence has prefilled its prompt (its full blocks are then
    /// in the prefix cache for this one to share).
    wait_for: Option<SeqId>,
    /// Locked by the mask thread during a step, by the sampler after it.
    constraint: Option<Mutex<Box<dyn TokenConstraint>>>,
}

impl Seq {
    fn generated(&self) -> usize {
        self.tokens.len() - self.req.prompt.len()
    }

    /// Whether the step can choose this sequence's next token where it ran.
    fn chosen_on_device(&self) -> bool {
        let p = &self.req.sampling;
        !self.req.want_logits && p.on_device() && self.constraint.is_none()
    }
}

/// The continuous-batching loop's state over one engine.
pub struct Scheduler {
    engine: Engine,
    pool: BlockPool,
    config: SchedulerConfig,
    tokenizer: Option<Arc<Tokenizer>>,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    next_id: SeqId,
    preemptions: u64,
    steps: u64,
    mixed_steps: u64,
    last_batch: usize,
    time: StepTime,
}

impl Scheduler {
    /// A scheduler owning `engine` and every block of its pool. `tokenizer` turns tokens
    /// into text and stop strings (without one, only stop tokens end a sequence early).
    pub fn new(
        engine: Engine,
        config: SchedulerConfig,
        tokenizer: Option<Arc<Tokenizer>>,
    ) -> Scheduler {
        let pool = engine.pool();
        let max_num_seqs = config
            .max_num_seqs
            .clamp(1, engine.config().max_num_seqs.max(1));
        Scheduler {
            engine,
            pool: BlockPool::new(pool.blocks, pool.block_size),
            config: SchedulerConfig {
                max_num_seqs,
                max_num_batched_tokens: config.max_num_batched_tokens.max(1),
                ..config
            },
            tokenizer,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 1,
            preemptions: 0,
            steps: 0,
            mixed_steps: 0,
            last_batch: 0,
            time: StepTime::default(),
        }
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    pub fn engine_mut(&mut self) -> &mut Engine {
        &mut self.engine
    }

    /// The engine back, for a caller that runs another scheduler on it; whatever is queued
    /// or running is dropped.
    pub fn into_engine(self) -> Engine {
        self.engine
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Queues a request that shares `first`'s prompt (another choice of the same request,
    /// `n` > 1): it is admitted once `first` has prefilled, and takes `first`'s full prompt
    /// blocks from the prefix cache instead of computing them again.
    pub fn add_sharing(&mut self, req: GenerateRequest, first: SeqId) -> SeqId {
        let id = self.add(req);
        if let Some(s) = self.waiting.back_mut() {
            s.wait_for = Some(first);
        }
        id
    }

    /// Queues a request; it runs once admitted.
    pub fn add(&mut self, req: GenerateRequest) -> SeqId {
        let id = self.next_id;
        self.next_id += 1;
        let seq = Seq {
            id,
            tokens: req.prompt.clone(),
            seen: SeenTokens::new(&req.prompt),
            computed: 0,
            blocks: Vec::new(),
            sampler: Sampler::new(req.sampling.clone()),
            out: TextStream::new(self.tokenizer.clone()),
            usage: SeqUsage {
                prompt_tokens: req.prompt.len(),
                ..SeqUsage::default()
            },
            admitted_once: false,
            cancelled: false,
            wait_for: None,
            constraint: None,
            req,
        };
        self.waiting.push_back(seq);
        id
    }

    /// Gives a queued sequence a constraint on every token it generates. False when `seq` is
    /// not queued (constraints are set before the first step).
    pub fn constrain(&mut self, seq: SeqId, constraint: Box<dyn TokenConstraint>) -> bool {
        match self.waiting.iter_mut().find(|s| s.id == seq) {
            Some(s) => {
                s.constraint = Some(Mutex::new(constraint));
                true
            }
            None => false,
        }
    }

    /// Marks `seq` cancelled: it leaves at the next step boundary with
    /// [`FinishReason::Cancelled`]. False when no such sequence is queued or running.
    pub fn cancel(&mut self, seq: SeqId) -> bool {
        match self
            .waiting
            .iter_mut()
            .chain(self.running.iter_mut())
            .find(|s| s.id == seq)
        {
            Some(s) => {
                s.cancelled = true;
                true
            }
            None => false,
        }
    }

    /// True while any sequence is queued or running.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            preemptions: self.preemptions,
            steps: self.steps,
            mixed_steps: self.mixed_steps,
            last_batch: self.last_batch,
            cache_usage: self.pool.usage(),
            blocks_total: self.pool.total(),
            blocks_available: self.pool.available(),
            time: StepTime {
                plan_builds: self.engine.plan_builds(),
                ..self.time
            },
        }
    }

    /// One scheduling iteration (see the module doc). Events come in the order they
    /// happened; an engine error fails the sequences of the step that hit it, and the
    /// others go on.
    pub fn step(&mut self) -> Vec<SeqEvent> {
        let mut events = Vec::new();
        self.reap_cancelled(&mut events);
        self.admit(&mut events);
        let decoding: Vec<SeqId> = self
            .running
            .iter()
            .filter(|s| s.tokens.len() - s.computed == 1)
            .map(|s| s.id)
            .collect();
        let decoding = self.ensure_blocks(&decoding);
        let budget = self
            .config
            .max_num_batched_tokens
            .saturating_sub(decoding.len());
        let prefill = self
            .running
            .iter()
            .find(|s| s.tokens.len() - s.computed > 1)
            .map(|s| {
                let chunk = mixed_chunk(
                    s.tokens.len() - s.computed,
                    s.computed,
                    chunk_cap(
                        self.engine.config().prefill_chunk,
                        budget.max(self.pool.block_size()),
                        !decoding.is_empty(),
                        self.config.mixed_chunk_tokens,
                    ),
                    !decoding.is_empty(),
                    self.config.mixed_attention_budget,
                    MIXED_CHUNK_QUANTUM,
                );
                (s.id, chunk)
            });
        self.last_batch = decoding.len();
        if prefill.is_some() || !decoding.is_empty() {
            self.forward(prefill, &decoding, &mut events);
        }
        self.steps += 1;
        events
    }

    /// Runs steps until every queued sequence has finished; returns all events.
    pub fn run_to_completion(&mut self) -> Vec<SeqEvent> {
        let mut all = Vec::new();
        while self.has_work() {
            all.extend(self.step());
        }
        all
    }

    fn reap_cancelled(&mut self, events: &mut Vec<SeqEvent>) {
        let mut k = 0;
        while k < self.running.len() {
            if self.running[k].cancelled {
                let s = self.running.remove(k);
                self.finish(s, FinishReason::Cancelled, events);
            } else {
                k += 1;
            }
        }
        let (gone, kept): (Vec<Seq>, Vec<Seq>) = self.waiting.drain(..).partition(|s| s.cancelled);
        self.waiting = kept.into();
        for s in gone {
            self.finish(s, FinishReason::Cancelled, events);
        }
    }

    /// Moves waiting sequences to running while they fit, first come first served: a
    /// sequence that does not fit stops admission (no overtaking).
    fn admit(&mut self, events: &mut Vec<SeqEvent>) {
        let max_len = self.engine.config().max_model_len;
        let block = self.pool.block_size();
        while self.running.len() < self.config.max_num_seqs {
            if let Some(first) = self.waiting.front().and_then(|s| s.wait_for) {
                // The sibling waits (and, first come first served, so does everyone behind
                // it) while the first is queued or still prefilling.
                let queued = self.waiting.iter().any(|s| s.id == first);
                let prefilling = self
                    .running
                    .iter()
                    .any(|s| s.id == first && s.tokens.len() - s.computed > 1);
                if queued || prefilling {
                    break;
                }
            }
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            s.wait_for = None;
            if s.tokens.is_empty() {
                events.push(SeqEvent::Failed {
                    seq: s.id,
                    error: EngineError::EmptyPrompt.to_string(),
                });
                continue;
            }
            if s.req.max_tokens == 0 {
                // Nothing to generate: done without a step.
                self.finish(s, FinishReason::Length, events);
                continue;
            }
            if s.tokens.len() > max_len {
                let e = EngineError::ContextFull {
                    cached: 0,
                    adding: s.tokens.len(),
                    max: max_len,
                };
                events.push(SeqEvent::Failed {
                    seq: s.id,
                    error: e.to_string(),
                });
                continue;
            }
            // Full blocks of everything but the last token: that one must be forwarded for
            // its logits, so no shared block is ever written.
            let shared = if self.config.prefix_caching {
                self.pool.lookup_prefix(&s.tokens[..s.tokens.len() - 1])
            } else {
                Vec::new()
            };
            let need = s.tokens.len().div_ceil(block).saturating_sub(shared.len());
            match self.pool.allocate_n(need) {
                Some(fresh) => {
                    s.computed = shared.len() * block;
                    if !s.admitted_once {
                        s.usage.cached_tokens = s.computed;
                        s.admitted_once = true;
                    }
                    s.blocks = shared;
                    s.blocks.extend(fresh);
                    self.running.push(s);
                }
                None => {
                    let _ = self.pool.release_all(&shared);
                    self.waiting.push_front(s);
                    break;
                }
            }
        }
    }

    fn index_of(&self, id: SeqId) -> Option<usize> {
        self.running.iter().position(|s| s.id == id)
    }

    /// A block for each of `ids` whose next position starts one, preempting the newest
    /// running sequence while the pool has none; returns the ids still running.
    fn ensure_blocks(&mut self, ids: &[SeqId]) -> Vec<SeqId> {
        let block = self.pool.block_size();
        for &id in ids {
            while let Some(k) = self.index_of(id) {
                let s = &self.running[k];
                if s.computed < s.blocks.len() * block {
                    break;
                }
                if let Some(b) = self.pool.allocate() {
                    self.running[k].blocks.push(b);
                    break;
                }
                self.preempt_newest();
            }
        }
        ids.iter()
            .copied()
            .filter(|&id| self.index_of(id).is_some())
            .collect()
    }

    /// One step: a chunk of `prefill`'s sequence (if any) and one token of each of `decode`,
    /// together (a mixed step), alone, or as a plain decode.
    fn forward(
        &mut self,
        prefill: Option<(SeqId, usize)>,
        decode: &[SeqId],
        events: &mut Vec<SeqEvent>,
    ) {
        // Rows in step order: the chunk first, then the decode rows.
        let mut order: Vec<(usize, usize)> = Vec::with_capacity(decode.len() + 1);
        if let Some((id, chunk)) = prefill
            && let Some(k) = self.index_of(id)
        {
            order.push((k, chunk));
        }
        order.extend(
            decode
                .iter()
                .filter_map(|&id| self.index_of(id))
                .map(|k| (k, 1)),
        );
        if order.is_empty() {
            return;
        }
        let chunk_ends = |s: &Seq, n: usize| s.computed + n == s.tokens.len();
        // The rows whose logits the host rewrites before choosing (a penalty, a bias, a
        // grammar) or that the request wants: the step reads the logits back for them too.
        let host_rows: Vec<usize> = (0..order.len())
            .filter(|&j| {
                let (k, n) = order[j];
                let s = &self.running[k];
                chunk_ends(s, n) && !s.chosen_on_device()
            })
            .collect();
        let on_host = match (host_rows.first(), host_rows.last()) {
            (Some(&a), Some(&b)) => a..b + 1,
            _ => 0..0,
        };
        // Each row's parameters and penalty, its uniform drawn now (a row the host chooses,
        // or one of a chunk that does not end its prompt, takes the argmax without a penalty
        // and draws nothing).
        let rows: Option<Vec<(RowSampling, f32)>> = (!self.config.sample_on_host).then(|| {
            order
                .iter()
                .map(|&(k, n)| {
                    let s = &mut self.running[k];
                    if chunk_ends(s, n) && s.chosen_on_device() {
                        (s.sampler.device_row(), s.req.sampling.repetition_penalty)
                    } else {
                        (RowSampling::GREEDY, 1.0)
                    }
                })
                .collect()
        });
        let choose: Option<Vec<DeviceChoice<'_>>> = rows.map(|rows| {
            rows.into_iter()
                .zip(&order)
                .map(|((row, penalty), &(k, _))| DeviceChoice {
                    row,
                    penalty,
                    seen: self.running[k].seen.ids(),
                })
                .collect()
        });
        let slices: Vec<SeqSlice<'_>> = order
            .iter()
            .map(|&(k, n)| {
                let s = &self.running[k];
                SeqSlice {
                    blocks: &s.blocks,
                    start: s.computed,
                    tokens: &s.tokens[s.computed..s.computed + n],
                }
            })
            .collect();
        let ids: Vec<SeqId> = order.iter().map(|&(k, _)| self.running[k].id).collect();
        if order.len() > 1 && order[0].1 > 1 {
            self.mixed_steps += 1;
        }
        // The masks of the constrained rows that end in a token, on a host thread while the
        // device runs the step (the step stays on this thread: it owns the device context).
        let constrained: Vec<(SeqId, &Mutex<Box<dyn TokenConstraint>>)> = order
            .iter()
            .filter(|&&(k, n)| chunk_ends(&self.running[k], n))
            .filter_map(|&(k, _)| {
                let s = &self.running[k];
                s.constraint.as_ref().map(|c| (s.id, c))
            })
            .collect();
        let engine = &mut self.engine;
        let started = std::time::Instant::now();
        let (result, masks) = if constrained.is_empty() {
            (
                engine.step_sequences(&slices, choose.as_deref(), on_host.clone()),
                Masks::new(),
            )
        } else {
            std::thread::scope(|scope| {
                let worker = scope.spawn(|| {
                    constrained
                        .iter()
                        .map(|(id, c)| {
                            let mask = match c.lock() {
                                Ok(mut c) => c.next_mask(),
                                Err(_) => Err("the constraint panicked earlier".to_string()),
                            };
                            (*id, mask)
                        })
                        .collect::<Masks>()
                });
                let result = engine.step_sequences(&slices, choose.as_deref(), on_host.clone());
                let masks = worker.join().unwrap_or_else(|_| {
                    constrained
                        .iter()
                        .map(|(id, _)| (*id, Err("computing the token mask panicked".to_string())))
                        .collect()
                });
                (result, masks)
            })
        };
        let kind = match (order[0].1 > 1, order.len() > 1) {
            (false, _) => &mut self.time.decode,
            (true, true) => &mut self.time.mixed,
            (true, false) => &mut self.time.prefill,
        };
        kind.add(started.elapsed().as_secs_f64());
        match result {
            Ok(out) => {
                let host_only = self.config.sample_on_host;
                let mut picks = Vec::with_capacity(order.len());
                for (j, &(k, n)) in order.iter().enumerate() {
                    let ends = chunk_ends(&self.running[k], n);
                    let s = &mut self.running[k];
                    s.computed += n;
                    if n > 1 && self.config.prefix_caching {
                        self.pool
                            .register_prefix(&s.blocks, &s.tokens[..s.computed]);
                    }
                    // A chunk that does not end its sequence's tokens has no next token yet.
                    if ends {
                        let row = match out.token(j) {
                            Some(t) if !host_only && s.chosen_on_device() => {
                                Row::Token(t.map_err(|e| format!("the step's choice: {e}")))
                            }
                            _ => Row::Logits(out.logits_row(j)),
                        };
                        picks.push((s.id, row));
                    }
                }
                let started = std::time::Instant::now();
                self.sampled(picks, masks, events);
                self.time.host_token_seconds += started.elapsed().as_secs_f64();
            }
            Err(e) => {
                // The step as a whole failed: every sequence in it is failed, the rest go on.
                let msg = e.to_string();
                for id in ids {
                    if let Some(k) = self.index_of(id) {
                        let s = self.running.remove(k);
                        self.fail(s, msg.clone(), events);
                    }
                }
            }
        }
    }

    /// Frees the newest running sequence's blocks and puts it at the front of the queue; its
    /// tokens so far are recomputed when it is admitted again.
    fn preempt_newest(&mut self) {
        if let Some(mut s) = self.running.pop() {
            let _ = self.pool.release_all(&s.blocks);
            s.blocks.clear();
            s.computed = 0;
            s.usage.preemptions += 1;
            self.preemptions += 1;
            self.waiting.push_front(s);
        }
    }

    /// Takes each sequence's next token from its row and ends the ones that are done.
    fn sampled(
        &mut self,
        picks: Vec<(SeqId, Row<'_>)>,
        mut masks: Masks,
        events: &mut Vec<SeqEvent>,
    ) {
        let max_len = self.engine.config().max_model_len;
        // Sampling from a vocabulary-wide row is the host's share of a step (a sort of 131,072
        // candidates each): the rows are sampled in parallel, each with its own generator.
        let mut rows: Vec<Option<(Row<'_>, Option<MaskResult>)>> =
            (0..self.running.len()).map(|_| None).collect();
        let mut order = Vec::with_capacity(picks.len());
        for (id, row) in picks {
            if let Some(k) = self.index_of(id) {
                rows[k] = Some((row, masks.remove(&id)));
                order.push(id);
            }
        }
        let chosen: Vec<Option<Chosen>> = self
            .running
            .par_iter_mut()
            .zip(rows.into_par_iter())
            .map(|(s, row)| row.map(|(row, mask)| choose(s, row, mask)))
            .collect();
        let mut chosen: HashMap<SeqId, Chosen> = self
            .running
            .iter()
            .zip(chosen)
            .filter_map(|(s, c)| c.map(|c| (s.id, c)))
            .collect();
        for id in order {
            let (Some(k), Some(c)) = (self.index_of(id), chosen.remove(&id)) else {
                continue;
            };
            let (token, logits) = match c {
                Ok(c) => c,
                Err(e) => {
                    let s = self.running.remove(k);
                    self.fail(s, e, events);
                    continue;
                }
            };
            let s = &mut self.running[k];
            if s.req.stop_tokens.contains(&token) {
                let s = self.running.remove(k);
                self.finish(s, FinishReason::Stop, events);
                continue;
            }
            s.tokens.push(token);
            s.seen.extend(&[token]);
            s.usage.completion_tokens = s.generated();
            let (text, stop_hit) = match s.out.push(token, &s.req.stop_strings) {
                Ok(v) => v,
                Err(e) => {
                    let s = self.running.remove(k);
                    self.fail(s, e.to_string(), events);
                    continue;
                }
            };
            events.push(SeqEvent::Token {
                seq: id,
                id: token,
                text,
                logits,
            });
            let done = if stop_hit {
                Some(FinishReason::Stop)
            } else if s.generated() >= s.req.max_tokens || s.tokens.len() >= max_len {
                Some(FinishReason::Length)
            } else {
                None
            };
            if let Some(finish) = done {
                let s = self.running.remove(k);
                self.finish(s, finish, events);
            }
        }
    }

    fn finish(&mut self, mut s: Seq, finish: FinishReason, events: &mut Vec<SeqEvent>) {
        let _ = self.pool.release_all(&s.blocks);
        let emitted = s.out.emitted();
        let text = s.out.finish();
        events.push(SeqEvent::Finished {
            seq: s.id,
            finish,
            rest: text.get(emitted..).unwrap_or_default().to_string(),
            usage: s.usage,
        });
    }

    fn fail(&mut self, s: Seq, error: String, events: &mut Vec<SeqEvent>) {
        let _ = self.pool.release_all(&s.blocks);
        events.push(SeqEvent::Failed { seq: s.id, error });
    }
}

type MaskResult = Result<Option<TokenMask>, String>;
type Masks = HashMap<SeqId, MaskResult>;
/// A sequence's next token and its logits row (when asked for), or why it cannot go on.
type Chosen = Result<(u32, Option<Vec<f32>>), String>;

/// The next token of `s` from its row (masked by its constraint, which then takes the token),
/// and a copy of the row only when the request wants logits (a step's rows are 64 × 131,072
/// floats; copying them all was the step's largest host allocation). The logits reported are
/// the model's, before the mask.
fn choose(s: &mut Seq, row: Row<'_>, mask: Option<MaskResult>) -> Chosen {
    let t = match row {
        Row::Token(ref t) => t.clone()?,
        Row::Logits(None) => return Err("the step read back no logits row for it".to_string()),
        Row::Logits(Some(l)) => {
            let masked;
            let row = match mask.transpose()?.flatten() {
                Some(m) => {
                    let mut r = l.to_vec();
                    m.apply(&mut r)?;
                    masked = r;
                    &masked[..]
                }
                None => l,
            };
            if s.req.sampling.is_plain_greedy() {
                argmax(row) as u32
            } else {
                s.sampler.sample(row, &s.tokens)
            }
        }
    };
    if let Some(c) = s.constraint.as_mut() {
        c.get_mut()
            .map_err(|_| "the constraint panicked earlier".to_string())?
            .commit(t)?;
    }
    let logits = match row {
        Row::Logits(Some(l)) if s.req.want_logits => Some(l.to_vec()),
        _ => None,
    };
    Ok((t, logits))
}

/// One sequence's part of a step's output, borrowed from it: the token the step chose, or
/// its logits row for the host to choose from.
enum Row<'a> {
    Token(Result<u32, String>),
    Logits(Option<&'a [f32]>),
}

#[cfg(test)]
mod tests {
    use super::{MIXED_CHUNK_QUANTUM, chunk_cap, mixed_chunk};

    #[test]
    fn a_chunk_beside_decode_rows_keeps_its_attention_within_the_budget_in_whole_quanta() {
        // 64-token steps, quanta of 16, 600k pairs: shallow chunks take the whole cap, deep
        // ones shrink, never below a quantum.
        assert_eq!(MIXED_CHUNK_QUANTUM, 16);
        let chunk = |remaining, computed| {
            mixed_chunk(remaining, computed, 64, true, 600_000, MIXED_CHUNK_QUANTUM)
        };
        assert_eq!(chunk(16_384, 0), 64);
        assert_eq!(chunk(16_384 - 8192, 8192), 64);
        assert_eq!(chunk(2048, 14_336), 32);
        assert_eq!(chunk(100, 100_000), 16);
        // The prompt's last few tokens are taken whole when they fit.
        assert_eq!(chunk(40, 10_000), 40);
        for computed in (0..200_000).step_by(977) {
            for remaining in [1, 15, 16, 17, 64, 1000] {
                let c = chunk(remaining, computed);
                assert!(
                    c >= 1 && c <= remaining.min(64),
                    "{remaining} at {computed}: {c}"
                );
                let whole = c == remaining.min(64);
                assert!(whole || c % 16 == 0, "{remaining} at {computed}: {c}");
                assert!(
                    c * (computed + c) <= 600_000 || c == 16.min(remaining),
                    "{remaining} at {computed}: {c} over the budget"
                );
                // The longest such chunk: one block more would not fit (or pass the cap).
                if !whole && c > 16 {
                    assert!((c + 16) * (computed + c + 16) > 600_000);
                }
            }
        }
    }

    #[test]
    fn without_decode_rows_or_a_budget_the_chunk_is_the_token_cap() {
        assert_eq!(mixed_chunk(5000, 100_000, 2048, false, 600_000, 16), 2048);
        assert_eq!(mixed_chunk(5000, 100_000, 2048, true, 0, 16), 2048);
        assert_eq!(mixed_chunk(300, 0, 2048, true, 0, 16), 300);
    }

    #[test]
    fn a_chunk_beside_decode_rows_is_held_to_the_mixed_cap_and_a_lone_prefill_is_not() {
        // Engine chunks of 4096, a step budget of 4096 less 64 decode rows.
        assert_eq!(chunk_cap(4096, 4032, true, 256), 256);
        assert_eq!(chunk_cap(4096, 4096, false, 256), 4096);
        // 0: no mixed cap; the step's budget and the engine's chunk still hold.
        assert_eq!(chunk_cap(4096, 4032, true, 0), 4032);
        assert_eq!(chunk_cap(512, 4032, true, 0), 512);
        assert_eq!(chunk_cap(4096, 100, true, 256), 100);
        // Degenerate settings still take a token.
        assert_eq!(chunk_cap(0, 0, true, 0), 1);
    }
}
