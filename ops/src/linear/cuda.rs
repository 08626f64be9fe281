//! CUDA launches of the linear ops.

use super::plan::{
    BF16_SKINNY_BLOCK_WARPS, Bf16SkinnyPlan, CUBLAS_WORKSPACE, LinearPath, TqSplit, linear_path,
    prefill_scratch,
};
use super::{Linear, LinearPair, NormLinear};
use crate::check::as_i32;
use crate::dequant::wt_code;
use crate::gpu::{DeviceTensor, GpuCtx, Scratch, dev_err};
use crate::op::check_device;
use crate::tensor::DType;
use crate::{Op, OpError};

pub(crate) const LINEAR_CU: &str = concat!(
    include_str!("../dequant/dequant.cuh"),
    include_str!("linear.cu")
);

/// `linear_x_bf16`: the `total` f32 values at `x` narrowed to bf16 at `dst`.
///
/// # Safety
/// `x` holds `total` f32 values and `dst` has room for `total` bf16 values, both on `ctx`'s
/// device.
unsafe fn narrow_to_bf16(
    ctx: &GpuCtx,
    op: &'static str,
    x: u64,
    dst: u64,
    total: usize,
) -> Result<(), OpError> {
    let narrow = ctx.kernel("linear.cu", LINEAR_CU, "linear_x_bf16")?;
    // SAFETY: linear_x_bf16(x, dst, total) reads `total` f32 at `x` and writes `total` bf16 at
    // `dst`, which the caller vouches for.
    unsafe {
        ctx.device
            .launch(&narrow)
            .grid(as_i32(op, "narrowing blocks", total.div_ceil(2048))? as u32)
            .block(256)
            .arg(x)
            .arg(dst)
            .arg(total as i64)
            .enqueue()
            .map_err(dev_err)
    }
}

pub(super) fn kernel_suffix(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::Q8_0 => "q8_0",
        DType::Q6_K => "q6_k",
        DType::IQ4_NL => "iq4_nl",
        DType::I32 => "i32",
    }
}

/// Warps a GEMV block, shared bytes a warp (two stages of 4096 + 32) — as in linear.cu.
pub(super) const GEMV_WARPS: usize = 4;

pub(super) const GEMV_SMEM: u32 = (GEMV_WARPS * 2 * (4096 + 32)) as u32;

/// GEMV blocks resident per SM (its `__launch_bounds__`); the grid never exceeds one wave.
pub(super) const GEMV_BLOCKS_PER_SM: usize = 6;

impl Linear {
    /// [`LinearKernel::Gemv`]: f32 GEMV streaming the weight once (F32 tolerance, reordered
    /// sums); [`LinearKernel::TensorCore`]: x narrowed to bf16 into the scratch, then a cuBLAS GEMM (BF16 weights, cuBLAS's
    /// workspace in the scratch too) or bf16 tensor-core tiles decoding the weight in place
    /// (f32 accumulation either way: BF16 tolerance). Deterministic on every path.
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        let op = self.name();
        check_device(self, inputs, outputs)?;
        let (x, w, y) = (&inputs[0], &inputs[1], &outputs[0]);
        let (n, k, o) = (x.meta.shape[0], x.meta.shape[1], w.meta.shape[0]);
        if n == 0 || o == 0 {
            return Ok(());
        }
        let dtype = w.meta.dtype;
        let rb = dtype
            .row_bytes(k)
            .ok_or_else(|| OpError::shape(op, format!("weight {}: partial blocks", w.meta)))?;
        let (ni, ki, oi) = (
            as_i32(op, "n", n)?,
            as_i32(op, "in", k)?,
            as_i32(op, "out", o)?,
        );
        let launch = |name: &str, grid: (u32, u32), block: u32, smem: u32, extra: &[i32]| {
            let kern = ctx.kernel("linear.cu", LINEAR_CU, name)?;
            let mut l = ctx
                .device
                .launch(&kern)
                .grid(grid)
                .block(block)
                .shared_mem(smem)
                .arg(w.ptr)
                .arg(x.ptr)
                .arg(y.ptr)
                .arg(ni)
                .arg(ki)
                .arg(oi)
                .arg(rb as i64);
            for &v in extra {
                l = l.arg(v);
            }
            // SAFETY: the arguments follow the kernel's C signature; check_device checked
            // that x, W and y hold n×in f32, out rows of `rb` bytes and n×out f32, which
            // is all the kernels touch; the executor keeps the buffers alive.
            unsafe { l.enqueue() }.map_err(dev_err)
        };
        let kernel = self.kernel.chosen(op, n)?;
        let sms = ctx.device.sm_count() as usize;
        let path = linear_path(kernel, dtype, (n, k, o), x.ptr, w.ptr, sms);
        match path {
            LinearPath::Skinny => {
                // SAFETY: W holds o IQ4_NL rows of k values, x n×k f32, y n×o f32
                // (check_device), the scratch is this op's (cuda_scratch_bytes).
                unsafe {
                    crate::moe::prefill::launch_expert_skinny(
                        ctx,
                        op,
                        w.ptr,
                        None,
                        x.ptr,
                        n,
                        crate::moe::prefill::SkinnyRoutes::Dense,
                        y.ptr,
                        k,
                        o,
                        n,
                        None,
                        crate::moe::prefill::SkinnyPath::F16,
                        scratch,
                    )
                }
            }
            LinearPath::Bf16Skinny(plan) => {
                // SAFETY: W holds o BF16 rows of k values, x n×k f32, y n×o f32 (check_device).
                unsafe {
                    launch_bf16_skinny(ctx, op, plan, x.ptr, n, k, (w.ptr, y.ptr, o), None, scratch)
                }
            }
            LinearPath::Iq4Rows(nr, plan) => {
                let blocks = as_i32(op, "row tiles", o.div_ceil(plan.rt))?;
                launch(
                    &format!("gemv_iq4_nl_rows_{nr}"),
                    (blocks as u32, 1),
                    plan.threads as u32,
                    plan.smem_bytes(nr) as u32,
                    &[plan.rt as i32, plan.kp as i32],
                )
            }
            LinearPath::Bf16Dec(ju, r, s) => {
                let blocks = as_i32(op, "row groups", o.div_ceil(r))?;
                launch(
                    &format!("gemv_bf16_dec_{ju}_{r}"),
                    (blocks as u32, 1),
                    (32 * s) as u32,
                    0,
                    &[kernel.weights_first()],
                )
            }
            LinearPath::Q6kMma(plan) => launch(
                &format!("gemv_q6_k_mma_{}", plan.tiles),
                (plan.blocks as u32, 1),
                plan.threads() as u32,
                plan.smem_bytes(k) as u32,
                &[kernel.weights_first()],
            ),
            LinearPath::Gemv(nt) => {
                let blocks = o.div_ceil(GEMV_WARPS).min(sms * GEMV_BLOCKS_PER_SM);
                let name = format!("gemv_{}_{nt}", kernel_suffix(dtype));
                launch(&name, (blocks as u32, 1), 128, GEMV_SMEM, &[])
            }
            LinearPath::Cublas | LinearPath::Tiles(_) => {
                let need = prefill_scratch(dtype, n, k, o);
                let base = scratch.ptr.next_multiple_of(256);
                if scratch.ptr == 0
                    || (scratch.bytes as u64) < (base - scratch.ptr) + need as u64 - 256
                {
                    return Err(OpError::Type(format!(
                        "{op}: scratch of {} bytes at 0x{:x}, {need} needed (cuda_scratch_bytes)",
                        scratch.bytes, scratch.ptr
                    )));
                }
                let total = n * k;
                // SAFETY: n·k bf16 at `base` lie inside the scratch checked above.
                unsafe { narrow_to_bf16(ctx, op, x.ptr, base, total)? };
                match path {
                    LinearPath::Tiles(fit) => {
                        let grid = (o.div_ceil(128), n.div_ceil(fit.tokens()));
                        if grid.1 > 65535 {
                            return Err(OpError::shape(
                                op,
                                format!("n = {n} is more than 65535 tiles of {}", fit.tokens()),
                            ));
                        }
                        let split = TqSplit::choose(fit, n, k, o, sms);
                        // The partial sums follow xb (prefill_scratch sized them).
                        let part = if split.splits > 1 {
                            (base + (total * 2).next_multiple_of(256) as u64).next_multiple_of(256)
                        } else {
                            0
                        };
                        let pair = i32::from(o.is_multiple_of(2) && y.ptr.is_multiple_of(8));
                        let name = format!("linear_tq_{}_{}", kernel_suffix(dtype), fit.name());
                        let kern = ctx.kernel("linear.cu", LINEAR_CU, &name)?;
                        // SAFETY: the arguments follow linear_tq's C signature; W, y as for
                        // the other paths, xb the n·k bf16 written just above, the partial
                        // sums (split·n·o f32, when split) after it inside the scratch.
                        unsafe {
                            ctx.device
                                .launch(&kern)
                                .grid((grid.0 as u32, grid.1 as u32, split.splits as u32))
                                .block(256)
                                .shared_mem(fit.smem_bytes())
                                .arg(w.ptr)
                                .arg(x.ptr)
                                .arg(y.ptr)
                                .arg(ni)
                                .arg(ki)
                                .arg(oi)
                                .arg(rb as i64)
                                .arg(base)
                                .arg(pair)
                                .arg(part)
                                .arg(as_i32(op, "slices a split", split.per)?)
                                .enqueue()
                                .map_err(dev_err)?;
                        }
                        if split.splits <= 1 {
                            return Ok(());
                        }
                        // SAFETY: the splits·n·o partial sums were written just above; y
                        // holds n×o f32.
                        unsafe {
                            launch_split_sum(ctx, op, part, split.splits, n, (y.ptr, o), None)
                        }
                    }
                    _ => {
                        let ws = base + (total * 2).next_multiple_of(256) as u64;
                        // SAFETY: xb holds n×k bf16, W o×k bf16 (check_device), y n×o f32; the
                        // workspace is the rest of the scratch, clear of xb and 256-aligned.
                        unsafe {
                            ctx.blas
                                .gemm_bf16_f32_at(n, o, k, base, w.ptr, y.ptr, ws, CUBLAS_WORKSPACE)
                                .map_err(dev_err)
                        }
                    }
                }
            }
            LinearPath::Generic => {
                let grid = (o.div_ceil(4), n.div_ceil(8));
                if grid.1 > 65535 {
                    return Err(OpError::shape(
                        op,
                        format!("n = {n} is more than 65535 groups of 8"),
                    ));
                }
                let code = wt_code(dtype).ok_or_else(|| OpError::shape(op, "weight is I32"))?;
                launch(
                    "linear_generic",
                    (grid.0 as u32, grid.1 as u32),
                    128,
                    0,
                    &[code],
                )
            }
        }
    }
}

impl LinearPair {
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let (x, w1, w2) = (&inputs[0], &inputs[1], &inputs[2]);
        let kernel = self.kernel.chosen(op, x.meta.shape[0])?;
        let metas = [x.meta, w1.meta, w2.meta];
        if let Some((plan, n, _)) = Self::skinny_plan(kernel, &metas)
            && x.ptr.is_multiple_of(16)
            && w1.ptr.is_multiple_of(16)
            && w2.ptr.is_multiple_of(16)
        {
            if n == 0 {
                return Ok(());
            }
            let (y1, y2) = (&outputs[0], &outputs[1]);
            let (k, o1, o2) = (x.meta.shape[1], w1.meta.shape[0], w2.meta.shape[0]);
            // SAFETY: check_device checked x (n×in f32), both BF16 weights (out rows of in
            // values) and both outputs (n×out f32).
            return unsafe {
                launch_bf16_skinny(
                    ctx,
                    op,
                    plan,
                    x.ptr,
                    n,
                    k,
                    (w1.ptr, y1.ptr, o1),
                    Some((w2.ptr, y2.ptr, o2)),
                    scratch,
                )
            };
        }
        let sms = ctx.device.sm_count() as usize;
        let Some((ju, r, s)) = Self::fused_plan(kernel, x, w1, w2, sms) else {
            let one = Linear::with(kernel);
            one.cuda(ctx, &[*x, *w1], &outputs[..1], scratch)?;
            return one.cuda(ctx, &[*x, *w2], &outputs[1..], scratch);
        };
        let (k, o1, o2) = (x.meta.shape[1], w1.meta.shape[0], w2.meta.shape[0]);
        let blocks = as_i32(op, "row groups", o1.div_ceil(r) + o2.div_ceil(r))?;
        let rb = DType::BF16
            .row_bytes(k)
            .ok_or_else(|| OpError::shape(op, format!("{k} BF16 inputs")))?;
        let kern = ctx.kernel("linear.cu", LINEAR_CU, &format!("gemv_bf16_dec2_{ju}_{r}"))?;
        // SAFETY: the arguments follow gemv_bf16_dec2's C signature; check_device checked x
        // (1×in f32), both BF16 weights (out rows of `rb` bytes) and both outputs.
        unsafe {
            ctx.device
                .launch(&kern)
                .grid(blocks as u32)
                .block((32 * s) as u32)
                .arg(w1.ptr)
                .arg(x.ptr)
                .arg(outputs[0].ptr)
                .arg(1i32)
                .arg(as_i32(op, "in", k)?)
                .arg(as_i32(op, "out", o1)?)
                .arg(rb as i64)
                .arg(w2.ptr)
                .arg(outputs[1].ptr)
                .arg(as_i32(op, "out", o2)?)
                .arg(kernel.weights_first())
                .enqueue()
                .map_err(dev_err)
        }
    }
}

impl NormLinear {
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let (x, g, w, y) = (&inputs[0], &inputs[1], &inputs[2], &outputs[0]);
        let (n, k, o) = (x.meta.shape[0], x.meta.shape[1], w.meta.shape[0]);
        if n == 0 || o == 0 {
            return Ok(());
        }
        let kernel = self.kernel.chosen(op, n)?;
        let sms = ctx.device.sm_count() as usize;
        let path = linear_path(kernel, w.meta.dtype, (n, k, o), x.ptr, w.ptr, sms);
        if let (LinearPath::Bf16Dec(ju, r, s), true) = (path, g.ptr.is_multiple_of(16)) {
            let rb = DType::BF16
                .row_bytes(k)
                .ok_or_else(|| OpError::shape(op, format!("{k} BF16 inputs")))?;
            let kern = ctx.kernel(
                "linear.cu",
                LINEAR_CU,
                &format!("gemv_bf16_dec_norm_{ju}_{r}"),
            )?;
            // SAFETY: the arguments follow gemv_bf16_dec_norm's C signature; check_device
            // checked x (1×in f32), the norm weight (in f32), W (out rows of `rb` bytes), y.
            return unsafe {
                ctx.device
                    .launch(&kern)
                    .grid(as_i32(op, "row groups", o.div_ceil(r))? as u32)
                    .block((32 * s) as u32)
                    .arg(w.ptr)
                    .arg(x.ptr)
                    .arg(y.ptr)
                    .arg(1i32)
                    .arg(as_i32(op, "in", k)?)
                    .arg(as_i32(op, "out", o)?)
                    .arg(rb as i64)
                    .arg(g.ptr)
                    .arg(self.eps)
                    .arg(kernel.weights_first())
                    .enqueue()
                    .map_err(dev_err)
            };
        }
        let metas = [x.meta, g.meta, w.meta];
        let (normed_bytes, need) = self.split_scratch(&metas);
        scratch.require(op, need)?;
        // SAFETY: the normalised x (n×in f32) goes to the start of the scratch checked above.
        unsafe {
            crate::norm::launch_rms_norm(ctx, x.ptr, Some(g.ptr), scratch.ptr, n, k, self.eps)?
        };
        let normed = DeviceTensor {
            meta: x.meta,
            ptr: scratch.ptr,
            bytes: n * k * 4,
        };
        let rest = Scratch {
            ptr: scratch.ptr + normed_bytes as u64,
            bytes: need - normed_bytes,
        };
        Linear::with(kernel).cuda(ctx, &[normed, *w], outputs, rest)
    }
}

/// `linear_x_bf16` narrowing x into `scratch`, then `linear_skinny_bf16_<nt>` over one BF16
/// weight, or two (`second`: its row tiles follow the first's), then, when K is split,
/// `linear_skinny_reduce` over the partial sums after the narrowed x. Each of `first` and
/// `second` is (weight, output, rows).
///
/// # Safety
/// `x` holds n×k f32, each weight `rows` BF16 rows of k values at a 16-byte-aligned address,
/// each output n×rows f32; `scratch` is this op's.
#[allow(clippy::too_many_arguments)]
unsafe fn launch_bf16_skinny(
    ctx: &GpuCtx,
    op: &'static str,
    plan: Bf16SkinnyPlan,
    x: u64,
    n: usize,
    k: usize,
    first: (u64, u64, usize),
    second: Option<(u64, u64, usize)>,
    scratch: Scratch,
) -> Result<(), OpError> {
    let (w1, y1, o1) = first;
    let (w2, y2, o2) = second.unwrap_or((0, 0, 0));
    let (tiles, outs) = (o1.div_ceil(32) + o2.div_ceil(32), o1 + o2);
    scratch.require(op, plan.scratch_bytes(n, k, outs))?;
    let xb = scratch.ptr.next_multiple_of(256);
    let part = if plan.splits > 1 {
        xb + (n * k * 2).next_multiple_of(256) as u64
    } else {
        0
    };
    // SAFETY: n·k bf16 at `xb` lie inside the scratch required above.
    unsafe { narrow_to_bf16(ctx, op, x, xb, n * k)? };
    let blocks = as_i32(
        op,
        "skinny blocks",
        plan.splits * tiles.div_ceil(BF16_SKINNY_BLOCK_WARPS),
    )?;
    let token_tiles = as_i32(op, "token tiles", plan.token_tiles)?;
    if token_tiles > 65535 {
        return Err(OpError::shape(
            op,
            format!("n = {n}: more than 65535 token tiles"),
        ));
    }
    let (ni, ki) = (as_i32(op, "n", n)?, as_i32(op, "in", k)?);
    let (o1i, o2i) = (as_i32(op, "out", o1)?, as_i32(op, "out", o2)?);
    let splits = as_i32(op, "splits", plan.splits)?;
    let kern = ctx.kernel(
        "linear.cu",
        LINEAR_CU,
        &format!("linear_skinny_bf16_{}", plan.nt),
    )?;
    // SAFETY: the arguments follow linear_skinny_bf16's C signature; the caller vouches for
    // the weights and the outputs, xb holds the n·k bf16 written just above, and the partial
    // sums (splits·n·outs f32) after it fit the scratch required above.
    unsafe {
        ctx.device
            .launch(&kern)
            .grid((blocks as u32, token_tiles as u32))
            .block((32 * BF16_SKINNY_BLOCK_WARPS) as u32)
            .shared_mem(plan.shared_bytes() as u32)
            .arg(w1)
            .arg(xb)
            .arg(y1)
            .arg(ni)
            .arg(ki)
            .arg(o1i)
            .arg(w2)
            .arg(y2)
            .arg(o2i)
            .arg(part)
            .arg(splits)
            .arg(as_i32(op, "chunks a split", plan.per)?)
            .enqueue()
            .map_err(dev_err)?;
    }
    if plan.splits <= 1 {
        return Ok(());
    }
    // SAFETY: the splits·n·outs partial sums were written just above; the caller vouches for
    // the outputs.
    unsafe {
        launch_split_sum(
            ctx,
            op,
            part,
            plan.splits,
            n,
            (y1, o1),
            second.map(|(_, y2, o2)| (y2, o2)),
        )
    }
}

/// `linear_skinny_reduce`: `y` (n×o f32, and `y2`, n×o2, after column o) as the sum of
/// `splits` partial sums `part[split][n][o + o2]`, added in split order.
///
/// # Safety
/// `part` holds splits·n·(o + o2) f32; `y` n×o f32 and `y2` n×o2 f32.
unsafe fn launch_split_sum(
    ctx: &GpuCtx,
    op: &'static str,
    part: u64,
    splits: usize,
    n: usize,
    (y, o): (u64, usize),
    y2: Option<(u64, usize)>,
) -> Result<(), OpError> {
    let (y2, o2) = y2.unwrap_or((0, 0));
    let reduce = ctx.kernel("linear.cu", LINEAR_CU, "linear_skinny_reduce")?;
    let grid = as_i32(op, "reduce blocks", (n * (o + o2)).div_ceil(256))?;
    // SAFETY: the caller's: the reads and writes stay within part, y and y2 as stated.
    unsafe {
        ctx.device
            .launch(&reduce)
            .grid(grid as u32)
            .block(256)
            .arg(part)
            .arg(y)
            .arg(y2)
            .arg(as_i32(op, "n", n)?)
            .arg(as_i32(op, "out", o)?)
            .arg(as_i32(op, "out", o2)?)
            .arg(as_i32(op, "splits", splits)?)
            .enqueue()
            .map_err(dev_err)
    }
}
