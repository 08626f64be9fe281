//! What the batching tests share: the `tiny` checkpoint, a scheduler over it with blocks of 16
//! positions, prompts of different lengths, and each sequence's tokens from a run's events.

#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::Arc;

use engine::scheduler::{Scheduler, SchedulerConfig, SeqEvent, SeqId, SeqUsage};
use engine::{Device, Engine, EngineConfig, FinishReason, GenerateRequest, Model};
use models::synth::Preset;

pub fn tiny() -> Arc<Model> {
    crate::support::synthetic(Preset::Tiny, 11, "batching")
}

/// The checkpoint a device runs: `tiny` on the CPU; `small` on a GPU, whose kernels need the
/// release's expert widths (multiples of 256) that `tiny` does not have.
pub fn model_for(device: Device) -> Arc<Model> {
    match device {
        Device::Cpu => tiny(),
        Device::Cuda(_) => crate::support::synthetic(Preset::Small, 11, "batching"),
    }
}

pub fn gpu_present() -> bool {
    ops::parity::test_gpu().is_some()
}

/// An engine with blocks of 16 positions (so short prompts span several) and `kv_blocks`
/// blocks (0: sized for `max_num_seqs` sequences).
pub fn scheduler(device: Device, kv_blocks: usize, prefix_caching: bool) -> Scheduler {
    scheduler_with(
        device,
        kv_blocks,
        SchedulerConfig {
            max_num_seqs: 8,
            max_num_batched_tokens: 64,
            prefix_caching,
            ..SchedulerConfig::default()
        },
    )
}

pub fn scheduler_with(device: Device, kv_blocks: usize, sched: SchedulerConfig) -> Scheduler {
    let config = EngineConfig {
        max_model_len: 128,
        prefill_chunk: 24,
        device,
        max_num_seqs: 8,
        block_size: 16,
        kv_blocks,
        ..EngineConfig::default()
    };
    let engine = Engine::new(model_for(device), config).unwrap_or_else(|e| panic!("{device}: {e}"));
    Scheduler::new(engine, sched, None)
}

pub fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 37 + salt * 101 + 5) % 500 + 3)
        .collect()
}

pub fn request(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest::greedy(prompt, max_tokens)
}

/// Each sequence's tokens, finish and usage from a run's events.
#[derive(Default)]
pub struct Outcome {
    pub tokens: HashMap<SeqId, Vec<u32>>,
    /// Each token's logits row, for requests that asked for them.
    pub logits: HashMap<SeqId, Vec<Vec<f32>>>,
    pub finished: HashMap<SeqId, (FinishReason, SeqUsage)>,
}

impl Outcome {
    pub fn take(&mut self, events: Vec<SeqEvent>) {
        for ev in events {
            match ev {
                SeqEvent::Token {
                    seq, id, logits, ..
                } => {
                    self.tokens.entry(seq).or_default().push(id);
                    if let Some(row) = logits {
                        self.logits.entry(seq).or_default().push(row);
                    }
                }
                SeqEvent::Finished {
                    seq, finish, usage, ..
                } => {
                    self.finished.insert(seq, (finish, usage));
                }
                SeqEvent::Failed { seq, error } => panic!("sequence {seq} failed: {error}"),
            }
        }
    }

    pub fn of(&self, seq: SeqId) -> Vec<u32> {
        self.tokens.get(&seq).cloned().unwrap_or_default()
    }

    pub fn logits_of(&self, seq: SeqId) -> Vec<Vec<f32>> {
        self.logits.get(&seq).cloned().unwrap_or_default()
    }
}

/// The greedy tokens of `req` decoded alone on a fresh scheduler, with each step's logits
/// (`req` must ask for them).
pub fn alone_with_logits(device: Device, req: &GenerateRequest) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut s = scheduler(device, 0, false);
    let id = s.add(req.clone());
    let mut out = Outcome::default();
    out.take(s.run_to_completion());
    (out.of(id), out.logits_of(id))
}

/// The greedy tokens of `req` decoded alone on a fresh scheduler.
pub fn alone(device: Device, req: &GenerateRequest) -> Vec<u32> {
    let mut s = scheduler(device, 0, false);
    let id = s.add(req.clone());
    let mut out = Outcome::default();
    out.take(s.run_to_completion());
    out.of(id)
}

pub fn prompts() -> Vec<GenerateRequest> {
    [(3, 0, 20), (17, 1, 14), (40, 2, 25), (1, 3, 9), (70, 4, 18)]
        .into_iter()
        .map(|(len, salt, n)| request(prompt(len, salt), n))
        .collect()
}

/// Allows only the tokens of `allowed` (a cycle: the n-th token must be `allowed[n % len]`),
/// and records what it was told.
pub struct Cycle {
    pub allowed: Vec<u32>,
    pub vocab: usize,
    pub seen: std::sync::Arc<std::sync::Mutex<Vec<u32>>>,
}

impl engine::TokenConstraint for Cycle {
    fn next_mask(&mut self) -> Result<Option<engine::TokenMask>, String> {
        let n = self.seen.lock().unwrap().len();
        let want = self.allowed[n % self.allowed.len()];
        Ok(Some(engine::TokenMask::of(self.vocab, &[want])))
    }

    fn commit(&mut self, token: u32) -> Result<(), String> {
        self.seen.lock().unwrap().push(token);
        Ok(())
    }
}
