//! Sessions over a loaded checkpoint: the absorbed KV cache, chunked prefill at
//! absolute positions, the decode loop, sampling, stop conditions, streaming with
//! cancellation at token boundaries, and rate statistics.

mod backend;
mod generate;
mod model;
pub mod prefix;
pub mod sampling;

pub use backend::{DEVICE_RESERVE_BYTES, Device, DeviceBudget, NEXT_TOKEN, build_plan};
pub use generate::{FinishReason, GenerateRequest, Generation, Stats, TokenEvent};
pub use graph::{LoweringOptions, NodeTime, StepTiming, Target};
pub use model::Model;
pub use sampling::{Sampler, SamplingParams};

use std::collections::HashMap;
use std::sync::Arc;

use backend::{Backend, mib};
use graph::{Bucket, LogitRows, Plan, StepShape};

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
    #[error(transparent)]
    Cuda(Box<graph::CudaExecError>),
    #[error("{device} is not usable: {reason}")]
    DeviceUnavailable { device: String, reason: String },
    #[error(
        "--max-model-len {} needs {} of KV cache ({} rows) + {} of weights + {} of step memory + {} reserve = {}, but {device} has {} free of {}; lower --max-model-len, or run on a card with more free memory",
        budget.max_model_len,
        mib(budget.cache),
        budget.rows,
        mib(budget.weights),
        mib(budget.arena),
        mib(budget.reserve),
        mib(budget.need()),
        mib(*free),
        mib(*total)
    )]
    DeviceMemory {
        device: String,
        budget: DeviceBudget,
        free: usize,
        total: usize,
    },
}

impl From<graph::CudaExecError> for EngineError {
    fn from(e: graph::CudaExecError) -> Self {
        EngineError::Cuda(Box::new(e))
    }
}

/// Prefill chunk on the CPU when the config leaves it at 0.
pub const DEFAULT_PREFILL_CHUNK_CPU: usize = 256;
/// Prefill chunk on a GPU when the config leaves it at 0: on the H200, pp4096 ran at 14,552 t/s
/// with 2048-token chunks and 15,773 with one 4096-token chunk (larger GEMMs and expert groups;
/// the step arena was 412 MiB at 2048). With the earlier kernels: 3,928 t/s at 256, 5,330 at
/// 512, 6,463 at 1024, 6,907 at 2048.
pub const DEFAULT_PREFILL_CHUNK_CUDA: usize = 4096;

/// Engine settings fixed for a session's life.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Cache rows (positions) a sequence may use.
    pub max_model_len: usize,
    /// Tokens per prefill chunk (bounds the activations a chunk needs); 0: the device's
    /// default, [`DEFAULT_PREFILL_CHUNK_CPU`] or [`DEFAULT_PREFILL_CHUNK_CUDA`].
    pub prefill_chunk: usize,
    /// The smallest decode KV bucket (buckets are powers of two from here).
    pub min_kv_bucket: usize,
    /// Where the steps run.
    pub device: Device,
    /// On a GPU, replay one captured CUDA graph per decode bucket (false: eager
    /// launches every step, for A/B measurements).
    pub cuda_graphs: bool,
    /// The fusions and kernel thresholds of the GPU lowering (the CPU runs the declaration
    /// as written).
    pub lowering: LoweringOptions,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_model_len: 4096,
            prefill_chunk: 0,
            min_kv_bucket: 64,
            device: Device::Cpu,
            cuda_graphs: true,
            lowering: LoweringOptions::default(),
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

/// A plan's identity: its shape, and whether it ends in a device argmax.
type PlanKey = (StepShape, bool);

/// One sequence's state on one backend: the latent KV cache and the plans built so far.
pub struct Engine {
    model: Arc<Model>,
    config: EngineConfig,
    backend: Backend,
    /// What this session's plans are lowered for.
    target: Target,
    plans: HashMap<PlanKey, Plan>,
    /// Positions `0..len` of the cache hold the current context.
    len: usize,
}

impl Engine {
    /// A session on `config.device`. On a GPU the weights are uploaded here, and a
    /// `max_model_len` whose cache, weights and step memory do not fit the card's free
    /// memory is refused with the numbers.
    pub fn new(model: Arc<Model>, mut config: EngineConfig) -> Result<Engine, EngineError> {
        if config.prefill_chunk == 0 {
            config.prefill_chunk = match config.device {
                Device::Cpu => DEFAULT_PREFILL_CHUNK_CPU,
                Device::Cuda(_) => DEFAULT_PREFILL_CHUNK_CUDA,
            };
        }
        let rows = Bucket::kv_bucket_for(config.max_model_len, config.min_kv_bucket);
        let ctx = backend::open_device(config.device)?;
        let target = backend::target_of(ctx.as_deref());
        let (probe, prefill) = backend::sizing_plans(
            &model,
            (target, &config.lowering),
            config.prefill_chunk,
            config.max_model_len,
            rows,
        )?;
        let backend = Backend::new(
            &model,
            config.device,
            ctx,
            config.cuda_graphs,
            config.max_model_len,
            rows,
            &probe,
            prefill.as_ref(),
        )?;
        let mut plans = HashMap::new();
        plans.insert((probe.shape, false), probe);
        if let Some(p) = prefill {
            plans.insert((p.shape, false), p);
        }
        Ok(Engine {
            model,
            config,
            backend,
            target,
            plans,
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
        self.backend.cache_bytes()
    }

    /// True when the steps run on a GPU.
    pub fn on_gpu(&self) -> bool {
        self.backend.is_cuda()
    }

    /// Copies the first `len` cached positions of every layer to the host (for
    /// a prefix store). `len` is clamped to what the cache holds. Never fails on
    /// the CPU; a failed device read gives an empty snapshot (nothing to reuse) —
    /// [`Self::try_snapshot`] reports it instead.
    pub fn snapshot(&self, len: usize) -> CacheSnapshot {
        self.try_snapshot(len).unwrap_or_default()
    }

    /// [`Self::snapshot`], with a device read failure as an error.
    pub fn try_snapshot(&self, len: usize) -> Result<CacheSnapshot, EngineError> {
        let len = len.min(self.len);
        Ok(CacheSnapshot {
            len,
            layers: self.backend.read_rows(len)?,
        })
    }

    /// Restores the first `len` positions of `snap` (len ≤ snap.len) and makes
    /// them the whole context.
    pub fn restore(&mut self, snap: &CacheSnapshot, len: usize) -> Result<(), EngineError> {
        let len = len.min(snap.len).min(self.config.max_model_len);
        for (name, bytes) in &snap.layers {
            self.backend.write_rows(name, bytes, len)?;
        }
        self.len = len;
        Ok(())
    }

    /// The plan for a shape, built once.
    pub fn plan(&mut self, shape: StepShape) -> Result<&Plan, EngineError> {
        self.plan_for((shape, false))
    }

    fn plan_for(&mut self, key: PlanKey) -> Result<&Plan, EngineError> {
        if !self.plans.contains_key(&key) {
            let plan = build_plan(
                &self.model,
                key.0,
                key.1,
                self.target,
                &self.config.lowering,
            )?;
            self.plans.insert(key, plan);
        }
        Ok(&self.plans[&key])
    }

    /// Appends `tokens` at positions `len..len+n` in chunks and returns logits:
    /// every row (`All`, `n × vocab`) or the last token's (`Last`, one row).
    pub fn forward(&mut self, tokens: &[u32], rows: LogitRows) -> Result<Vec<f32>, EngineError> {
        let mut out = Vec::new();
        let n_chunks = self.check_tokens(tokens)?;
        let chunk = self.config.prefill_chunk.max(1);
        for (k, piece) in tokens.chunks(chunk).enumerate() {
            let key = self.step(piece, rows, false)?;
            // With `Last`, only the final chunk's row is the answer: skip the others' read-back.
            if rows == LogitRows::All || k + 1 == n_chunks {
                let plan = &self.plans[&key];
                out.extend(self.backend.output_f32(plan, "logits")?);
            }
        }
        Ok(out)
    }

    /// Appends `tokens` like [`Self::forward`] and returns the argmax of the last
    /// token's logits, computed where the step ran: on a GPU, 4 bytes come back.
    pub fn forward_argmax(&mut self, tokens: &[u32]) -> Result<u32, EngineError> {
        let n_chunks = self.check_tokens(tokens)?;
        let chunk = self.config.prefill_chunk.max(1);
        let mut key = None;
        for (k, piece) in tokens.chunks(chunk).enumerate() {
            key = Some(self.step(piece, LogitRows::Last, k + 1 == n_chunks)?);
        }
        let key = key.ok_or(EngineError::EmptyPrompt)?;
        let ids = self.backend.output_i32(&self.plans[&key], NEXT_TOKEN)?;
        let id = ids
            .last()
            .copied()
            .ok_or_else(|| graph::GraphError::MissingOutput(NEXT_TOKEN.to_string()))?;
        u32::try_from(id).map_err(|_| EngineError::TokenOutOfRange {
            id: id as u32,
            vocab: self.model.decl.n_vocab(),
        })
    }

    /// Refuses an empty, out-of-vocabulary or too long input; returns its chunk count.
    fn check_tokens(&self, tokens: &[u32]) -> Result<usize, EngineError> {
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
        Ok(tokens.len().div_ceil(self.config.prefill_chunk.max(1)))
    }

    /// Runs one chunk at positions `len..len+n`; returns the key of the plan it ran.
    fn step(
        &mut self,
        piece: &[u32],
        rows: LogitRows,
        argmax: bool,
    ) -> Result<PlanKey, EngineError> {
        let start = self.len;
        let n = piece.len();
        let kv = Bucket::kv_bucket_for(start + n, self.config.min_kv_bucket);
        let bucket = if n == 1 {
            Bucket::Decode { batch: 1, kv }
        } else {
            Bucket::Prefill { chunk: n, kv }
        };
        let key = (
            StepShape {
                bucket,
                logits: rows,
            },
            argmax,
        );
        let ids: Vec<u8> = piece
            .iter()
            .flat_map(|&t| (t as i32).to_le_bytes())
            .collect();
        let pos: Vec<u8> = (start..start + n)
            .flat_map(|p| (p as i32).to_le_bytes())
            .collect();
        self.plan_for(key)?;
        let plan = &self.plans[&key];
        self.backend
            .run(&self.model, plan, &[("tokens", &ids), ("positions", &pos)])?;
        self.len = start + n;
        Ok(key)
    }
}
