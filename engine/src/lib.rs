//! Sessions over a loaded checkpoint: the absorbed KV cache, chunked prefill at
//! absolute positions, the decode loop, sampling, stop conditions, streaming with
//! cancellation at token boundaries, and rate statistics.

mod generate;
mod model;
pub mod sampling;

pub use generate::{FinishReason, GenerateRequest, Generation, Stats, TokenEvent};
pub use model::Model;
pub use sampling::{Sampler, SamplingParams};

use std::collections::HashMap;
use std::sync::Arc;

use graph::{Bucket, CpuExecutor, GraphBuilder, HostState, LogitRows, Plan, StepShape};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Graph(#[from] graph::GraphError),
    #[error(
        "the context is full: {cached} cached + {adding} new tokens exceed --max-model-len {max}"
    )]
    ContextFull {
        cached: usize,
        adding: usize,
        max: usize,
    },
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("{0}")]
    Tokenizer(String),
}

/// Engine settings fixed for a session's life.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Cache rows (positions) a sequence may use.
    pub max_model_len: usize,
    /// Tokens per prefill chunk (bounds the activations a chunk needs).
    pub prefill_chunk: usize,
    /// The smallest decode KV bucket (buckets are powers of two from here).
    pub min_kv_bucket: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_model_len: 4096,
            prefill_chunk: 256,
            min_kv_bucket: 64,
        }
    }
}

/// Cached positions copied out of an engine: per state buffer, `len` rows.
#[derive(Clone, Debug, Default)]
pub struct CacheSnapshot {
    pub len: usize,
    pub layers: Vec<(String, Vec<u8>)>,
}

impl CacheSnapshot {
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|(_, b)| b.len()).sum()
    }
}

/// One sequence's state on the CPU backend: the latent KV cache and the plans built so far.
pub struct Engine {
    model: Arc<Model>,
    config: EngineConfig,
    exec: CpuExecutor,
    plans: HashMap<StepShape, Plan>,
    state: HostState,
    /// Positions `0..len` of the cache hold the current context.
    len: usize,
}

impl Engine {
    pub fn new(model: Arc<Model>, config: EngineConfig) -> Result<Engine, EngineError> {
        let rows = Bucket::kv_bucket_for(config.max_model_len, config.min_kv_bucket);
        let probe = StepShape {
            bucket: Bucket::Decode { batch: 1, kv: rows },
            logits: LogitRows::Last,
        };
        let plan = build_plan(&model, probe)?;
        let state = HostState::for_plan(&plan, rows)?;
        let mut plans = HashMap::new();
        plans.insert(probe, plan);
        Ok(Engine {
            model,
            config,
            exec: CpuExecutor::new(),
            plans,
            state,
            len: 0,
        })
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Tokens currently in the cache.
    pub fn cached_len(&self) -> usize {
        self.len
    }

    /// Forgets the context without touching the cache bytes: the next forward
    /// overwrites the rows it fills, and attention never reads past a position.
    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// Keeps only the first `len` cached positions (for prefix reuse).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Bytes of the persistent cache.
    pub fn cache_bytes(&self) -> usize {
        self.state.total_bytes()
    }

    /// Copies the first `len` cached positions of every layer to the host (for
    /// a prefix store). `len` is clamped to what the cache holds.
    pub fn snapshot(&self, len: usize) -> CacheSnapshot {
        let len = len.min(self.len);
        let rows = self.state.rows().max(1);
        let mut names: Vec<&str> = self.state.names().collect();
        names.sort_unstable();
        let layers = names
            .iter()
            .filter_map(|n| self.state.get(n).map(|b| (n.to_string(), b)))
            .map(|(n, b)| {
                let row = b.len() / rows;
                (n, b.bytes()[..row * len].to_vec())
            })
            .collect();
        CacheSnapshot { len, layers }
    }

    /// Restores the first `len` positions of `snap` (len ≤ snap.len) and makes
    /// them the whole context.
    pub fn restore(&mut self, snap: &CacheSnapshot, len: usize) -> Result<(), EngineError> {
        let len = len.min(snap.len).min(self.config.max_model_len);
        let rows = self.state.rows().max(1);
        for (name, bytes) in &snap.layers {
            let buf = self
                .state
                .get_mut(name)
                .ok_or_else(|| graph::GraphError::MissingState(name.clone()))?;
            let row = buf.len() / rows;
            buf.bytes_mut()[..row * len].copy_from_slice(&bytes[..row * len]);
        }
        self.len = len;
        Ok(())
    }

    /// The plan for a shape, built once.
    pub fn plan(&mut self, shape: StepShape) -> Result<&Plan, EngineError> {
        if !self.plans.contains_key(&shape) {
            let plan = build_plan(&self.model, shape)?;
            self.plans.insert(shape, plan);
        }
        Ok(&self.plans[&shape])
    }

    /// Appends `tokens` at positions `len..len+n` in chunks and returns logits:
    /// every row (`All`, `n × vocab`) or the last token's (`Last`, one row).
    pub fn forward(&mut self, tokens: &[u32], rows: LogitRows) -> Result<Vec<f32>, EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let vocab = self.model.decl.n_vocab();
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::TokenOutOfRange { id, vocab });
        }
        if self.len + tokens.len() > self.config.max_model_len {
            return Err(EngineError::ContextFull {
                cached: self.len,
                adding: tokens.len(),
                max: self.config.max_model_len,
            });
        }
        let mut out = Vec::new();
        let chunk = self.config.prefill_chunk.max(1);
        for piece in tokens.chunks(chunk) {
            let start = self.len;
            let n = piece.len();
            let kv = Bucket::kv_bucket_for(start + n, self.config.min_kv_bucket);
            let bucket = if n == 1 {
                Bucket::Decode { batch: 1, kv }
            } else {
                Bucket::Prefill { chunk: n, kv }
            };
            let shape = StepShape { bucket, logits: rows };
            let ids: Vec<u8> = piece.iter().flat_map(|&t| (t as i32).to_le_bytes()).collect();
            let pos: Vec<u8> = (start..start + n)
                .flat_map(|p| (p as i32).to_le_bytes())
                .collect();
            self.plan(shape)?;
            let plan = &self.plans[&shape];
            self.exec.run(
                plan,
                self.model.as_ref(),
                &mut self.state,
                &[("tokens", &ids), ("positions", &pos)],
            )?;
            self.len = start + n;
            let logits = self.exec.output_f32(plan, "logits")?;
            if rows == LogitRows::Last {
                // Only the final chunk's last row is the answer.
                out.clear();
            }
            out.extend_from_slice(logits);
        }
        Ok(out)
    }
}

fn build_plan(model: &Model, shape: StepShape) -> Result<Plan, EngineError> {
    let mut b = GraphBuilder::new(model);
    model.decl.declare(&mut b, &shape)?;
    Ok(Plan::new(b.finish(), shape)?)
}
