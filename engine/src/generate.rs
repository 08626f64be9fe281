//! The decode loop: prefill, sample, stream, stop.

use std::ops::ControlFlow;
use std::time::Instant;

use graph::LogitRows;
use loader::tokenizer::Tokenizer;

use crate::output::TextStream;
use crate::sampling::{Sampler, SamplingParams, SeenTokens};
use crate::{DeviceChoice, Engine, EngineError};

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation ends after any of these ids (the id is not part of the text).
    pub stop_tokens: Vec<u32>,
    /// Generation ends where the text contains any of these (the stop text is not returned).
    pub stop_strings: Vec<String>,
    /// Every `TokenEvent` carries its logits row (for logprobs), even where a greedy
    /// GPU step could end in an on-card argmax.
    pub want_logits: bool,
}

impl GenerateRequest {
    /// Greedy tokens up to `max_tokens`, no stops, no logits rows: what benches and tests ask.
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
        GenerateRequest {
            prompt,
            max_tokens,
            sampling: SamplingParams::greedy(),
            stop_tokens: vec![],
            stop_strings: vec![],
            want_logits: false,
        }
    }
}

/// One generated token, handed to the streaming callback.
#[derive(Clone, Debug)]
pub struct TokenEvent<'a> {
    pub id: u32,
    /// Text that became final with this token (held back while it might start a stop string).
    pub text: &'a str,
    /// The logits row this token was sampled from; empty when a greedy step on a
    /// GPU chose the token on the card (only its id came back).
    pub logits: &'a [f32],
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` or the context limit.
    Length,
    /// The callback asked to stop.
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// Rates, with the first decode step apart from the steady ones (seed §6).
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub prompt_tokens: usize,
    /// Prompt tokens actually forwarded (fewer than `prompt_tokens` after a prefix hit).
    pub prefilled_tokens: usize,
    pub prefill_seconds: f64,
    pub generated_tokens: usize,
    pub first_step_seconds: f64,
    /// Decode steps after the first, and their time.
    pub steady_steps: usize,
    pub steady_seconds: f64,
}

impl Stats {
    pub fn prefill_tok_per_s(&self) -> f64 {
        rate(self.prefilled_tokens, self.prefill_seconds)
    }

    pub fn decode_tok_per_s(&self) -> f64 {
        rate(self.steady_steps, self.steady_seconds)
    }
}

fn rate(n: usize, s: f64) -> f64 {
    if s > 0.0 { n as f64 / s } else { 0.0 }
}

#[derive(Clone, Debug)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish: FinishReason,
    pub stats: Stats,
}

impl Engine {
    /// Generates from `req.prompt` after whatever the cache already holds is reset.
    pub fn generate(
        &mut self,
        req: &GenerateRequest,
        tokenizer: Option<&Tokenizer>,
        on_token: impl FnMut(TokenEvent<'_>) -> ControlFlow<()>,
    ) -> Result<Generation, EngineError> {
        self.reset();
        self.generate_from(req, 0, tokenizer, on_token)
    }

    /// Generates from `req.prompt`, reusing the first `reuse` cached positions (the
    /// caller guarantees they hold that prefix of the prompt; the reset belongs here).
    pub fn generate_from(
        &mut self,
        req: &GenerateRequest,
        reuse: usize,
        tokenizer: Option<&Tokenizer>,
        mut on_token: impl FnMut(TokenEvent<'_>) -> ControlFlow<()>,
    ) -> Result<Generation, EngineError> {
        if req.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let reuse = reuse.min(req.prompt.len() - 1).min(self.cached_len());
        self.truncate(reuse);
        let mut stats = Stats {
            prompt_tokens: req.prompt.len(),
            prefilled_tokens: req.prompt.len() - reuse,
            ..Stats::default()
        };
        // Without a penalty or a bias no logits are needed on the host: on a GPU the step
        // ends in the token choice and 4 bytes come back.
        let on_device = self.on_gpu() && !req.want_logits && req.sampling.on_device();
        let mut sampler = Sampler::new(req.sampling.clone());
        let mut seen = SeenTokens::new(&req.prompt);
        let penalty = req.sampling.repetition_penalty;
        let mut logits = Vec::new();
        let mut next = None;
        let t0 = Instant::now();
        if on_device {
            let choice = DeviceChoice {
                row: sampler.device_row(),
                penalty,
                seen: seen.ids(),
            };
            next = Some(self.forward_choose(&req.prompt[reuse..], choice)?);
        } else {
            logits = self.forward(&req.prompt[reuse..], LogitRows::Last)?;
        }
        stats.prefill_seconds = t0.elapsed().as_secs_f64();

        let mut history = req.prompt.clone();
        let mut tokens = Vec::new();
        let mut out = TextStream::new(tokenizer);
        let mut finish = FinishReason::Length;
        let max_len = self.config().max_model_len;
        while tokens.len() < req.max_tokens {
            let id = match next.take() {
                Some(id) => id,
                None => sampler.sample(&logits, &history),
            };
            if req.stop_tokens.contains(&id) {
                finish = FinishReason::Stop;
                break;
            }
            tokens.push(id);
            history.push(id);
            seen.extend(&[id]);
            let (delta, stop_hit) = out.push(id, &req.stop_strings)?;
            let flow = on_token(TokenEvent {
                id,
                text: &delta,
                logits: &logits,
            });
            if stop_hit {
                finish = FinishReason::Stop;
                break;
            }
            if flow.is_break() {
                finish = FinishReason::Cancelled;
                break;
            }
            if tokens.len() >= req.max_tokens || self.cached_len() + 1 > max_len {
                finish = FinishReason::Length;
                break;
            }
            let t = Instant::now();
            if on_device {
                let choice = DeviceChoice {
                    row: sampler.device_row(),
                    penalty,
                    seen: seen.ids(),
                };
                next = Some(self.forward_choose(&[id], choice)?);
            } else {
                logits = self.forward(&[id], LogitRows::Last)?;
            }
            let dt = t.elapsed().as_secs_f64();
            if tokens.len() == 1 {
                stats.first_step_seconds = dt;
            } else {
                stats.steady_steps += 1;
                stats.steady_seconds += dt;
            }
        }
        let text = out.finish();
        stats.generated_tokens = tokens.len();
        Ok(Generation {
            tokens,
            text,
            finish,
            stats,
        })
    }
}
