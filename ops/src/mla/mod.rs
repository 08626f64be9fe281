//! Multi-head latent attention in the absorbed form over a latent cache (spec §3.5, §5).
//!
//! Per token the cache holds one `W = kv_lora + qk_rope` row: the normalised latent ‖ the
//! roped shared key. Queries are mapped into the latent (`Kb`) so every head scores against
//! the same rows, and the value is the latent part of those rows, mapped out by `Vb`.
//!
//! The ops, their shape rules and the attention's tile plan are here, the CPU references in
//! `cpu.rs`, the CUDA launches in `cuda.rs` (kernels in `mla.cu`), and the tensor-core
//! attention for prefill chunks in `prefill.rs` (`mla_prefill.cu`, also `ops::mla_prefill`).

pub mod cases;
mod cpu;
mod cuda;
pub mod prefill;

use crate::check::{expect, expect_inputs, expect_weight, nonzero};
use crate::gpu::{DeviceTensor, GpuCtx, Scratch};
use crate::rope::RopeParams;
use crate::tensor::{DType, HostTensor, HostTensorMut, TensorMeta};
use crate::{Op, OpError};
use prefill::mla_prefill_scratch_bound;

pub use cpu::{ContiguousPages, Pages, f16_saturated};
pub(crate) use cuda::MLA_CU;

// ---- MlaQuery ------------------------------------------------------------------------

/// `Q[t][h] = Kb[h]·q_nope[t][h] ‖ rope(q_pe[t][h], pos[t])`.
///
/// Inputs: q F32 `[n, n_head·(qk_nope+qk_rope)]` (per head nope then rope), k_b
/// `[n_head, kv_lora, qk_nope]` (any weight type), positions I32 `[n]`.
/// Output: F32 `[n, n_head, kv_lora+qk_rope]`.
#[derive(Clone, Debug, PartialEq)]
pub struct MlaQuery {
    pub n_head: usize,
    pub qk_nope: usize,
    pub qk_rope: usize,
    pub kv_lora: usize,
    pub rope: RopeParams,
    pub kernel: HeadKernel,
}

impl Op for MlaQuery {
    fn name(&self) -> &'static str {
        "mla_query"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        nonzero(
            op,
            &[
                ("n_head", self.n_head),
                ("qk_nope", self.qk_nope),
                ("qk_rope", self.qk_rope),
                ("kv_lora", self.kv_lora),
            ],
        )?;
        if self.rope.n_rot != self.qk_rope || !self.qk_rope.is_multiple_of(2) {
            return Err(OpError::shape(
                op,
                format!(
                    "rope n_rot {} must equal qk_rope {} and be even",
                    self.rope.n_rot, self.qk_rope
                ),
            ));
        }
        expect_inputs(op, inputs, 3)?;
        let n = inputs[2].shape.first().copied().unwrap_or(0);
        expect(op, "positions", inputs[2], DType::I32, &[n])?;
        let qk = self.qk_nope + self.qk_rope;
        expect(op, "q", inputs[0], DType::F32, &[n, self.n_head * qk])?;
        expect_weight(
            op,
            "k_b",
            inputs[1],
            &[self.n_head, self.kv_lora, self.qk_nope],
        )?;
        Ok(vec![TensorMeta::f32([
            n,
            self.n_head,
            self.kv_lora + self.qk_rope,
        ])])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        format!(
            "mla_query n_head={} qk_nope={} qk_rope={} kv_lora={} {}{}",
            self.n_head,
            self.qk_nope,
            self.qk_rope,
            self.kv_lora,
            self.rope,
            self.kernel.label()
        )
    }

    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        self.cuda_launch(ctx, inputs, outputs, scratch)
    }
}

/// The most tokens the per-head GEMV (`head_gemv_bf16`) stages at once.
pub const HEAD_GEMV_ROWS_LIMIT: usize = 8;

/// Whether the tuned per-head kernels (GEMV and tensor-core tiles) take the weight `w`
/// (`[n_head, n_out, n_in]`): BF16, its input width whole 16-byte segments, at most the GEMV's
/// 32 lanes of `HG_SEGS` segments. Others take [`HeadKernel::Generic`].
pub fn tuned_head_takes(w: &TensorMeta) -> bool {
    let n_in = w.shape.last().copied().unwrap_or(0);
    w.dtype == DType::BF16 && n_in > 0 && n_in.is_multiple_of(8) && n_in <= 8 * 32 * cuda::HG_SEGS
}

/// How the per-head products of [`MlaQuery`] and [`MlaValueOut`] run on the GPU (chosen by the
/// graph's lowering).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HeadKernel {
    #[default]
    Unlowered,
    /// Weight rows in registers, one group of lanes a row, at most [`HEAD_GEMV_ROWS_LIMIT`]
    /// tokens: f32 products.
    Gemv,
    /// The bf16 tensor-core `head_mma_bf16_*` tiles with x split into two bf16 parts.
    TensorCore,
    /// Weights stored in another type than BF16: `head_generic`, a warp an output row, any
    /// token count.
    Generic,
}

impl HeadKernel {
    fn label(self) -> &'static str {
        match self {
            HeadKernel::Unlowered => "",
            HeadKernel::Gemv => " [gemv]",
            HeadKernel::TensorCore => " [tensor cores]",
            HeadKernel::Generic => " [generic]",
        }
    }
}

// ---- MlaKv ---------------------------------------------------------------------------

/// The cache row of each token: `rms(kv[..kv_lora]; w, eps) ‖ rope(kv[kv_lora..], pos)`.
/// The rope part is not normalised.
///
/// Inputs: kv F32 `[n, kv_lora+qk_rope]`, norm_w F32 `[kv_lora]`, positions I32 `[n]`.
/// Output: F32 `[n, kv_lora+qk_rope]`.
#[derive(Clone, Debug, PartialEq)]
pub struct MlaKv {
    pub kv_lora: usize,
    pub qk_rope: usize,
    pub eps: f32,
    pub rope: RopeParams,
}

impl Op for MlaKv {
    fn name(&self) -> &'static str {
        "mla_kv"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        nonzero(op, &[("kv_lora", self.kv_lora), ("qk_rope", self.qk_rope)])?;
        if self.rope.n_rot != self.qk_rope || !self.qk_rope.is_multiple_of(2) {
            return Err(OpError::shape(
                op,
                format!(
                    "rope n_rot {} must equal qk_rope {} and be even",
                    self.rope.n_rot, self.qk_rope
                ),
            ));
        }
        expect_inputs(op, inputs, 3)?;
        let n = inputs[2].shape.first().copied().unwrap_or(0);
        expect(op, "positions", inputs[2], DType::I32, &[n])?;
        let w = self.kv_lora + self.qk_rope;
        expect(op, "kv", inputs[0], DType::F32, &[n, w])?;
        expect(op, "norm_w", inputs[1], DType::F32, &[self.kv_lora])?;
        Ok(vec![TensorMeta::f32([n, w])])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        format!(
            "mla_kv kv_lora={} qk_rope={} eps={:?} {}",
            self.kv_lora, self.qk_rope, self.eps, self.rope
        )
    }

    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        self.cuda_launch(ctx, inputs, outputs, scratch)
    }
}

/// [`MlaKv`] straight into the cache ([`KvCacheWrite`] of its rows): the cache row of each
/// token is formed where it is stored, so a step has one launch and no `[n, W]` intermediate
/// for it. Same rows, same bits, same rules (a later token wins a shared slot, a negative
/// slot is a padding row and writes nothing).
///
/// Inputs: cache F32 or F16 `[pool rows, W]` (aliased by output 0), then kv, norm_w, positions as
/// [`MlaKv`], then slots I32 `[n]` as [`KvCacheWrite`]. Output: the cache.
#[derive(Clone, Debug, PartialEq)]
pub struct MlaKvCacheWrite {
    pub kv: MlaKv,
}

impl Op for MlaKvCacheWrite {
    fn name(&self) -> &'static str {
        "mla_kv_cache_write"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        expect_inputs(op, inputs, 5)?;
        let rows = self.kv.infer(&inputs[1..4])?;
        KvCacheWrite.infer(&[inputs[0], &rows[0], inputs[4]])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        format!("{} into the cache", self.kv.describe())
    }

    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        self.cuda_launch(ctx, inputs, outputs, scratch)
    }

    fn aliases(&self) -> &'static [(usize, usize)] {
        &[(0, 0)]
    }
}

// ---- MlaQueryKv ----------------------------------------------------------------------

/// [`MlaKvCacheWrite`] and [`MlaQuery`] of one step as one node: where the query takes the
/// per-head GEMV (a decode step's few tokens), the cache rows are written by a column of blocks
/// of that launch, one launch fewer a layer. Same rows, same bits as the two ops.
///
/// Inputs: cache, kv, norm_w, positions, slots (as [`MlaKvCacheWrite`]), then q and k_b (as
/// [`MlaQuery`], which reads the same positions). Outputs: the cache (aliasing input 0), then
/// the absorbed query.
#[derive(Clone, Debug, PartialEq)]
pub struct MlaQueryKv {
    pub query: MlaQuery,
    pub kv: MlaKv,
}

impl Op for MlaQueryKv {
    fn name(&self) -> &'static str {
        "mla_query_kv"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        expect_inputs(self.name(), inputs, 7)?;
        let mut out = MlaKvCacheWrite {
            kv: self.kv.clone(),
        }
        .infer(&inputs[..5])?;
        out.extend(self.query.infer(&[inputs[5], inputs[6], inputs[3]])?);
        Ok(out)
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        format!(
            "{} beside {} into the cache",
            self.query.describe(),
            self.kv.describe()
        )
    }

    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        self.cuda_launch(ctx, inputs, outputs, scratch)
    }

    fn aliases(&self) -> &'static [(usize, usize)] {
        &[(0, 0)]
    }
}

/// Storage types of the latent cache: F32 as models declare it, or F16 where the lowering
/// narrows it (every reader rounds keys and values to f16 anyway). An F16 row holds each value
/// rounded to nearest and saturated to ±65504 (a NaN stays NaN), as the f16 attention kernels
/// rounded them on read.
pub const LATENT_CACHE_TYPES: [DType; 2] = [DType::F32, DType::F16];

// ---- KvCacheWrite --------------------------------------------------------------------

/// Writes `cache[slots[i]] = k[i]` in place: `slots[i]` is the pool row of token `i`'s
/// position (its sequence's block for that position, and the offset in it).
///
/// Inputs: cache F32 or F16 `[pool rows, W]` (persistent; aliased by output 0), k F32 `[n, W]`,
/// slots I32 `[n]`. Output: the cache. A negative slot is a padding row of a batch bucket
/// and writes nothing; a slot at or past the pool's end is an `OpError::Data` and nothing
/// is written.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct KvCacheWrite;

impl Op for KvCacheWrite {
    fn name(&self) -> &'static str {
        "kv_cache_write"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        expect_inputs(op, inputs, 3)?;
        let cache = inputs[0];
        if !LATENT_CACHE_TYPES.contains(&cache.dtype)
            || cache.shape.len() != 2
            || cache.shape[1] == 0
        {
            return Err(OpError::shape(
                op,
                format!("cache must be F32 or F16 [ctx, W] with W > 0, found {cache}"),
            ));
        }
        let w = cache.shape[1];
        let n = inputs[2].shape.first().copied().unwrap_or(0);
        expect(op, "slots", inputs[2], DType::I32, &[n])?;
        expect(op, "k", inputs[1], DType::F32, &[n, w])?;
        Ok(vec![cache.clone()])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        "kv_cache_write".to_string()
    }

    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        self.cuda_launch(ctx, inputs, outputs, scratch)
    }

    fn aliases(&self) -> &'static [(usize, usize)] {
        &[(0, 0)]
    }
}

// ---- MlaAttention --------------------------------------------------------------------

/// Causal attention of every head over its own sequence's part of the paged latent cache.
///
/// Inputs: Q F32 `[n, n_head, W]`, cache F32 or F16 `[pool rows, W]` (blocks of `block_size` rows),
/// positions I32 `[n]`, block_table I32 `[seqs, blocks a sequence]`, row_seq I32 `[n]`.
/// Output: o_lat F32 `[n, n_head, kv_lora]`. Query `i` belongs to sequence `s = row_seq[i]`
/// and reads that sequence's positions `0..=positions[i]`, position `p` at pool row
/// `block_table[s][p / block_size] · block_size + p % block_size`. Positions past it are
/// never read, so the table may be any bucket wider than the last position needs.
#[derive(Clone, Debug, PartialEq)]
pub struct MlaAttention {
    pub n_head: usize,
    pub kv_lora: usize,
    pub kq_scale: f32,
    /// Positions of a cache block (the pool's, see `graph::KvPool`).
    pub block_size: usize,
    pub kernel: AttentionPath,
}

/// Which attention kernel runs on the GPU (chosen by the graph's lowering).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AttentionPath {
    #[default]
    Unlowered,
    /// Split-K flash attention with f32-class corrections: each token's rows in chunks over the
    /// chip, then a combine (decode and short chunks).
    SplitK,
    /// The same split with f16 operands and f32 sums (the flash kernel's numerics): a quarter
    /// of the tensor instructions, for decode steps over long contexts and many sequences.
    SplitKF16,
    /// The f16 tensor-core flash kernel of [`crate::mla_prefill`] (long prefill chunks; needs
    /// a rope width of 64 and `kv_lora` a multiple of 64 up to 512, see
    /// [`MlaAttention::flash_supports`]).
    Flash,
    /// A mixed step: rows `0..lead` are consecutive tokens of the block table's first sequence
    /// (the chunk being prefilled) and take the flash kernel; the rest (one decode row a
    /// sequence) take the split kernel, with f16 operands when `f16` is set. The split kernel
    /// alone runs a chunk a token at a time: on the H200 a 4,096-token chunk of a 16k prompt
    /// joining 64 decoding sequences made steps of 1.2–2.5 s.
    FlashThenSplit { lead: usize, f16: bool },
    /// [`AttentionPath::SplitKF16`]'s numerics on the Hopper warpgroup kernel: 64-row pages
    /// staged by the tensor memory accelerator, both products on warpgroup MMAs from shared
    /// memory (an F16 cache and the model's shape only, see [`MlaAttention::wg_supports`]).
    SplitKWg,
}

impl AttentionPath {
    fn label(self) -> String {
        match self {
            AttentionPath::Unlowered => String::new(),
            AttentionPath::SplitK => " [split-k]".to_string(),
            AttentionPath::SplitKF16 => " [split-k f16]".to_string(),
            AttentionPath::SplitKWg => " [split-k f16 wg]".to_string(),
            AttentionPath::Flash => " [flash f16]".to_string(),
            AttentionPath::FlashThenSplit { lead, f16 } => format!(
                " [flash f16 rows 0..{lead}, then split-k{}]",
                if f16 { " f16" } else { "" }
            ),
        }
    }
}

impl Op for MlaAttention {
    fn name(&self) -> &'static str {
        "mla_attention"
    }

    fn cache_reads(&self) -> Option<crate::CacheReads> {
        Some(crate::CacheReads {
            cache: 1,
            positions: 2,
            row_seq: 4,
        })
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        nonzero(
            op,
            &[
                ("n_head", self.n_head),
                ("kv_lora", self.kv_lora),
                ("block_size", self.block_size),
            ],
        )?;
        expect_inputs(op, inputs, 5)?;
        let cache = inputs[1];
        if !LATENT_CACHE_TYPES.contains(&cache.dtype)
            || cache.shape.len() != 2
            || cache.shape[1] < self.kv_lora
        {
            return Err(OpError::shape(
                op,
                format!(
                    "cache must be F32 or F16 [ctx, W] with W >= kv_lora {}, found {cache}",
                    self.kv_lora
                ),
            ));
        }
        if !cache.shape[0].is_multiple_of(self.block_size) {
            return Err(OpError::shape(
                op,
                format!(
                    "the cache's {} rows are not whole blocks of {}",
                    cache.shape[0], self.block_size
                ),
            ));
        }
        let w = cache.shape[1];
        let n = inputs[2].shape.first().copied().unwrap_or(0);
        expect(op, "positions", inputs[2], DType::I32, &[n])?;
        expect(op, "Q", inputs[0], DType::F32, &[n, self.n_head, w])?;
        let table = inputs[3];
        if table.dtype != DType::I32 || table.shape.len() != 2 || table.shape[0] == 0 {
            return Err(OpError::shape(
                op,
                format!("block_table must be I32[seqs, blocks] with seqs > 0, found {table}"),
            ));
        }
        expect(op, "row_seq", inputs[4], DType::I32, &[n])?;
        Ok(vec![TensorMeta::f32([n, self.n_head, self.kv_lora])])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        format!(
            "mla_attention n_head={} kv_lora={} kq_scale={:?} block={}{}",
            self.n_head,
            self.kv_lora,
            self.kq_scale,
            self.block_size,
            self.kernel.label()
        )
    }

    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        self.cuda_launch(ctx, inputs, outputs, scratch)
    }

    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        match (inputs.get(1), inputs.get(2), inputs.get(3)) {
            (Some(cache), Some(pos), Some(table)) => {
                // The rows a sequence may attend: its table's blocks.
                let (n, rows) = (
                    pos.shape.first().copied().unwrap_or(0),
                    table.shape.get(1).copied().unwrap_or(0) * self.block_size,
                );
                let w = cache.shape.get(1).copied().unwrap_or(0);
                // A mixed step's split launch takes the rows after the chunk: fewer tokens
                // than the step's, so more chunks each.
                let split_rows = match self.kernel {
                    AttentionPath::FlashThenSplit { lead, .. } => n.saturating_sub(lead),
                    _ => n,
                };
                let split = attention_scratch(split_rows, rows, self.n_head, self.kv_lora);
                let flash = matches!(
                    self.kernel,
                    AttentionPath::Flash | AttentionPath::FlashThenSplit { .. }
                );
                // The two launches of a mixed step run one after the other: one scratch.
                // The flash launch takes the step's tokens (all of them, or a mixed step's
                // chunk: at most as many).
                if flash && self.flash_supports(w) {
                    split.max(mla_prefill_scratch_bound(
                        n,
                        self.n_head,
                        rows,
                        w,
                        self.kv_lora,
                    ))
                } else {
                    split
                }
            }
            _ => 0,
        }
    }
}

/// Widest cache row and latent the kernel covers (8 warps × 72 query dims / × 64 columns).
const ATT_MAX_W: usize = 576;

const ATT_MAX_LORA: usize = 512;

/// Shared-memory row stride of a staged key row (`ATT_WS` there): 576 floats + 8.
const ATT_WS: usize = 584;

/// Blocks the attention launch aims for: one per SM of an H200 (the kernel holds one block
/// an SM), so a single decode token still spreads over the whole chip.
const ATT_TARGET_BLOCKS: usize = 132;

/// Chunks `mla_attn_combine` merges at most (`ATT_MAX_CHUNKS` there: 17 a warp).
const ATT_MAX_CHUNKS: usize = 136;
/// Chunks up to which `mla_attn_combine_few` merges instead (`ATT_FEW_CHUNKS` there).
const ATT_FEW_CHUNKS: usize = 16;

/// Chunks each token's rows are split into. Fixed by the plan's shapes (tokens, cache rows,
/// heads), never by the position, so one captured graph serves a whole bucket: the kernel
/// divides rows `0..=pos` among the chunks at run time (whole tiles each) and chunks past the
/// end do nothing. Prefill (many tokens) gets one chunk a token and no combine.
///
/// The count is the one with the least busiest-multiprocessor time, waves × (rows a chunk +
/// [`ATT_CHUNK_OVERHEAD_ROWS`]), fewest chunks on ties: the kernel holds one block an SM, so
/// 160 blocks (32 tokens × 5 chunks) cost two waves where 128 (× 4) cost one.
pub fn attention_chunks(n: usize, rows: usize, n_head: usize) -> usize {
    let groups = n.max(1) * n_head.div_ceil(32).max(1);
    let most = ATT_TARGET_BLOCKS.min(rows.div_ceil(16).max(1));
    (1..=most)
        .min_by_key(|&c| {
            let waves = (groups * c).div_ceil(ATT_TARGET_BLOCKS);
            waves * (rows.div_ceil(c) + ATT_CHUNK_OVERHEAD_ROWS)
        })
        .unwrap_or(1)
}

/// A chunk's fixed cost in key rows (its query staging, its partial's write and combine): on
/// the H200 a 16-row chunk of one token took ~16 µs and a 32-row tile of a long one ~6 µs.
const ATT_CHUNK_OVERHEAD_ROWS: usize = 48;

/// Which `mla_attn_split` variant runs: its tile rows (16 or 32) and how it multiplies.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionKernel {
    pub tile: usize,
    pub products: SplitProducts,
}

/// How the split kernel forms its two products (scores and values).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitProducts {
    /// Operands split in a TF32 part and a remainder, the corrections in two more TF32 mma
    /// (3xTF32, ~2^-21 of each product).
    Tf32x3,
    /// The same split, the corrections in one BF16 mma: two tensor instructions per k-step
    /// instead of three, ~2^-20 per product (H200: 38.0 vs 42.2 µs at 16448 rows; worst |Δ|
    /// against the CPU 1.5e-6 vs 7e-7 on values in [-1, 1]).
    Bf16Corrections,
    /// f16 operands (Q times the score scale), one f16 mma per two k-steps, f32 sums: the
    /// prefill flash kernel's numerics, a quarter of the tensor instructions.
    F16,
}

impl SplitProducts {
    /// The kernel-name suffix.
    fn suffix(self) -> &'static str {
        match self {
            SplitProducts::Tf32x3 => "",
            SplitProducts::Bf16Corrections => "_bf",
            SplitProducts::F16 => "_h",
        }
    }
}

/// Key rows a tile of the split kernel stages: 32 once every position of the bucket (the
/// upper half of `rows`) fills whole 32-row chunks (fewer barriers and softmax passes a row),
/// 16 below, where a half-empty 32-row tile would cost a full one (H200, tile 16 vs 32:
/// 21.8 vs 20.9 µs at 4224 rows of an 8192 bucket, 12.5 vs 14.5 at 512 rows).
pub fn attention_tile(n: usize, rows: usize, n_head: usize) -> usize {
    let per_chunk = rows.div_ceil(attention_chunks(n, rows, n_head));
    if per_chunk >= 48 { 32 } else { 16 }
}

/// Dynamic shared memory of `mla_attn_split_t{tile}` over a `cache` of that type: the key
/// buffers (four of 16 rows; of 32 rows, two of F32 and four of F16, whose pipelined kernel
/// keeps one fewer in flight), the 8 warps' score partials, the weights' A fragments (big and
/// small) and the per-head correction, max and sum.
fn attention_smem(tile: usize, cache: DType) -> usize {
    let bufs = if tile == 16 || cache == DType::F16 {
        4
    } else {
        2
    };
    // A staged row is ATT_WS values of the cache's type (`ATT_WSH` halves for an F16 cache).
    let row_bytes = ATT_WS * if cache == DType::F16 { 2 } else { 4 };
    bufs * tile * row_bytes + (8 * tile * 32 + 2 * tile * 32 + 3 * 32) * 4
}

/// Scratch for the chunk partials: `o[kv_lora]` then `(m, l)` per (token, chunk, head).
fn attention_scratch(n: usize, rows: usize, n_head: usize, kv_lora: usize) -> usize {
    let chunks = attention_chunks(n, rows, n_head);
    if chunks == 1 {
        0
    } else {
        n * chunks * n_head * (kv_lora + 2) * 4
    }
}

/// A step's block table and row map on the device, as [`Pages`] describes them on the host.
#[derive(Clone, Copy, Debug)]
pub struct DevicePages {
    /// I32 `[seqs, table_width]` block ids.
    pub block_table: u64,
    /// I32 `[n]`: the sequence of each token row.
    pub row_seq: u64,
    pub table_width: usize,
    pub block_size: usize,
}

impl DevicePages {
    /// log2 of the block size: the kernels map a position to its block with a shift, so the
    /// size must be a power of two (the engine's 64 is).
    pub(crate) fn block_shift(&self, op: &'static str) -> Result<i32, OpError> {
        if !self.block_size.is_power_of_two() {
            return Err(OpError::shape(
                op,
                format!(
                    "the CUDA kernels need a power-of-two cache block, found {}",
                    self.block_size
                ),
            ));
        }
        Ok(self.block_size.trailing_zeros() as i32)
    }
}

// ---- MlaValueOut ---------------------------------------------------------------------

/// `o[t][h] = Vb[h] · o_lat[t][h]`, heads concatenated.
///
/// Inputs: o_lat F32 `[n, n_head, kv_lora]`, v_b `[n_head, v_head, kv_lora]` (any weight type).
/// Output: F32 `[n, n_head·v_head]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MlaValueOut {
    pub n_head: usize,
    pub kv_lora: usize,
    pub v_head: usize,
    pub kernel: HeadKernel,
}

impl Op for MlaValueOut {
    fn name(&self) -> &'static str {
        "mla_value_out"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        nonzero(
            op,
            &[
                ("n_head", self.n_head),
                ("kv_lora", self.kv_lora),
                ("v_head", self.v_head),
            ],
        )?;
        expect_inputs(op, inputs, 2)?;
        let n = inputs[0].shape.first().copied().unwrap_or(0);
        expect(
            op,
            "o_lat",
            inputs[0],
            DType::F32,
            &[n, self.n_head, self.kv_lora],
        )?;
        expect_weight(
            op,
            "v_b",
            inputs[1],
            &[self.n_head, self.v_head, self.kv_lora],
        )?;
        Ok(vec![TensorMeta::f32([n, self.n_head * self.v_head])])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        format!(
            "mla_value_out n_head={} kv_lora={} v_head={}{}",
            self.n_head,
            self.kv_lora,
            self.v_head,
            self.kernel.label()
        )
    }

    /// The tensor-core tiles' K-split partial sums, where a step's few token tiles leave the
    /// card's block slots empty.
    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        match inputs.first() {
            Some(x) if self.kernel == HeadKernel::TensorCore && self.infer(inputs).is_ok() => {
                cuda::head_split_scratch(x.shape[0], self.n_head, self.v_head, self.kv_lora)
            }
            _ => 0,
        }
    }

    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        self.cuda_launch(ctx, inputs, outputs, scratch)
    }
}

#[cfg(test)]
mod head_kernel_choice {
    use super::*;

    #[test]
    fn only_bf16_weights_of_whole_segments_take_the_tuned_head_kernels() {
        let w = |dtype, n_in| TensorMeta::new([4, 512, n_in], dtype);
        assert!(tuned_head_takes(&w(DType::BF16, 128)));
        assert!(tuned_head_takes(&w(DType::BF16, 1024)));
        assert!(!tuned_head_takes(&w(DType::F16, 128)), "F16");
        assert!(!tuned_head_takes(&w(DType::Q8_0, 128)), "Q8_0");
        assert!(!tuned_head_takes(&w(DType::BF16, 12)), "not whole segments");
        assert!(
            !tuned_head_takes(&w(DType::BF16, 1032)),
            "past the GEMV's lanes"
        );
    }
}

#[cfg(test)]
mod head_split_choice {
    use super::cuda::{HT_MAX_SPLITS, head_mma_splits, head_split_scratch};
    use super::*;

    #[test]
    fn the_value_products_few_tiles_split_k_into_the_empty_block_slots() {
        // 32 heads, one 128-row column tile each, 512 inputs (16 slices): one token tile at
        // 9..64 tokens is 32 blocks of 264 slots; two at 65..128 are 64; four at 256 are 128.
        assert_eq!(head_mma_splits(32, 512, 132), 4);
        assert_eq!(head_mma_splits(64, 512, 132), 4);
        assert_eq!(head_mma_splits(128, 512, 132), 2);
        assert_eq!(head_mma_splits(264, 512, 132), 1);
        // The query's 128 inputs are four slices: never split.
        assert_eq!(head_mma_splits(32, 128, 132), 1);
        // A part keeps at least four slices; never more than the sum kernel adds.
        assert_eq!(head_mma_splits(1, 32 * 4 * 100, 132), HT_MAX_SPLITS);
        assert_eq!(head_mma_splits(1, 32 * 7, 132), 1);
        // 25 slices wanted in 6 parts of 5 would leave the sixth empty: 5 parts.
        assert_eq!(head_mma_splits(32, 800, 132), 5);
    }

    #[test]
    fn no_k_part_the_kernel_runs_is_empty() {
        // The kernel's partition: part kp starts at kp·⌈slices / parts⌉.
        for n_in in (8usize..=1024).step_by(8) {
            let slices = n_in.div_ceil(32);
            for blocks in 1..300 {
                for sms in [66, 132, 1000] {
                    let parts = head_mma_splits(blocks, n_in, sms);
                    assert!((1..=HT_MAX_SPLITS).contains(&parts));
                    let per = slices.div_ceil(parts);
                    assert!(
                        (parts - 1) * per < slices,
                        "n_in={n_in} blocks={blocks} sms={sms}: {parts} parts of {per}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_value_products_scratch_holds_the_parts_it_plans() {
        let op = MlaValueOut {
            n_head: 32,
            kv_lora: 512,
            v_head: 128,
            kernel: HeadKernel::TensorCore,
        };
        let scratch = |n: usize| {
            op.cuda_scratch_bytes(&[
                &TensorMeta::f32([n, 32, 512]),
                &TensorMeta::new([32, 128, 512], DType::BF16),
            ])
        };
        assert_eq!(scratch(64), 256 + 4 * 64 * 32 * 128 * 4);
        assert_eq!(scratch(256), 256 + 2 * 256 * 32 * 128 * 4);
        // A prefill chunk's tiles fill the card; the GEMV's few tokens take no tiles.
        assert_eq!(scratch(1024), 0);
        assert_eq!(scratch(8), 0);
        // Every token count's plan on any card up to the planned one fits what it asked for.
        for n in [9, 33, 64, 65, 100, 128, 129, 200, 256, 300, 512, 513, 700] {
            let bound = head_split_scratch(n, 32, 128, 512);
            for sms in [1, 16, 66, 108, 114, 132, 144, 1000] {
                let bm = if n > 512 { 128 } else { 64 };
                let parts = head_mma_splits(32 * n.div_ceil(bm), 512, sms);
                if parts > 1 {
                    assert!(256 + parts * n * 32 * 128 * 4 <= bound, "n={n} sms={sms}");
                }
            }
        }
        let gemv = MlaValueOut {
            kernel: HeadKernel::Gemv,
            ..op
        };
        assert_eq!(
            gemv.cuda_scratch_bytes(&[
                &TensorMeta::f32([64, 32, 512]),
                &TensorMeta::new([32, 128, 512], DType::BF16),
            ]),
            0
        );
    }
}

#[cfg(test)]
mod attention_split_choice {
    use super::*;

    #[test]
    fn batched_decode_steps_take_the_few_chunk_merge_and_long_contexts_the_wide_one() {
        // 8, 24 and 32 sequences near 512 positions (the parity cases and bench's batches):
        // a handful of chunks each (16 at 8 sequences), merged by mla_attn_combine_few.
        for (n, rows) in [
            (8, 832),
            (8, 1024),
            (24, 512),
            (32, 1024),
            (64, 1024),
            (128, 1024),
        ] {
            let c = attention_chunks(n, rows, 32);
            assert!(
                (2..=ATT_FEW_CHUNKS).contains(&c) || c == 1,
                "{n} tokens: {c}"
            );
        }
        // 8 sequences take more chunks than the merge's first bound of 8 (they took the wide
        // merge then).
        assert!(attention_chunks(8, 832, 32) > 8);
        // One sequence over a long context: a chunk a multiprocessor, the wide merge.
        assert!(attention_chunks(1, 65536, 32) > ATT_FEW_CHUNKS);
        assert!(attention_chunks(1, 65536, 32) <= ATT_MAX_CHUNKS);
    }
}

#[cfg(test)]
mod mixed_step_scratch {
    use super::*;

    #[test]
    fn a_mixed_step_s_scratch_holds_the_flash_copy_and_the_decode_rows_partials() {
        // 512 chunk rows then one decode row over a 1,024-position table (H200 run (p) 3: the
        // scratch was sized for 513 split rows, one chunk each, and the decode row needs 64).
        let att = MlaAttention {
            n_head: 32,
            kv_lora: 512,
            kq_scale: 0.1,
            block_size: 64,
            kernel: AttentionPath::FlashThenSplit {
                lead: 512,
                f16: true,
            },
        };
        let (q, cache, pos, table, seq) = (
            TensorMeta::f32([513, 32, 576]),
            TensorMeta::f32([4096, 576]),
            TensorMeta::i32([513]),
            TensorMeta::i32([2, 16]),
            TensorMeta::i32([513]),
        );
        let bytes = att.cuda_scratch_bytes(&[&q, &cache, &pos, &table, &seq]);
        assert!(attention_scratch(1, 1024, 32, 512) > 0);
        assert!(bytes >= attention_scratch(1, 1024, 32, 512), "{bytes}");
        assert!(
            bytes >= prefill::mla_prefill_scratch_bytes(513, 32, 1024, 576, 512),
            "{bytes}"
        );
    }
}
