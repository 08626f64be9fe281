//! Sessions over a loaded checkpoint: the absorbed KV cache, chunked prefill at
//! absolute positions, the decode loop, sampling, stop conditions, streaming with
//! cancellation at token boundaries, and rate statistics.

mod backend;
pub mod constraint;
mod generate;
mod model;
mod output;
pub mod paged;
pub mod prefix;
pub mod sampling;
pub mod scheduler;

pub use backend::{
    DEVICE_RESERVE_BYTES, Device, DeviceBudget, NEXT_TOKEN, PENALTY, PENALTY_IDS, SAMPLING,
    build_plan,
};
pub use constraint::{TokenConstraint, TokenMask};
pub use generate::{FinishReason, GenerateRequest, Generation, Stats, TokenEvent};
pub use graph::{LoweringOptions, NodeTime, StepTiming, Target};
pub use model::Model;
pub use ops::head::RowSampling;
pub use sampling::SeenTokens;
pub use sampling::{Sampler, SamplingParams};

use std::collections::HashMap;
use std::sync::Arc;

use backend::{Backend, mib};
use graph::{Bucket, KvPool, LogitRows, Plan, StepShape};
use ops::head::SAMPLE_FIELDS;

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
    Config(String),
    #[error("cache blocks: {0}")]
    Blocks(String),
    #[error("{0}")]
    Tokenizer(String),
    #[error(transparent)]
    Cuda(Box<graph::CudaExecError>),
    #[error("{device} is not usable: {reason}")]
    DeviceUnavailable { device: String, reason: String },
    #[error(
        "--max-model-len {} needs a KV cache pool of at least one sequence: {} ({} positions) + {} of weights + {} of step memory + {} reserve = {}, but {device} has {} free of {}; lower --max-model-len (or --max-num-seqs, which sizes the step memory), or run on a card with more free memory",
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
    /// Positions a sequence may use.
    pub max_model_len: usize,
    /// Tokens per prefill chunk (bounds the activations a chunk needs); 0: the device's
    /// default, [`DEFAULT_PREFILL_CHUNK_CPU`] or [`DEFAULT_PREFILL_CHUNK_CUDA`].
    pub prefill_chunk: usize,
    /// The smallest decode KV bucket (buckets are powers of two from here, at least a block).
    pub min_kv_bucket: usize,
    /// Where the steps run.
    pub device: Device,
    /// On a GPU, replay one captured CUDA graph per decode bucket (false: eager
    /// launches every step, for A/B measurements).
    pub cuda_graphs: bool,
    /// The fusions and kernel thresholds of the GPU lowering (the CPU runs the declaration
    /// as written).
    pub lowering: LoweringOptions,
    /// Sequences a decode step may carry (the largest batch bucket is the power of two at or
    /// above it).
    pub max_num_seqs: usize,
    /// Positions of a cache block (a power of two).
    pub block_size: usize,
    /// Blocks of the cache pool; 0: sized at load (on a GPU from the free memory after
    /// weights and step memory, at most `max_num_seqs` full sequences; on the CPU
    /// `max_num_seqs` full sequences within [`CPU_POOL_BYTES`]), never less than one sequence
    /// of `max_model_len`.
    pub kv_blocks: usize,
}

/// The most host memory an automatically sized CPU pool takes (it still holds one full
/// sequence when that is more).
pub const CPU_POOL_BYTES: usize = 4 << 30;

/// The share of the free device memory (after weights, step memory and the reserve) an
/// automatically sized GPU pool takes.
pub const GPU_POOL_FRACTION: f64 = 0.9;

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_model_len: 4096,
            prefill_chunk: 0,
            min_kv_bucket: 64,
            device: Device::Cpu,
            cuda_graphs: true,
            lowering: LoweringOptions::default(),
            max_num_seqs: 1,
            block_size: graph::DEFAULT_BLOCK_SIZE,
            kv_blocks: 0,
        }
    }
}

/// The decode batch bucket serving `seqs` sequences: the power of two at or above it.
pub fn batch_bucket(seqs: usize) -> usize {
    seqs.max(1).next_power_of_two()
}

/// One sequence's part of a step: `tokens` at positions `start..start + tokens.len()`, its
/// cache in the pool blocks `blocks` (position `p` in block `blocks[p / block_size]`).
#[derive(Clone, Copy, Debug)]
pub struct SeqSlice<'a> {
    pub blocks: &'a [u32],
    pub start: usize,
    pub tokens: &'a [u32],
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

/// Plans of steps with a prefill chunk an engine keeps (decode plans, a few buckets, are all
/// kept): an evicted plan costs ~7 ms to build again (the 64-client soak's mean), a kept one
/// host memory for as long as the server runs.
pub const MAX_CHUNK_PLANS: usize = 128;

/// A plan's identity: its shape, and whether it ends in the token choice (`SampleRows`), with
/// the width of its penalty's id lists (0: no penalty).
type PlanKey = (StepShape, Option<usize>);

/// How a step chooses one sequence's next token where it ran: the row's draw, and the
/// repetition penalty over the distinct ids it has seen (1: none).
#[derive(Clone, Copy, Debug)]
pub struct DeviceChoice<'a> {
    pub row: RowSampling,
    pub penalty: f32,
    pub seen: &'a [u32],
}

impl DeviceChoice<'_> {
    pub const GREEDY: DeviceChoice<'static> = DeviceChoice {
        row: RowSampling::GREEDY,
        penalty: 1.0,
        seen: &[],
    };

    fn penalised(&self) -> bool {
        self.penalty != 1.0 && !self.seen.is_empty()
    }
}

/// The id-list width of a step's penalty: the power of two at or above the longest list of
/// a penalised row (at least 64, so lists that grow a little share a plan); 0 without one.
fn penalty_width(choose: &[DeviceChoice<'_>]) -> usize {
    choose
        .iter()
        .filter(|c| c.penalised())
        .map(|c| c.seen.len().max(64).next_power_of_two())
        .max()
        .unwrap_or(0)
}

/// A loaded checkpoint on one backend: the cache pool, the plans built so far, and the
/// engine's own sequence for the single-sequence calls ([`Self::forward`] and the rest), which
/// lives in pool blocks `0..` in order. A caller that runs many sequences through
/// [`Self::step_sequences`] (the scheduler) owns the pool's blocks instead and never mixes
/// in the single-sequence calls.
pub struct Engine {
    model: Arc<Model>,
    config: EngineConfig,
    backend: Backend,
    /// What this session's plans are lowered for.
    target: Target,
    plans: HashMap<PlanKey, Plan>,
    /// The plans of steps with a chunk, oldest first: keyed by the chunk's exact length they
    /// would grow with every prompt length a server meets, so the oldest go past
    /// [`MAX_CHUNK_PLANS`] (the sizing plans are never in it).
    chunk_plans: std::collections::VecDeque<PlanKey>,
    /// Plans lowered so far and the host time it took (a step of a new shape pays it).
    plan_builds: PlanBuilds,
    pool: KvPool,
    /// Positions `0..len` of the engine's own sequence hold its context.
    len: usize,
}

/// Plans an engine lowered, and the host time they took.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PlanBuilds {
    pub count: u64,
    pub seconds: f64,
}

impl Engine {
    /// A session on `config.device`. On a GPU the weights are uploaded here, and a pool of
    /// at least one `max_model_len` sequence whose cache, weights and step memory do not fit
    /// the card's free memory is refused with the numbers.
    pub fn new(model: Arc<Model>, mut config: EngineConfig) -> Result<Engine, EngineError> {
        if config.prefill_chunk == 0 {
            config.prefill_chunk = match config.device {
                Device::Cpu => DEFAULT_PREFILL_CHUNK_CPU,
                Device::Cuda(_) => DEFAULT_PREFILL_CHUNK_CUDA,
            };
        }
        if !config.block_size.is_power_of_two() {
            return Err(EngineError::Config(format!(
                "the cache block size must be a power of two, found {}",
                config.block_size
            )));
        }
        config.max_num_seqs = config.max_num_seqs.max(1);
        config.min_kv_bucket = config.min_kv_bucket.max(config.block_size);
        let per_seq = config.max_model_len.div_ceil(config.block_size).max(1);
        let ctx = backend::open_device(config.device)?;
        let target = backend::target_of(ctx.as_deref());
        let sizing = backend::Sizing {
            target,
            lowering: &config.lowering,
            prefill_chunk: config.prefill_chunk,
            max_model_len: config.max_model_len,
            kv: Bucket::kv_bucket_for(config.max_model_len, config.min_kv_bucket),
            max_batch: batch_bucket(config.max_num_seqs),
        };
        // The step memory does not depend on the pool's size: plan once with a pool of one
        // sequence, size the pool, then plan for the pool.
        let one_seq = KvPool {
            block_size: config.block_size,
            blocks: per_seq,
        };
        let (probe, prefill) = sizing.plans(&model, one_seq)?;
        let blocks = backend::pool_blocks(
            &model,
            ctx.as_deref(),
            &config,
            per_seq,
            &probe,
            prefill.as_ref(),
        )?;
        let pool = KvPool {
            block_size: config.block_size,
            blocks,
        };
        let (probe, prefill) = sizing.plans(&model, pool)?;
        let backend = Backend::new(
            config.device,
            ctx,
            config.cuda_graphs,
            config.max_model_len,
            pool,
            &probe,
            prefill.as_ref(),
        )?;
        let mut plans = HashMap::new();
        plans.insert((probe.shape, None), probe);
        if let Some(p) = prefill {
            plans.insert((p.shape, None), p);
        }
        Ok(Engine {
            model,
            config,
            backend,
            target,
            plans,
            chunk_plans: Default::default(),
            plan_builds: PlanBuilds::default(),
            pool,
            len: 0,
        })
    }

    /// Plans lowered since the engine started (the sizing plans of [`Engine::new`] aside).
    pub fn plan_builds(&self) -> PlanBuilds {
        self.plan_builds
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The cache pool's geometry.
    pub fn pool(&self) -> KvPool {
        self.pool
    }

    /// Tokens currently in the engine's own sequence.
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
        // The engine's own sequence is pool rows 0..len in order.
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
        self.plan_for((shape, None))
    }

    fn plan_for(&mut self, key: PlanKey) -> Result<&Plan, EngineError> {
        if !self.plans.contains_key(&key) {
            let started = std::time::Instant::now();
            let plan = build_plan(
                &self.model,
                key.0,
                key.1,
                self.target,
                &self.config.lowering,
            )?;
            self.plans.insert(key, plan);
            self.plan_builds.count += 1;
            self.plan_builds.seconds += started.elapsed().as_secs_f64();
            if !matches!(key.0.bucket, Bucket::Decode { .. }) {
                self.chunk_plans.push_back(key);
                while self.chunk_plans.len() > MAX_CHUNK_PLANS {
                    if let Some(old) = self.chunk_plans.pop_front() {
                        self.plans.remove(&old);
                    }
                }
            }
        }
        Ok(&self.plans[&key])
    }

    /// Plans held now (the sizing plans, every decode plan built, and at most
    /// [`MAX_CHUNK_PLANS`] of steps with a chunk).
    pub fn plan_count(&self) -> usize {
        self.plans.len()
    }

    /// The blocks of the engine's own sequence covering positions `0..len`.
    fn own_blocks(&self, len: usize) -> Vec<u32> {
        (0..len.div_ceil(self.pool.block_size) as u32).collect()
    }

    /// Appends `tokens` at positions `len..len+n` in chunks and returns logits:
    /// every row (`All`, `n × vocab`) or the last token's (`Last`, one row).
    pub fn forward(&mut self, tokens: &[u32], rows: LogitRows) -> Result<Vec<f32>, EngineError> {
        let mut out = Vec::new();
        let n_chunks = self.check_tokens(tokens)?;
        let chunk = self.config.prefill_chunk.max(1);
        for (k, piece) in tokens.chunks(chunk).enumerate() {
            let key = self.own_step(piece, rows, None)?;
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
        self.forward_choose(tokens, DeviceChoice::GREEDY)
    }

    /// Appends `tokens` like [`Self::forward`] and returns the token `row` chooses from the
    /// last token's logits, where the step ran.
    pub fn forward_choose(
        &mut self,
        tokens: &[u32],
        row: DeviceChoice<'_>,
    ) -> Result<u32, EngineError> {
        let n_chunks = self.check_tokens(tokens)?;
        let chunk = self.config.prefill_chunk.max(1);
        let mut key = None;
        let rows = [row];
        for (k, piece) in tokens.chunks(chunk).enumerate() {
            let last = k + 1 == n_chunks;
            key = Some(self.own_step(piece, LogitRows::Last, last.then_some(&rows[..]))?);
        }
        let key = key.ok_or(EngineError::EmptyPrompt)?;
        let ids = self.backend.output_i32(&self.plans[&key], NEXT_TOKEN)?;
        let id = ids
            .last()
            .copied()
            .ok_or_else(|| graph::GraphError::MissingOutput(NEXT_TOKEN.to_string()))?;
        self.token_id(id)
    }

    fn token_id(&self, id: i32) -> Result<u32, EngineError> {
        u32::try_from(id)
            .ok()
            .filter(|&t| (t as usize) < self.model.decl.n_vocab())
            .ok_or(EngineError::TokenOutOfRange {
                id: id as u32,
                vocab: self.model.decl.n_vocab(),
            })
    }

    /// Refuses an empty, out-of-vocabulary or too long input; returns its chunk count.
    fn check_tokens(&self, tokens: &[u32]) -> Result<usize, EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        self.check_vocab(tokens)?;
        if self.len + tokens.len() > self.config.max_model_len {
            return Err(EngineError::ContextFull {
                cached: self.len,
                adding: tokens.len(),
                max: self.config.max_model_len,
            });
        }
        Ok(tokens.len().div_ceil(self.config.prefill_chunk.max(1)))
    }

    fn check_vocab(&self, tokens: &[u32]) -> Result<(), EngineError> {
        let vocab = self.model.decl.n_vocab();
        match tokens.iter().find(|&&t| t as usize >= vocab) {
            Some(&id) => Err(EngineError::TokenOutOfRange { id, vocab }),
            None => Ok(()),
        }
    }

    /// Runs one chunk of the engine's own sequence at positions `len..len+n`.
    fn own_step(
        &mut self,
        piece: &[u32],
        rows: LogitRows,
        choose: Option<&[DeviceChoice<'_>]>,
    ) -> Result<PlanKey, EngineError> {
        let start = self.len;
        let blocks = self.own_blocks(start + piece.len());
        let seq = SeqSlice {
            blocks: &blocks,
            start,
            tokens: piece,
        };
        let key = self.run_step(&[seq], rows, choose)?;
        self.len = start + piece.len();
        Ok(key)
    }

    /// One step over `seqs`: a decode of several sequences (one token each, padded to the
    /// batch bucket), a chunk of one sequence, or a mixed step (a chunk of the first sequence
    /// and one token of each other, as chunked prefill runs). With `choose` (a [`RowSampling`]
    /// a sequence, or fewer: the rest greedy), each sequence's next token is chosen where the
    /// step ran; the logits rows of the sequences `logits` (all of them without `choose`) are
    /// read back too. Per sequence, in the order of `seqs`. Every sequence must hold the
    /// blocks its positions need.
    pub fn step_sequences(
        &mut self,
        seqs: &[SeqSlice<'_>],
        choose: Option<&[DeviceChoice<'_>]>,
        logits: std::ops::Range<usize>,
    ) -> Result<StepOutput, EngineError> {
        let key = self.run_step(seqs, LogitRows::Last, choose)?;
        let plan = &self.plans[&key];
        let tokens = match choose {
            Some(_) => {
                let mut ids = self.backend.output_i32(plan, NEXT_TOKEN)?;
                ids.truncate(seqs.len());
                Some(ids)
            }
            None => None,
        };
        let vocab = self.model.decl.n_vocab();
        let rows = match choose {
            Some(_) => logits.start.min(seqs.len())..logits.end.min(seqs.len()),
            None => 0..seqs.len(),
        };
        let logits = match rows.is_empty() {
            true => Vec::new(),
            false => self
                .backend
                .output_f32_rows(plan, "logits", rows.clone(), vocab)?,
        };
        Ok(StepOutput {
            tokens,
            logits,
            first_logits_row: rows.start,
            vocab,
        })
    }

    /// Checks `seqs`, builds the step's inputs (padding rows write nothing and read one
    /// position of their own empty table) and runs the plan of its shape.
    fn run_step(
        &mut self,
        seqs: &[SeqSlice<'_>],
        logits: LogitRows,
        choose: Option<&[DeviceChoice<'_>]>,
    ) -> Result<PlanKey, EngineError> {
        let block = self.pool.block_size;
        let (first, rest) = seqs.split_first().ok_or(EngineError::EmptyPrompt)?;
        if first.tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if rest.iter().any(|s| s.tokens.len() != 1) {
            return Err(EngineError::Config(
                "a step of several sequences carries one token of each after the first".into(),
            ));
        }
        let mut reach = 0;
        for s in seqs {
            self.check_vocab(s.tokens)?;
            let end = s.start + s.tokens.len();
            if end > self.config.max_model_len {
                return Err(EngineError::ContextFull {
                    cached: s.start,
                    adding: s.tokens.len(),
                    max: self.config.max_model_len,
                });
            }
            if s.blocks.len() * block < end {
                return Err(EngineError::Blocks(format!(
                    "a sequence of {end} positions holds {} blocks of {block}",
                    s.blocks.len()
                )));
            }
            if let Some(&b) = s.blocks.iter().find(|&&b| b as usize >= self.pool.blocks) {
                return Err(EngineError::Blocks(format!(
                    "block {b} is outside the pool of {} blocks",
                    self.pool.blocks
                )));
            }
            reach = reach.max(end);
        }
        let kv = Bucket::kv_bucket_for(reach, self.config.min_kv_bucket);
        let chunk = first.tokens.len();
        let bucket = match (chunk, rest.len()) {
            (1, _) => Bucket::Decode {
                batch: batch_bucket(seqs.len()),
                kv,
            },
            (_, 0) => Bucket::Prefill { chunk, kv },
            (_, decode) => Bucket::Mixed {
                chunk,
                batch: batch_bucket(decode),
                kv,
            },
        };
        let shape = StepShape {
            bucket,
            logits,
            pool: self.pool,
        };
        let width = shape.table_width();
        let rows = bucket.n_tokens();
        let mut tokens = vec![0i32; rows];
        let mut positions = vec![0i32; rows];
        let mut slots = vec![-1i32; rows];
        let mut row_seq = vec![0i32; rows];
        let mut table = vec![0i32; bucket.seqs() * width];
        let mut r = 0;
        for (k, s) in seqs.iter().enumerate() {
            for (j, &t) in s.blocks.iter().take(width).enumerate() {
                table[k * width + j] = t as i32;
            }
            for (i, &t) in s.tokens.iter().enumerate() {
                let p = s.start + i;
                tokens[r] = t as i32;
                positions[r] = p as i32;
                slots[r] = (s.blocks[p / block] as usize * block + p % block) as i32;
                row_seq[r] = k as i32;
                r += 1;
            }
        }
        // Padding rows (the last ones) each read position 0 of an all-zero table row of
        // their own and write nothing.
        for (i, seq) in row_seq[r..].iter_mut().enumerate() {
            *seq = (seqs.len() + i) as i32;
        }
        // Each logits row's choice: a sequence's last row is its logits row with
        // `LogitRows::Last`; padding rows and every row of `All` take the argmax.
        let rows = shape.logit_rows();
        let choice = |k: usize| match (logits, choose) {
            (LogitRows::Last, Some(c)) => c.get(k).copied().unwrap_or(DeviceChoice::GREEDY),
            _ => DeviceChoice::GREEDY,
        };
        let width = match (logits, choose) {
            (LogitRows::Last, Some(c)) => penalty_width(c),
            _ => 0,
        };
        let key = (shape, choose.map(|_| width));
        let mut sampling = Vec::with_capacity(rows * SAMPLE_FIELDS * 4);
        let mut penalty = Vec::with_capacity(rows * 4);
        let mut seen = Vec::with_capacity(rows * width * 4);
        for k in 0..rows {
            let c = choice(k);
            sampling.extend(c.row.fields().iter().flat_map(|x| x.to_le_bytes()));
            let (p, ids) = match c.penalised() {
                true => (c.penalty, c.seen),
                false => (1.0, &[][..]),
            };
            penalty.extend(p.to_le_bytes());
            for j in 0..width {
                let id = ids.get(j).map_or(-1, |&t| t as i32);
                seen.extend(id.to_le_bytes());
            }
        }
        self.plan_for(key)?;
        let plan = &self.plans[&key];
        let bytes = |v: &[i32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let (tokens, positions, slots, table, row_seq) = (
            bytes(&tokens),
            bytes(&positions),
            bytes(&slots),
            bytes(&table),
            bytes(&row_seq),
        );
        self.backend.run(
            &self.model,
            plan,
            &[
                ("tokens", &tokens),
                ("positions", &positions),
                ("kv_slots", &slots),
                ("block_table", &table),
                ("row_seq", &row_seq),
                (SAMPLING, &sampling),
                (PENALTY, &penalty),
                (PENALTY_IDS, &seen),
            ],
        )?;
        Ok(key)
    }
}

/// What [`Engine::step_sequences`] returns per sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOutput {
    /// Each sequence's next token as the step chose it (-1 where its row had no choice:
    /// NaN logits), when it chose them.
    pub tokens: Option<Vec<i32>>,
    /// The logits rows read back, `vocab` floats each, of the sequences from
    /// `first_logits_row` on.
    pub logits: Vec<f32>,
    pub first_logits_row: usize,
    pub vocab: usize,
}

impl StepOutput {
    /// Sequence `j`'s token as the step chose it, checked against the vocabulary.
    pub fn token(&self, j: usize) -> Option<Result<u32, EngineError>> {
        let id = *self.tokens.as_ref()?.get(j)?;
        Some(
            u32::try_from(id)
                .ok()
                .filter(|&t| (t as usize) < self.vocab)
                .ok_or(EngineError::TokenOutOfRange {
                    id: id as u32,
                    vocab: self.vocab,
                }),
        )
    }

    /// Sequence `j`'s logits row, when read back.
    pub fn logits_row(&self, j: usize) -> Option<&[f32]> {
        let k = j.checked_sub(self.first_logits_row)?;
        self.logits.get(k * self.vocab..(k + 1) * self.vocab)
    }
}
