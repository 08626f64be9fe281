//! CUDA launches of the MLA ops.

use super::prefill::{launch_mla_prefill, mla_prefill_scratch_bytes};
use super::*;
use crate::check::{aligned16, dim_i32, unlowered};
use crate::dequant::weight_rows;
use crate::gpu::{blocks_for, dev_err};
use crate::op::check_device;
use crate::rope::RopeConsts;
use ::cuda::Launch;

impl MlaQuery {
    /// One launch: the `Kb` product per head plus one extra column of blocks that ropes `q_pe`
    /// from the device positions. Up to 8 tokens a GEMV (BF16 weight rows in registers, tokens
    /// staged in shared memory); more, bf16 tensor-core tiles with x split into two bf16 parts
    /// (f32-class products, see `head_gemv`).
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        self.launch(
            ctx,
            self.name(),
            [&inputs[0], &inputs[1], &inputs[2]],
            outputs[0].ptr,
            None,
        )
    }

    /// The head product over `[q, k_b, positions]` into `q_abs`, with the cache-row job when
    /// `kv` is given (the GEMV kernel only).
    fn launch(
        &self,
        ctx: &GpuCtx,
        op: &'static str,
        [q, k_b, positions]: [&DeviceTensor<'_>; 3],
        q_abs: u64,
        kv: Option<KvJob>,
    ) -> Result<(), OpError> {
        let n = positions.meta.shape[0];
        let (qk, w, nh) = (
            self.qk_nope + self.qk_rope,
            self.kv_lora + self.qk_rope,
            self.n_head,
        );
        head_gemv(
            ctx,
            op,
            self.kernel,
            &HeadGemv {
                w: k_b,
                n_head: nh,
                n_out: self.kv_lora,
                n_in: self.qk_nope,
                x: q.ptr,
                x_tok: nh * qk,
                x_head: qk,
                y: q_abs,
                y_tok: nh * w,
                y_head: w,
                n_tok: n,
                rope: Some(HeadRope {
                    positions: positions.ptr,
                    n_rot: self.qk_rope,
                    src: self.qk_nope,
                    dst: self.kv_lora,
                    k: self.rope.consts(),
                }),
                kv,
                part: Scratch::default(),
            },
        )
    }
}

impl MlaQueryKv {
    /// One launch where the query takes the per-head GEMV (its blocks and the cache rows'
    /// column side by side); otherwise the query's launch, then `mla_kv`'s into the cache.
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let n = inputs[3].meta.shape[0];
        if n == 0 {
            return Ok(());
        }
        let [_cache, kv, norm_w, positions, slots, q, k_b] = inputs else {
            return Err(OpError::shape(op, "expects 7 inputs"));
        };
        let rows = outputs[0].meta.shape[0];
        let pairs = self.kv.kv_lora.is_multiple_of(2) && self.kv.qk_rope.is_multiple_of(2);
        let f16_ok = outputs[0].meta.dtype != DType::F16 || pairs;
        if self.query.kernel == HeadKernel::Gemv && self.query.rope == self.kv.rope && f16_ok {
            let job = KvJob {
                kv: kv.ptr,
                norm_w: norm_w.ptr,
                slots: slots.ptr,
                cache: outputs[0].ptr,
                cache_rows: rows,
                cache_f16: outputs[0].meta.dtype == DType::F16,
                kv_lora: self.kv.kv_lora,
                qk_rope: self.kv.qk_rope,
                eps: self.kv.eps,
            };
            return self
                .query
                .launch(ctx, op, [q, k_b, positions], outputs[1].ptr, Some(job));
        }
        self.query
            .launch(ctx, op, [q, k_b, positions], outputs[1].ptr, None)?;
        let ins = [kv.ptr, norm_w.ptr, positions.ptr, slots.ptr];
        let cache = Some((rows, outputs[0].meta.dtype));
        // SAFETY: check_device verified the token inputs and the rows×W cache.
        unsafe { self.kv.launch(ctx, op, ins, outputs[0].ptr, n, cache) }
    }
}

/// `mla.cu` as NVRTC compiles it: the rope, head-product, `MlaKv` and cache-write kernels,
/// then the decode attention (`mla_attention.cu`, which uses the first part's helpers).
pub(crate) const MLA_CU: &str = concat!(
    include_str!("../dequant/dequant.cuh"),
    include_str!("mla.cu"),
    include_str!("mla_attention.cu")
);

/// Weight segments of 8 BF16 values one lane of `head_gemv_bf16` holds (`HG_SEGS` there).
pub(super) const HG_SEGS: usize = 4;

/// `head_mma`'s k slice and pipeline depth (`HT_BK`, `HT_STAGES` in mla.cu), and its shared
/// memory rows' padding in elements.
pub(super) const HT_BK: usize = 32;

pub(super) const HT_STAGES: usize = 3;

pub(super) const HT_PAD: usize = 8;

/// Tokens beyond which `head_mma` takes its 128-token tile.
pub(super) const HT_LARGE_TILE_FROM: usize = 512;

/// `head_mma` blocks resident on an SM (its `__launch_bounds__`; shared memory allows it).
pub(super) const HT_BLOCKS_PER_SM: usize = 2;

/// Most K parts `head_mma` splits a product into (`HT_MAX_SPLITS` in mla.cu).
pub(super) const HT_MAX_SPLITS: usize = 8;

/// Fewest K slices a part takes: the tiles' pipeline is three slices deep.
const HT_SPLIT_MIN_SLICES: usize = 4;

/// Multiprocessors a split is planned for at most (an op's scratch is sized for this many).
pub(super) const HT_SPLIT_MAX_SMS: usize = 132;

/// K parts for `blocks` tile blocks over `n_in` inputs: about as many as the block slots left
/// empty ([`HT_BLOCKS_PER_SM`] a multiprocessor), of about [`HT_SPLIT_MIN_SLICES`] slices or
/// more. The kernel gives part kp the slices from kp·⌈slices / parts⌉, so the count returned is
/// one that leaves no part empty (6 of 25 slices would: parts of 5 leave the sixth none). The
/// value product (32 heads, one 128-row tile each, 512 inputs) at a decode step of 9..64 rows
/// is 32 blocks on a 132-multiprocessor card: four parts.
pub(super) fn head_mma_splits(blocks: usize, n_in: usize, sms: usize) -> usize {
    let slices = n_in.div_ceil(HT_BK).max(1);
    let room = HT_BLOCKS_PER_SM * sms.min(HT_SPLIT_MAX_SMS) / blocks.max(1);
    let want = room
        .min(slices / HT_SPLIT_MIN_SLICES)
        .clamp(1, HT_MAX_SPLITS);
    slices.div_ceil(slices.div_ceil(want))
}

/// Scratch for [`head_mma_splits`]'s partial sums of a per-head product (f32 `[parts][n_tok]
/// [n_head][n_out]`, 256 bytes of alignment), none where the tiles would not split on a card
/// of [`HT_SPLIT_MAX_SMS`] multiprocessors; one token tile a head is the fewest blocks.
pub(super) fn head_split_scratch(n_tok: usize, n_head: usize, n_out: usize, n_in: usize) -> usize {
    if n_tok <= crate::mla::HEAD_GEMV_ROWS_LIMIT {
        // Tokens the GEMV may take: the lowering puts them there.
        return 0;
    }
    let bm = if n_tok > HT_LARGE_TILE_FROM { 128 } else { 64 };
    let parts = head_mma_splits(n_head * n_tok.div_ceil(bm), n_in, HT_SPLIT_MAX_SMS);
    if parts <= 1 {
        0
    } else {
        256 + parts * n_tok * n_head * n_out * 4
    }
}

/// The rope part of a [`head_gemv`] launch.
pub(super) struct HeadRope {
    positions: u64,
    n_rot: usize,
    /// Offset of the pairs in each (token, head) input row, and of their output.
    src: usize,
    dst: usize,
    k: RopeConsts,
}

/// `y[t][h][o] = Σ_i W[h][o][i]·x[t][h][i]` with `x` and `y` addressed by strides (in f32
/// elements) per token and per head.
pub(super) struct HeadGemv<'a> {
    w: &'a DeviceTensor<'a>,
    n_head: usize,
    n_out: usize,
    n_in: usize,
    x: u64,
    x_tok: usize,
    x_head: usize,
    y: u64,
    y_tok: usize,
    y_head: usize,
    n_tok: usize,
    rope: Option<HeadRope>,
    /// The step's cache rows written by an extra column of blocks (the GEMV kernel only).
    kv: Option<KvJob>,
    /// Where the tensor-core tiles may keep K-split partial sums ([`head_mma_splits`]); the
    /// tiles split no further than it holds (an empty one: not at all).
    part: Scratch,
}

/// The cache-row job of a fused query launch ([`MlaQueryKv`]): `mla_kv`'s inputs and the cache.
pub(super) struct KvJob {
    kv: u64,
    norm_w: u64,
    slots: u64,
    cache: u64,
    cache_rows: usize,
    cache_f16: bool,
    kv_lora: usize,
    qk_rope: usize,
    eps: f32,
}

/// A head-product launch's rope arguments (positions, width, source and destination offsets,
/// constants; all zero without a rope), appended last to each kernel's argument list.
struct RopeLaunch {
    positions: u64,
    n_rot: usize,
    src: usize,
    dst: usize,
    k: RopeConsts,
}

impl RopeLaunch {
    fn of(rope: &Option<HeadRope>) -> RopeLaunch {
        match rope {
            Some(r) => RopeLaunch {
                positions: r.positions,
                n_rot: r.n_rot,
                src: r.src,
                dst: r.dst,
                k: r.k,
            },
            None => RopeLaunch {
                positions: 0,
                n_rot: 0,
                src: 0,
                dst: 0,
                k: RopeConsts {
                    theta_scale: 0.0,
                    freq_scale: 0.0,
                    ext_factor: 0.0,
                    corr: [0.0; 2],
                    mscale: 0.0,
                },
            },
        }
    }

    fn args<'a>(&self, op: &'static str, l: Launch<'a>) -> Result<Launch<'a>, OpError> {
        let i = |what, v| dim_i32(op, what, v);
        Ok(l.arg(self.positions)
            .arg(i("rope width", self.n_rot)?)
            .arg(i("rope source", self.src)?)
            .arg(i("rope destination", self.dst)?)
            .arg(self.k.theta_scale)
            .arg(self.k.freq_scale)
            .arg(self.k.ext_factor)
            .arg(self.k.corr[0])
            .arg(self.k.corr[1])
            .arg(self.k.mscale))
    }
}

impl HeadGemv<'_> {
    /// The arguments every head-product kernel opens with: weight, x and y with their strides,
    /// tokens, output rows, input width.
    fn io_args<'l>(&self, op: &'static str, l: Launch<'l>) -> Result<Launch<'l>, OpError> {
        let i = |what, v| dim_i32(op, what, v);
        Ok(l.arg(self.w.ptr)
            .arg(self.x)
            .arg(self.x_tok as i64)
            .arg(self.x_head as i64)
            .arg(self.y)
            .arg(self.y_tok as i64)
            .arg(self.y_head as i64)
            .arg(i("tokens", self.n_tok)?)
            .arg(i("rows", self.n_out)?)
            .arg(i("input width", self.n_in)?))
    }
}

pub(super) fn head_gemv(
    ctx: &GpuCtx,
    op: &'static str,
    kernel: HeadKernel,
    a: &HeadGemv<'_>,
) -> Result<(), OpError> {
    if a.n_tok == 0 {
        return Ok(());
    }
    if a.kv.is_some() && (kernel != HeadKernel::Gemv || a.rope.is_none()) {
        return Err(OpError::shape(
            op,
            "the cache-row job runs beside the roped per-head GEMV only",
        ));
    }
    let tiles = match kernel {
        HeadKernel::Unlowered => return Err(unlowered(op)),
        HeadKernel::Gemv if a.n_tok > HEAD_GEMV_ROWS_LIMIT => {
            return Err(OpError::shape(
                op,
                format!(
                    "the per-head GEMV takes at most {HEAD_GEMV_ROWS_LIMIT} tokens, found {}",
                    a.n_tok
                ),
            ));
        }
        HeadKernel::Gemv => false,
        HeadKernel::TensorCore => true,
        HeadKernel::Generic => return head_generic(ctx, op, a),
    };
    if a.w.meta.dtype != DType::BF16 {
        return Err(OpError::shape(
            op,
            format!(
                "the CUDA kernel reads the per-head weight as BF16, found {}",
                a.w.meta
            ),
        ));
    }
    let nseg = a.n_in / 8;
    if !a.n_in.is_multiple_of(8) || nseg > 32 * HG_SEGS {
        return Err(OpError::shape(
            op,
            format!(
                "the CUDA kernel needs a per-head input width that is a multiple of 8 and at \
                 most {}, found {}",
                8 * 32 * HG_SEGS,
                a.n_in
            ),
        ));
    }
    aligned16(op, "the per-head weight", a.w)?;
    if a.n_head > 65535 {
        return Err(OpError::shape(
            op,
            format!("{} heads exceed a grid dimension", a.n_head),
        ));
    }
    let rope = RopeLaunch::of(&a.rope);
    let rope_n = rope.n_rot;
    let i = |what, v| dim_i32(op, what, v);
    let rope_col = usize::from(rope_n > 0);
    if tiles {
        // Tile (tokens, outputs), the larger one where there are enough tokens to fill the
        // card (on the H200 64x128 is faster up to 256 tokens, 128x128 from 1024; at 512
        // they are within 10%).
        let (name, bm, bn) = if a.n_tok > HT_LARGE_TILE_FROM {
            ("head_mma_bf16_128x128", 128, 128)
        } else {
            ("head_mma_bf16_64x128", 64, 128)
        };
        let col_tiles = a.n_out.div_ceil(bn);
        let tok_tiles = a.n_tok.div_ceil(bm);
        if tok_tiles > 65535 {
            return Err(OpError::shape(
                op,
                format!("{} tokens exceed the grid", a.n_tok),
            ));
        }
        // Each block runs a group of column tiles in one pipeline: as few groups as still
        // make two waves of HT_BLOCKS_PER_SM blocks an SM (on the H200, 2 groups of the
        // query's 4 tiles from 512 tokens on beat 1 and 4 by 5-15%; every grouping gives
        // the same bits).
        let rows = a.n_head * tok_tiles;
        let slots = 2 * HT_BLOCKS_PER_SM * ctx.device.sm_count() as usize;
        let groups = slots.div_ceil(rows).clamp(1, col_tiles);
        let col_per_block = col_tiles.div_ceil(groups);
        let groups = col_tiles.div_ceil(col_per_block);
        // K split into the block slots the tiles leave empty, as far as the scratch holds.
        let one_split = a.n_tok * a.n_head * a.n_out * 4;
        let part = a.part.ptr.next_multiple_of(256);
        let room = if a.part.ptr == 0 || a.part.bytes < 256 {
            0
        } else {
            (a.part.bytes - 256) / one_split.max(1)
        };
        let ksplit = head_mma_splits(groups * rows, a.n_in, ctx.device.sm_count() as usize)
            .min(room)
            .max(1);
        let x_vec =
            a.x.is_multiple_of(16) && a.x_tok.is_multiple_of(4) && a.x_head.is_multiple_of(4);
        let y_vec =
            a.y.is_multiple_of(8) && a.y_tok.is_multiple_of(2) && a.y_head.is_multiple_of(2);
        let smem = HT_STAGES * (bm * (HT_BK + HT_PAD) * 4 + bn * (HT_BK + HT_PAD) * 2);
        let kern = ctx.kernel("mla.cu", MLA_CU, name)?;
        // SAFETY: argument list matches HEAD_MMA_KERNEL's; as for head_gemv_bf16 below (the
        // 16-byte copies and 8-byte stores only where x_vec / y_vec say they are aligned).
        return unsafe {
            rope.args(
                op,
                a.io_args(
                    op,
                    ctx.device
                        .launch(&kern)
                        .grid((
                            i("column groups", groups * ksplit + rope_col)? as u32,
                            a.n_head as u32,
                            tok_tiles as u32,
                        ))
                        .block(256)
                        .shared_mem(smem as u32),
                )?
                .arg(col_tiles as i32)
                .arg(col_per_block as i32)
                .arg(i32::from(x_vec))
                .arg(i32::from(y_vec)),
            )?
            .arg(ksplit as i32)
            .arg(if ksplit > 1 { part } else { 0u64 })
            .enqueue()
            .map_err(dev_err)?;
            if ksplit <= 1 {
                return Ok(());
            }
            let sum = ctx.kernel("mla.cu", MLA_CU, "head_split_sum")?;
            let blocks = i("sum blocks", (a.n_tok * a.n_head * a.n_out).div_ceil(256))?;
            // SAFETY: head_split_sum reads the ksplit·n·heads·outs partial sums written just
            // above (inside the scratch: `room`) and writes y by its strides, as the tiles do.
            ctx.device
                .launch(&sum)
                .grid(blocks as u32)
                .block(256)
                .arg(part)
                .arg(a.y)
                .arg(a.y_tok as i64)
                .arg(a.y_head as i64)
                .arg(i("tokens", a.n_tok)?)
                .arg(i("heads", a.n_head)?)
                .arg(i("rows", a.n_out)?)
                .arg(ksplit as i32)
                .enqueue()
                .map_err(dev_err)
        };
    }
    // A group of `lpr` lanes owns a row: as many as its 16-byte segments, up to a warp; one
    // row per group, so a decode token's 4 MB weight is spread over many blocks.
    let lpr = nseg.next_power_of_two().min(32);
    let groups = 32 / lpr;
    let passes = 1;
    let row_blocks = a.n_out.div_ceil(passes * 8 * groups);
    let tok_tile = (8192 / a.n_in).clamp(1, a.n_tok);
    let grid_x = row_blocks + rope_col + usize::from(a.kv.is_some());
    let name = if a.kv.is_some() {
        "head_gemv_bf16_kv"
    } else {
        "head_gemv_bf16"
    };
    let kern = ctx.kernel("mla.cu", MLA_CU, name)?;
    // SAFETY: argument list matches head_gemv_bf16 (and, with the cache-row job,
    // head_gemv_bf16_kv's trailing arguments); the shape rule (checked by the caller) makes
    // every strided access fall inside the views, whose sizes check_device verified, and the
    // cache job writes only rows in [0, cache_rows).
    unsafe {
        let l = rope.args(
            op,
            a.io_args(
                op,
                ctx.device
                    .launch(&kern)
                    .grid((dim_i32(op, "row blocks", grid_x)? as u32, a.n_head as u32))
                    .block(256)
                    .shared_mem((tok_tile * a.n_in * 4) as u32),
            )?
            .arg(lpr.trailing_zeros() as i32)
            .arg(passes as i32)
            .arg(row_blocks as i32)
            .arg(tok_tile as i32),
        )?;
        match &a.kv {
            Some(j) => l
                .arg(j.kv)
                .arg(j.norm_w)
                .arg(j.slots)
                .arg(j.cache)
                .arg(i("kv_lora", j.kv_lora)?)
                .arg(i("qk_rope", j.qk_rope)?)
                .arg(j.eps)
                .arg(i("cache rows", j.cache_rows)?)
                .arg(i32::from(j.cache_f16)),
            None => l,
        }
        .enqueue()
        .map_err(dev_err)
    }
}

/// `head_generic` (mla.cu): per-head weights of any type the CPU reads, a warp an output row.
fn head_generic(ctx: &GpuCtx, op: &'static str, a: &HeadGemv<'_>) -> Result<(), OpError> {
    let (wt, row_bytes) = weight_rows(op, "per-head weight", a.w.meta, a.n_in)?;
    if a.n_tok > 65535 || a.n_head > 65535 {
        return Err(OpError::shape(
            op,
            format!("{} tokens of {} heads exceed the grid", a.n_tok, a.n_head),
        ));
    }
    let rope = RopeLaunch::of(&a.rope);
    let rope_n = rope.n_rot;
    let i = |what, v| dim_i32(op, what, v);
    let row_tiles = a.n_out.div_ceil(8).clamp(1, 16);
    let kern = ctx.kernel("mla.cu", MLA_CU, "head_generic")?;
    // SAFETY: argument list matches head_generic; row_bytes is the weight type's row of n_in
    // values and the shape rule (checked by the caller) keeps every strided access inside the
    // views, whose sizes check_device verified.
    unsafe {
        rope.args(
            op,
            a.io_args(
                op,
                ctx.device
                    .launch(&kern)
                    .grid((
                        i("row tiles", row_tiles + usize::from(rope_n > 0))? as u32,
                        a.n_head as u32,
                        a.n_tok as u32,
                    ))
                    .block(256),
            )?
            .arg(row_tiles as i32)
            .arg(wt)
            .arg(row_bytes as i64),
        )?
        .enqueue()
        .map_err(dev_err)
    }
}

impl MlaKv {
    /// One block a token: the f64 sum of squares, then the scaled latent and the roped key.
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let n = inputs[2].meta.shape[0];
        if n == 0 {
            return Ok(());
        }
        // SAFETY: check_device verified kv (n×W), norm_w, positions and the n×W output.
        unsafe {
            self.launch(
                ctx,
                op,
                // Without the cache the slots are not read: the positions stand in.
                [inputs[0].ptr, inputs[1].ptr, inputs[2].ptr, inputs[2].ptr],
                outputs[0].ptr,
                n,
                None,
            )
        }
    }
}

impl MlaKv {
    /// The `mla_kv` kernel over `[kv, norm_w, positions]` of n tokens: rows to `out[t]`, or with
    /// `cache` (its rows and type) to `out[slots[t]]` of that cache (skipping slots outside it
    /// and all but the last token naming a row).
    ///
    /// # Safety
    /// The buffers hold what [`MlaKv::infer`] describes for n tokens; `out` holds n rows, or
    /// `cache_rows` rows, of `kv_lora + qk_rope` f32.
    pub(super) unsafe fn launch(
        &self,
        ctx: &GpuCtx,
        op: &'static str,
        [kv, norm_w, positions, slots]: [u64; 4],
        out: u64,
        n: usize,
        cache: Option<(usize, DType)>,
    ) -> Result<(), OpError> {
        let k = self.rope.consts();
        let cache_f16 = matches!(cache, Some((_, DType::F16)));
        if cache_f16 && !(self.kv_lora.is_multiple_of(2) && self.qk_rope.is_multiple_of(2)) {
            return Err(OpError::shape(
                op,
                format!(
                    "an F16 cache takes rows of whole pairs, found kv_lora {} and rope {}",
                    self.kv_lora, self.qk_rope
                ),
            ));
        }
        let kern = ctx.kernel("mla.cu", MLA_CU, "mla_kv")?;
        // SAFETY: argument list matches mla_kv; the caller vouches for the buffers.
        unsafe {
            ctx.device
                .launch(&kern)
                .grid(dim_i32(op, "tokens", n)? as u32)
                .block(256)
                .arg(kv)
                .arg(norm_w)
                .arg(positions)
                .arg(slots)
                .arg(out)
                .arg(dim_i32(op, "kv_lora", self.kv_lora)?)
                .arg(dim_i32(op, "qk_rope", self.qk_rope)?)
                .arg(self.eps)
                .arg(k.theta_scale)
                .arg(k.freq_scale)
                .arg(k.ext_factor)
                .arg(k.corr[0])
                .arg(k.corr[1])
                .arg(k.mscale)
                .arg(i32::from(cache.is_some()))
                .arg(n as i32)
                .arg(dim_i32(op, "cache rows", cache.map_or(0, |c| c.0))?)
                .arg(i32::from(cache_f16))
                .enqueue()
                .map_err(dev_err)
        }
    }
}

impl MlaKvCacheWrite {
    /// `mla_kv`'s kernel with the cache as its output: one block a token writes its row at
    /// its position.
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let n = inputs[3].meta.shape[0];
        if n == 0 {
            return Ok(());
        }
        let cache = (outputs[0].meta.shape[0], outputs[0].meta.dtype);
        let ins = [inputs[1].ptr, inputs[2].ptr, inputs[3].ptr, inputs[4].ptr];
        // SAFETY: check_device verified the token inputs and the rows×W cache.
        unsafe { self.kv.launch(ctx, op, ins, outputs[0].ptr, n, Some(cache)) }
    }
}

impl KvCacheWrite {
    /// One block a token. The kernel skips a position outside the cache instead of
    /// failing (it cannot report); the engine refuses such positions on the host.
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let n = inputs[2].meta.shape[0];
        if n == 0 {
            return Ok(());
        }
        let (rows, w) = (outputs[0].meta.shape[0], outputs[0].meta.shape[1]);
        let cache_f16 = outputs[0].meta.dtype == DType::F16;
        if cache_f16 && !w.is_multiple_of(2) {
            return Err(OpError::shape(
                op,
                format!("an F16 cache takes rows of whole pairs, found rows of {w}"),
            ));
        }
        let kern = ctx.kernel("mla.cu", MLA_CU, "kv_cache_write")?;
        // SAFETY: argument list matches kv_cache_write; the kernel writes only rows in [0, rows).
        unsafe {
            ctx.device
                .launch(&kern)
                .grid(dim_i32(op, "tokens", n)? as u32)
                .block(256)
                .arg(outputs[0].ptr)
                .arg(inputs[1].ptr)
                .arg(inputs[2].ptr)
                .arg(n as i32)
                .arg(dim_i32(op, "W", w)?)
                .arg(dim_i32(op, "cache rows", rows)?)
                .arg(i32::from(cache_f16))
                .enqueue()
                .map_err(dev_err)
        }
    }
}

impl MlaAttention {
    /// [`AttentionPath::Flash`]: the f16 tensor-core flash kernel of [`crate::mla_prefill`].
    /// [`AttentionPath::SplitK`]: split-K flash attention on the tensor cores with
    /// f32-class corrections (`mla_attn_split_t*`, then `mla_attn_combine` when a token's rows
    /// are split over several chunks); see [`attention_chunks`] for the split and
    /// [`attention_tile`] for the tile. A position at or past the cache end (which the CPU
    /// reference and the engine refuse) gets zeros from the prefill kernel and all rows from
    /// the split kernel.
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        // The positions a sequence may attend: its table's blocks.
        let rows = inputs
            .get(3)
            .map_or(0, |t| t.meta.shape.get(1).copied().unwrap_or(0))
            * self.block_size;
        let n = inputs
            .get(2)
            .map_or(0, |p| p.meta.shape.first().copied().unwrap_or(0));
        let w = inputs
            .get(1)
            .map_or(0, |c| c.meta.shape.get(1).copied().unwrap_or(0));
        if let AttentionPath::FlashThenSplit { lead, f16 } = self.kernel {
            return self.flash_then_split(ctx, inputs, outputs, scratch, lead.min(n), f16);
        }
        let flash = match self.kernel {
            AttentionPath::Unlowered => return Err(unlowered(self.name())),
            AttentionPath::SplitK | AttentionPath::SplitKF16 => false,
            AttentionPath::SplitKWg => return self.cuda_wg(ctx, inputs, outputs, scratch),
            AttentionPath::FlashThenSplit { .. } => unreachable!("handled above"),
            AttentionPath::Flash if !self.flash_supports(w) => {
                return Err(self.flash_refuses(w));
            }
            AttentionPath::Flash => true,
        };
        if flash {
            check_device(self, inputs, outputs)?;
            let need = mla_prefill_scratch_bytes(n, self.n_head, rows, w, self.kv_lora);
            scratch.require("mla_attention", need)?;
            // SAFETY: check_device checked q (n×heads×W), the cache (rows×W), positions (n)
            // and out (n×heads×kv_lora); the scratch holds the f16 copy of the cache.
            return unsafe {
                launch_mla_prefill(
                    ctx,
                    inputs[0].ptr,
                    inputs[1].ptr,
                    inputs[1].meta.dtype,
                    inputs[2].ptr,
                    self.pages(inputs),
                    outputs[0].ptr,
                    n,
                    self.n_head,
                    w,
                    self.kv_lora,
                    rows,
                    self.kq_scale,
                    scratch,
                )
            };
        }
        let kernel = AttentionKernel {
            tile: attention_tile(n, rows, self.n_head),
            products: if self.kernel == AttentionPath::SplitKF16 {
                SplitProducts::F16
            } else {
                SplitProducts::Bf16Corrections
            },
        };
        self.cuda_with(ctx, inputs, outputs, scratch, kernel)
    }
}

impl MlaAttention {
    /// [`AttentionPath::FlashThenSplit`]: the flash kernel over rows `0..lead` (one
    /// sequence's consecutive tokens, the table's first), then the split kernel over the other
    /// rows, each launch given views of its rows. They run in order on one stream, so they
    /// share the scratch.
    fn flash_then_split(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
        lead: usize,
        f16: bool,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let (q, cache, pos, out) = (&inputs[0], &inputs[1], &inputs[2], &outputs[0]);
        let n = pos.meta.shape[0];
        let w = cache.meta.shape[1];
        let rows = inputs[3].meta.shape[1] * self.block_size;
        let (nh, lora) = (self.n_head, self.kv_lora);
        if lead > 0 {
            if !self.flash_supports(w) {
                return Err(self.flash_refuses(w));
            }
            scratch.require(op, mla_prefill_scratch_bytes(lead, nh, rows, w, lora))?;
            // SAFETY: check_device checked q, the cache, positions and out for all n rows; the
            // flash kernel reads and writes the first `lead` of them, and the table row of
            // row_seq[0] (the chunk's sequence); the scratch holds the f16 copy of its rows.
            unsafe {
                launch_mla_prefill(
                    ctx,
                    q.ptr,
                    cache.ptr,
                    cache.meta.dtype,
                    pos.ptr,
                    self.pages(inputs),
                    out.ptr,
                    lead,
                    nh,
                    w,
                    lora,
                    rows,
                    self.kq_scale,
                    scratch,
                )?;
            }
        }
        let rest = n - lead;
        if rest == 0 {
            return Ok(());
        }
        // Views of rows lead..n of the per-row inputs and of the output.
        let (qm, pm, sm, om) = (
            TensorMeta::f32([rest, nh, w]),
            TensorMeta::i32([rest]),
            TensorMeta::i32([rest]),
            TensorMeta::f32([rest, nh, lora]),
        );
        let view = |t: &DeviceTensor<'_>, meta, row_bytes: usize| DeviceTensor {
            meta,
            ptr: t.ptr + (lead * row_bytes) as u64,
            bytes: t.bytes.saturating_sub(lead * row_bytes),
        };
        let tail_in = [
            view(q, &qm, nh * w * 4),
            DeviceTensor { ..inputs[1] },
            view(pos, &pm, 4),
            DeviceTensor { ..inputs[3] },
            view(&inputs[4], &sm, 4),
        ];
        let tail_out = [view(out, &om, nh * lora * 4)];
        let kernel = AttentionKernel {
            tile: attention_tile(rest, rows, nh),
            products: if f16 {
                SplitProducts::F16
            } else {
                SplitProducts::Bf16Corrections
            },
        };
        self.cuda_with(ctx, &tail_in, &tail_out, scratch, kernel)
    }

    /// Inputs 3 and 4 (block table, row map) as the kernels take them; `check_device` has
    /// verified their shapes.
    fn pages(&self, inputs: &[DeviceTensor<'_>]) -> DevicePages {
        DevicePages {
            block_table: inputs[3].ptr,
            row_seq: inputs[4].ptr,
            table_width: inputs[3].meta.shape[1],
            block_size: self.block_size,
        }
    }

    /// The split of `n` tokens over `rows` table positions: its chunks a token and where the
    /// chunk partials (o, then (m, l)) go in `scratch`, which must hold them.
    fn split_partials(
        &self,
        n: usize,
        rows: usize,
        scratch: Scratch,
    ) -> Result<(usize, u64, u64), OpError> {
        let (op, nh, lora) = (self.name(), self.n_head, self.kv_lora);
        let chunks = attention_chunks(n, rows, nh);
        if chunks > ATT_MAX_CHUNKS {
            return Err(OpError::shape(
                op,
                format!("{chunks} chunks exceed the merge kernel's {ATT_MAX_CHUNKS}"),
            ));
        }
        let need = attention_scratch(n, rows, nh, lora);
        if scratch.bytes < need || (need > 0 && !scratch.ptr.is_multiple_of(16)) {
            return Err(OpError::Type(format!(
                "{op}: scratch of {} bytes at {:#x}, {need} 16-byte aligned bytes needed",
                scratch.bytes, scratch.ptr
            )));
        }
        let part_ml = scratch.ptr + (n * chunks * nh * lora * 4) as u64;
        Ok((chunks, scratch.ptr, part_ml))
    }

    /// Why the flash kernel does not take cache rows of width `w`.
    fn flash_refuses(&self, w: usize) -> OpError {
        OpError::shape(
            self.name(),
            format!(
                "the flash kernel needs rows of kv_lora + 64 with kv_lora a multiple of 64 up \
                 to 512, found rows of {w} with kv_lora {}",
                self.kv_lora
            ),
        )
    }

    /// Whether the flash kernel takes cache rows of width `w`.
    pub fn flash_supports(&self, w: usize) -> bool {
        w == self.kv_lora + 64 && self.kv_lora.is_multiple_of(64) && self.kv_lora <= 512
    }

    /// Whether the split kernel, which every step shape can take, covers cache rows of width
    /// `w` (latent + rope); Err states the rule. The lowering checks it when it plans, so a
    /// checkpoint whose latent is too wide is refused at load, not at a request.
    pub fn split_k_supports(&self, w: usize) -> Result<(), OpError> {
        let lora = self.kv_lora;
        if !w.is_multiple_of(4) || !lora.is_multiple_of(4) || w > ATT_MAX_W || lora > ATT_MAX_LORA {
            return Err(OpError::shape(
                self.name(),
                format!(
                    "the CUDA kernel needs cache rows (kv_lora_rank + rope dimension_count, \
                     found {w}) and kv_lora_rank (found {lora}) to be multiples of 4, at most \
                     {ATT_MAX_W} and {ATT_MAX_LORA}"
                ),
            ));
        }
        Ok(())
    }

    /// [`Op::cuda`] with the split kernel chosen by the caller, so tests can check and time
    /// every variant; the scratch is the same for all.
    #[doc(hidden)]
    pub fn cuda_with(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
        kernel: AttentionKernel,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let (q, cache, pos, out) = (&inputs[0], &inputs[1], &inputs[2], &outputs[0]);
        let n = pos.meta.shape[0];
        let pages = self.pages(inputs);
        let bshift = pages.block_shift(op)?;
        // `rows`: the positions a sequence may attend (its table's), which fix the split.
        let (rows, w) = (pages.table_width * self.block_size, cache.meta.shape[1]);
        let (nh, lora) = (self.n_head, self.kv_lora);
        if n == 0 {
            return Ok(());
        }
        self.split_k_supports(w)?;
        let tile = kernel.tile;
        if tile != 16 && tile != 32 {
            return Err(OpError::shape(
                op,
                format!("the CUDA kernel has tiles of 16 or 32 rows, not {tile}"),
            ));
        }
        // An F16 cache holds what the f16-operand kernel rounds to: only it reads one (`_hc`).
        let cache_f16 = cache.meta.dtype == DType::F16;
        if cache_f16 && (kernel.products != SplitProducts::F16 || !w.is_multiple_of(8)) {
            return Err(OpError::shape(
                op,
                format!(
                    "an F16 cache takes the f16-operand split kernel over rows of a multiple of 8 values, found {:?} over rows of {w}",
                    kernel.products
                ),
            ));
        }
        let name = format!(
            "mla_attn_split_t{tile}{}{}",
            kernel.products.suffix(),
            if cache_f16 { "c" } else { "" }
        );
        for (what, t) in [("Q", q), ("cache", cache), ("o_lat", out)] {
            aligned16(op, what, t)?;
        }
        let groups = nh.div_ceil(32);
        if n > 65535 || groups > 65535 {
            return Err(OpError::shape(
                op,
                format!("{n} tokens × {groups} head groups exceed the grid"),
            ));
        }
        let (chunks, part_o, part_ml) = self.split_partials(n, rows, scratch)?;
        let split = ctx.kernel("mla.cu", MLA_CU, &name)?;
        let i = |what, v| dim_i32(op, what, v);
        // SAFETY: argument list matches mla_attn_split_t*; rows read are clamped to the
        // cache, partials written only when chunks > 1, into the scratch checked above.
        unsafe {
            ctx.device
                .launch(&split)
                .grid((chunks as u32, n as u32, groups as u32))
                .block(256)
                .shared_mem(attention_smem(tile, cache.meta.dtype) as u32)
                .arg(q.ptr)
                .arg(cache.ptr)
                .arg(pos.ptr)
                .arg(pages.block_table)
                .arg(pages.row_seq)
                .arg(i("table width", pages.table_width)?)
                .arg(bshift)
                .arg(out.ptr)
                .arg(part_o)
                .arg(part_ml)
                .arg(i("n_head", nh)?)
                .arg(w as i32)
                .arg(lora as i32)
                .arg(i("cache rows", rows)?)
                .arg(chunks as i32)
                .arg(self.kq_scale)
                .enqueue()
                .map_err(dev_err)?;
        }
        if chunks == 1 {
            return Ok(());
        }
        launch_combine(
            ctx, part_o, part_ml, pos.ptr, out.ptr, n, nh, lora, rows, chunks, tile,
        )
    }

    /// Whether [`AttentionPath::SplitKWg`]'s kernel takes this attention over cache rows of
    /// width `w`: the model's shape only (32 heads, a 512-wide latent and a 64-wide rope, blocks
    /// of at least 64 positions, each 64-row page one run of pool rows).
    pub fn wg_supports(&self, w: usize) -> bool {
        w == ATT_MAX_W
            && self.kv_lora == ATT_MAX_LORA
            && self.n_head == 32
            && self.block_size >= 64
            && self.block_size.is_power_of_two()
    }

    /// [`AttentionPath::SplitKWg`]: the warpgroup split kernel (`mla_attn_split_wg`, sm_90a)
    /// over an F16 cache, the chunks of [`attention_chunks`] in whole 64-row pages, then the
    /// merge the other split kernels use.
    #[doc(hidden)]
    pub fn cuda_wg(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let (q, cache, pos, out) = (&inputs[0], &inputs[1], &inputs[2], &outputs[0]);
        let n = pos.meta.shape[0];
        let pages = self.pages(inputs);
        let bshift = pages.block_shift(op)?;
        let (rows, w) = (pages.table_width * self.block_size, cache.meta.shape[1]);
        let (nh, lora) = (self.n_head, self.kv_lora);
        if n == 0 {
            return Ok(());
        }
        if !self.wg_supports(w) || cache.meta.dtype != DType::F16 {
            return Err(OpError::shape(
                op,
                format!(
                    "the warpgroup kernel takes an F16 cache of rows of {ATT_MAX_W}, 32 heads, \
                     kv_lora {ATT_MAX_LORA} and blocks of 64 positions or more; found a {:?} \
                     cache of rows of {w}, {nh} heads, kv_lora {lora}, blocks of {}",
                    cache.meta.dtype, self.block_size
                ),
            ));
        }
        let cc = ctx.device.compute_capability();
        if cc != (9, 0) {
            return Err(OpError::Type(format!(
                "{op}: the warpgroup kernel needs compute capability 9.0 (sm_90a), the device \
                 has {}.{}",
                cc.0, cc.1
            )));
        }
        for (what, t) in [("Q", q), ("cache", cache), ("o_lat", out)] {
            aligned16(op, what, t)?;
        }
        if n > 65535 {
            return Err(OpError::shape(op, format!("{n} tokens exceed the grid")));
        }
        let (chunks, part_o, part_ml) = self.split_partials(n, rows, scratch)?;
        let map = cache_tensor_map(cache.ptr, cache.meta.shape[0], w)
            .map_err(|e| OpError::Device(format!("{op}: the cache's tensor map: {e}")))?;
        let split = ctx.kernel("mla.cu", MLA_CU, "mla_attn_split_wg")?;
        let i = |what, v| dim_i32(op, what, v);
        // SAFETY: argument list matches mla_attn_split_wg; the pages it stages are those of
        // the token's positions (whole blocks of the pool, inside the tensor map); partials
        // are written only when chunks > 1, into the scratch checked above.
        unsafe {
            ctx.device
                .launch(&split)
                .grid((chunks as u32, n as u32, 1))
                .block(160)
                .shared_mem(ATT_WG_SMEM as u32)
                .arg(map)
                .arg(q.ptr)
                .arg(pos.ptr)
                .arg(pages.block_table)
                .arg(pages.row_seq)
                .arg(i("table width", pages.table_width)?)
                .arg(bshift)
                .arg(out.ptr)
                .arg(part_o)
                .arg(part_ml)
                .arg(i("cache rows", rows)?)
                .arg(chunks as i32)
                .arg(self.kq_scale)
                .enqueue()
                .map_err(dev_err)?;
        }
        if chunks == 1 {
            return Ok(());
        }
        launch_combine(
            ctx, part_o, part_ml, pos.ptr, out.ptr, n, nh, lora, rows, chunks, 64,
        )
    }
}

/// The tensor map of a pool of `rows` F16 cache rows of `w` values at `ptr`, in boxes of 64
/// rows × 64 values with the 128-byte swizzle. Encoded once a (pool, shape): an eager step
/// launches the kernel once a layer, each layer over its own pool.
fn cache_tensor_map(
    ptr: u64,
    rows: usize,
    w: usize,
) -> Result<::cuda::TensorMap, ::cuda::CudaError> {
    use std::sync::Mutex;
    /// Maps kept: a model's layers' pools, with room for a second engine's.
    const KEPT: usize = 512;
    /// (pool address, rows, width) and its map.
    type Kept = Vec<((u64, usize, usize), ::cuda::TensorMap)>;
    static MAPS: Mutex<Kept> = Mutex::new(Vec::new());
    let key = (ptr, rows, w);
    let mut maps = MAPS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, m)) = maps.iter().find(|(k, _)| *k == key) {
        return Ok(*m);
    }
    let m =
        ::cuda::tensor_map_f16_2d_swizzle128(ptr, w as u64, rows as u64, (w * 2) as u64, 64, 64)?;
    if maps.len() == KEPT {
        maps.clear();
    }
    maps.push((key, m));
    Ok(m)
}

/// Dynamic shared memory of `mla_attn_split_wg`: two 64-row pages of 576 f16 (nine 8 KB
/// boxes each), Q as f16 (32 × 576), the weights P^T (32 × 64 f16), and 1024 bytes to align
/// the swizzled layouts.
const ATT_WG_SMEM: usize = 2 * 9 * 8192 + 9 * 4096 + 4096 + 1024;

/// Merges the chunk partials of a split kernel into `out` (`mla_attn_combine_few` up to
/// [`ATT_FEW_CHUNKS`] chunks, else `mla_attn_combine`); `tile` is the split kernel's, which
/// fixes how rows were divided among the chunks.
#[allow(clippy::too_many_arguments)]
fn launch_combine(
    ctx: &GpuCtx,
    part_o: u64,
    part_ml: u64,
    pos: u64,
    out: u64,
    n: usize,
    nh: usize,
    lora: usize,
    rows: usize,
    chunks: usize,
    tile: usize,
) -> Result<(), OpError> {
    let few = chunks <= ATT_FEW_CHUNKS;
    let combine = ctx.kernel(
        "mla.cu",
        MLA_CU,
        if few {
            "mla_attn_combine_few"
        } else {
            "mla_attn_combine"
        },
    )?;
    let (grid, block) = if few {
        ((nh as u32, n as u32, 1), 128)
    } else {
        ((blocks_for(lora, 128), nh as u32, n as u32), 256)
    };
    // SAFETY: argument list matches mla_attn_combine and mla_attn_combine_few; each reads
    // the partials the split kernel wrote for the chunks the position makes valid (same
    // tile, same division) and writes the token's heads.
    unsafe {
        ctx.device
            .launch(&combine)
            .grid(grid)
            .block(block)
            .arg(part_o)
            .arg(part_ml)
            .arg(pos)
            .arg(out)
            .arg(nh as i32)
            .arg(lora as i32)
            .arg(rows as i32)
            .arg(chunks as i32)
            .arg(tile as i32)
            .enqueue()
            .map_err(dev_err)
    }
}

impl MlaValueOut {
    /// The same per-head BF16 product as `MlaQuery`'s, without the rope.
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let (nh, lora, vh) = (self.n_head, self.kv_lora, self.v_head);
        head_gemv(
            ctx,
            self.name(),
            self.kernel,
            &HeadGemv {
                w: &inputs[1],
                n_head: nh,
                n_out: vh,
                n_in: lora,
                x: inputs[0].ptr,
                x_tok: nh * lora,
                x_head: lora,
                y: outputs[0].ptr,
                y_tok: nh * vh,
                y_head: vh,
                n_tok: inputs[0].meta.shape[0],
                rope: None,
                kv: None,
                part: scratch,
            },
        )
    }
}
