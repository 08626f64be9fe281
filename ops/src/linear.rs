//! `y = W · x` for a stored weight `[out, in]` of any weight type (spec §0).

use crate::cpu::matmul;
use crate::elementwise::{arity, want_dtype};
use crate::gpu::{DeviceTensor, GpuCtx, Scratch, dev_err};
use crate::op::{check_device, check_host};
use crate::tensor::{DType, HostTensor, HostTensorMut, TensorMeta};
use crate::{Op, OpError};

pub(crate) const LINEAR_CU: &str = concat!(
    include_str!("../kernels/dequant.cuh"),
    include_str!("../kernels/linear.cu")
);

/// A launch dimension or size as the kernels' `int`, or a shape error naming it.
pub(crate) fn as_i32(op: &'static str, what: &str, v: usize) -> Result<i32, OpError> {
    i32::try_from(v)
        .map_err(|_| OpError::shape(op, format!("{what} = {v} exceeds the kernels' i32 range")))
}

/// The weight-type code of `kernels/dequant.cuh`.
pub(crate) fn wt_code(dtype: DType) -> Option<i32> {
    Some(match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::Q8_0 => 3,
        DType::Q6_K => 4,
        DType::IQ4_NL => 5,
        DType::I32 => return None,
    })
}

fn kernel_suffix(dtype: DType) -> &'static str {
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

/// The most rows the weight-streaming GEMV kernels take (`gemv_*_<nt>`, nt ≤ 8).
pub const GEMV_ROWS_LIMIT: usize = 8;

/// The family of kernels a [`Linear`]-shaped product runs on the GPU. The graph's lowering
/// chooses it per step shape (`graph::LoweringOptions`); an op never picks its own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LinearKernel {
    /// Declared and not lowered: the CPU reference runs it, the CUDA path refuses it.
    #[default]
    Unlowered,
    /// The weight-streaming GEMV, at most [`GEMV_ROWS_LIMIT`] rows (the IQ4_NL row split, the
    /// one-token BF16 kernel, or the generic GEMV; f32 sums). With `weights_first` the
    /// one-token BF16 kernel issues its weight loads before waiting for its predecessor.
    Gemv { weights_first: bool },
    /// x narrowed to bf16, then cuBLAS (BF16 weights) or mma.sync tiles decoding the weight
    /// (other types): f32 accumulation, BF16 tolerance.
    TensorCore,
}

impl LinearKernel {
    /// The variant as a plan's text shows it (empty while unlowered).
    pub fn label(self) -> &'static str {
        match self {
            LinearKernel::Unlowered => "",
            LinearKernel::Gemv {
                weights_first: true,
            } => " [gemv, weights first]",
            LinearKernel::Gemv {
                weights_first: false,
            } => " [gemv]",
            LinearKernel::TensorCore => " [tensor cores]",
        }
    }

    /// The chosen variant for `n` rows, or why the CUDA path cannot run it.
    pub(crate) fn chosen(self, op: &'static str, n: usize) -> Result<LinearKernel, OpError> {
        match self {
            LinearKernel::Unlowered => Err(unlowered(op)),
            LinearKernel::Gemv { .. } if n > GEMV_ROWS_LIMIT => Err(OpError::shape(
                op,
                format!("the GEMV takes at most {GEMV_ROWS_LIMIT} rows, found {n}"),
            )),
            k => Ok(k),
        }
    }

    fn weights_first(self) -> i32 {
        i32::from(matches!(
            self,
            LinearKernel::Gemv {
                weights_first: true
            }
        ))
    }
}

/// The refusal of an op whose CUDA kernel was never chosen.
pub(crate) fn unlowered(op: &'static str) -> OpError {
    OpError::shape(
        op,
        "no CUDA kernel chosen: plans for a GPU are lowered first (graph::lower)",
    )
}
/// Warps a GEMV block, shared bytes a warp (two stages of 4096 + 32) — as in linear.cu.
const GEMV_WARPS: usize = 4;
const GEMV_SMEM: u32 = (GEMV_WARPS * 2 * (4096 + 32)) as u32;
/// GEMV blocks resident per SM (its `__launch_bounds__`); the grid never exceeds one wave.
const GEMV_BLOCKS_PER_SM: usize = 6;

/// How `iq4g_tile` (kernels/dequant.cuh) splits an IQ4_NL product of 256·`nch` inputs: `rt`
/// row slots a block (for SwiGLU half gate rows, half the same up rows), `kp` K parts of
/// whole 256-value chunks (at most `cw` each), one thread a (row, part): `threads` = rt·kp
/// rounded up to whole warps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RowsPlan {
    pub rt: usize,
    pub kp: usize,
    pub threads: usize,
    cw: usize,
}

impl RowsPlan {
    /// The split that spreads `slots` matrices of `n_out` rows best over `sms` multiprocessors.
    /// Cost model: the busiest multiprocessor's thread-chunks, ⌈blocks/sms⌉·threads·cw (the
    /// products are bandwidth- and issue-bound, so that is its time); ties go to more resident
    /// warps up to 12 a multiprocessor (latency hiding), then to two chunks a thread (the
    /// second lands while the first is decoded), then to smaller blocks. None when the K
    /// parts would not fit a block (more than 256 threads or ~110 KB of shared memory).
    pub(crate) fn choose(
        nch: usize,
        n_out: usize,
        slots: usize,
        swiglu: bool,
        sms: usize,
    ) -> Option<RowsPlan> {
        let sms = sms.max(1);
        let mut best: Option<((usize, usize, usize, usize), RowsPlan)> = None;
        for rt in [32usize, 16, 8, 4] {
            let outs = if swiglu { rt / 2 } else { rt };
            let blocks = n_out.div_ceil(outs) * slots;
            for kp in 1..=nch {
                let cw = nch.div_ceil(kp);
                let threads = (rt * kp).next_multiple_of(32);
                let plan = RowsPlan {
                    rt,
                    kp,
                    threads,
                    cw,
                };
                if threads > 256 || plan.smem_bytes(8) > 110 * 1024 {
                    continue;
                }
                let per_sm = blocks.div_ceil(sms);
                let cost = per_sm * threads * cw;
                let warps = (per_sm * threads / 32).min(12);
                let key = (cost, 12 - warps, cw.abs_diff(2), threads);
                if best.as_ref().is_none_or(|(k, _)| key < *k) {
                    best = Some((key, plan));
                }
            }
        }
        best.map(|(_, p)| p)
    }

    /// Dynamic shared memory for `nr` inputs at once: each thread's chunks (an odd number of
    /// 16-byte units, so a quarter-warp's reads hit distinct banks), then the K parts' sums.
    pub(crate) fn smem_bytes(&self, nr: usize) -> usize {
        let units = 9 * self.cw + usize::from(self.cw.is_multiple_of(2));
        self.threads * (units * 16 + nr * 4)
    }
}

/// (units a lane, rows a block, warps a block) of `gemv_bf16_dec_<JU>_<R>` for one token of a
/// BF16 weight with K = 8·u: short rows take four at a time; long ones are split over up to 8
/// warps until about 16 warps a multiprocessor are in flight (the small attention projections
/// are latency-bound), keeping at least 4 loads a lane. None past 32768 inputs.
fn bf16_dec_plan(k: usize, o: usize, sms: usize) -> Option<(usize, usize, usize)> {
    let u = k / 8;
    let per_lane = u.div_ceil(32);
    if per_lane <= 4 {
        return Some((per_lane.next_power_of_two(), 4, 1));
    }
    let mut s = 1;
    while u.div_ceil(32 * s) > 16 {
        s *= 2;
        if s > 8 {
            return None;
        }
    }
    while s < 8 && o * s < sms * 16 && u.div_ceil(64 * s) >= 4 {
        s *= 2;
    }
    Some((u.div_ceil(32 * s).next_power_of_two().max(4), 1, s))
}

/// cuBLAS's workspace for the BF16 prefill GEMM, inside the op's scratch (NVIDIA's
/// recommendation for Hopper). Handing it over keeps a captured graph free of allocations.
const CUBLAS_WORKSPACE: usize = 32 << 20;

/// Scratch of the prefill paths (n > 8, K % 32 == 0): x narrowed to bf16, then for BF16
/// weights cuBLAS's workspace, each at a 256-byte boundary (256 spare bytes align the start).
fn prefill_scratch(dtype: DType, n: usize, k: usize) -> usize {
    let ws = if dtype == DType::BF16 {
        CUBLAS_WORKSPACE
    } else {
        0
    };
    256 + (n * k * 2).next_multiple_of(256) + ws
}

/// How `linear_tq_<type>_<fit>` (kernels/linear.cu, 128 tokens × 128 rows a block) sits on
/// the multiprocessors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TqFit {
    /// Two blocks a multiprocessor (128 registers a thread).
    Two,
    /// One block a multiprocessor, no register cap.
    One,
}

impl TqFit {
    fn name(self) -> &'static str {
        match self {
            TqFit::Two => "x2",
            TqFit::One => "x1",
        }
    }

    /// Three x stages and two decoded weight tiles of 128 rows, 72 bf16 a row.
    const SMEM_BYTES: u32 = (5 * 128 * 72 * 2) as u32;

    /// One block a multiprocessor when the grid gives each at most one anyway (measured on
    /// the H200: the shared expert's 3584->1024 at 1024 tokens 71 µs against 111 µs for
    /// two-a-multiprocessor blocks), and for F32 weights, whose raw registers do not fit
    /// 128; two otherwise (IQ4_NL 3584->9216, 1024 tokens: 287 µs against 353 µs).
    fn choose(dtype: DType, n: usize, o: usize, sms: usize) -> TqFit {
        if dtype == DType::F32 || o.div_ceil(128) * n.div_ceil(128) <= sms {
            TqFit::One
        } else {
            TqFit::Two
        }
    }
}

enum LinearPath {
    /// IQ4_NL, n ≤ 8, K a multiple of 256: `gemv_iq4_nl_rows_<nr>` split as planned.
    Iq4Rows(usize, RowsPlan),
    /// BF16, n = 1: `gemv_bf16_dec_<JU>_<R>` with S warps a block.
    Bf16Dec(usize, usize, usize),
    Gemv(usize),
    /// BF16, n > 8: x narrowed to bf16, then one cuBLAS GEMM.
    Cublas,
    /// Other types, n > 8: x narrowed to bf16, then `linear_tq_<type>_<fit>`.
    Tiles(TqFit),
    Generic,
}

/// Which kernel a call takes within its family. GEMV: the IQ4_NL row GEMV when K is whole
/// 256-value chunks, the BF16 decode GEMV for one token, otherwise the GEMV when K is whole
/// units of the weight's 16-byte decode group (4 F32, 8 F16/BF16, 32 Q8_0/IQ4_NL, 256 Q6_K).
/// Tensor cores: when K % 32 == 0, cuBLAS for BF16 and the bf16 tiles for the other types.
/// Otherwise (and for views not 16-byte aligned) the element-wise fallback.
fn linear_path(
    kernel: LinearKernel,
    dtype: DType,
    (n, k, o): (usize, usize, usize),
    x_ptr: u64,
    w_ptr: u64,
    sms: usize,
) -> LinearPath {
    let unit = match dtype {
        DType::F32 => 4,
        DType::F16 | DType::BF16 => 8,
        DType::Q8_0 | DType::IQ4_NL => 32,
        DType::Q6_K => 256,
        DType::I32 => return LinearPath::Generic,
    };
    if k == 0 || !x_ptr.is_multiple_of(16) || !w_ptr.is_multiple_of(16) {
        return LinearPath::Generic;
    }
    let gemv = matches!(kernel, LinearKernel::Gemv { .. }) && n <= GEMV_ROWS_LIMIT;
    if gemv
        && dtype == DType::IQ4_NL
        && k.is_multiple_of(256)
        && let Some(plan) = RowsPlan::choose(k / 256, o, 1, false, sms)
    {
        return LinearPath::Iq4Rows(n.next_power_of_two(), plan);
    }
    if gemv
        && n == 1
        && dtype == DType::BF16
        && k.is_multiple_of(8)
        && let Some((ju, r, s)) = bf16_dec_plan(k, o, sms)
    {
        return LinearPath::Bf16Dec(ju, r, s);
    }
    if gemv && k.is_multiple_of(unit) {
        LinearPath::Gemv(n.next_power_of_two())
    } else if kernel == LinearKernel::TensorCore && k.is_multiple_of(32) {
        if dtype == DType::BF16 {
            LinearPath::Cublas
        } else {
            LinearPath::Tiles(TqFit::choose(dtype, n, o, sms))
        }
    } else {
        LinearPath::Generic
    }
}

/// Inputs: `x` F32 `[n, in]`, `W` `[out, in]` of F32/F16/BF16/Q8_0/Q6_K/IQ4_NL
/// (`in` whole blocks of W's type). Output F32 `[n, out]`, `y[t][o] = Σ_i W[o][i]·x[t][i]`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Linear {
    pub kernel: LinearKernel,
}

impl Linear {
    pub fn with(kernel: LinearKernel) -> Linear {
        Linear { kernel }
    }
}

impl Op for Linear {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        arity(op, inputs, 2)?;
        let (x, w) = (inputs[0], inputs[1]);
        want_dtype(op, "x", x, DType::F32)?;
        if x.shape.len() != 2 {
            return Err(OpError::shape(op, format!("x must be [n, in], found {x}")));
        }
        if w.shape.len() != 2 || w.dtype.ggml().is_none() {
            return Err(OpError::shape(
                op,
                format!("weight must be a stored [out, in] matrix, found {w}"),
            ));
        }
        if w.shape[1] != x.shape[1] {
            return Err(OpError::shape(
                op,
                format!(
                    "weight {w} takes {} inputs, x {x} has {}",
                    w.shape[1], x.shape[1]
                ),
            ));
        }
        if w.bytes().is_none() {
            return Err(OpError::shape(
                op,
                format!(
                    "weight {w}: rows of {} are not whole {} blocks",
                    w.shape[1], w.dtype
                ),
            ));
        }
        Ok(vec![TensorMeta::f32([x.shape[0], w.shape[0]])])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let (x, w) = (&inputs[0], &inputs[1]);
        let (n, n_in, n_out) = (x.meta.shape[0], x.meta.shape[1], w.meta.shape[0]);
        matmul(
            w.data,
            w.meta.dtype,
            n_out,
            n_in,
            x.f32()?,
            n,
            outputs[0].f32_mut()?,
        )
    }

    fn describe(&self) -> String {
        format!("linear{}", self.kernel.label())
    }

    /// [`LinearKernel::Gemv`]: f32 GEMV streaming the weight once (F32 tolerance, reordered
    /// sums); [`LinearKernel::TensorCore`]: x narrowed to bf16 into the scratch, then a cuBLAS GEMM (BF16 weights, cuBLAS's
    /// workspace in the scratch too) or bf16 tensor-core tiles decoding the weight in place
    /// (f32 accumulation either way: BF16 tolerance). Deterministic on every path.
    fn cuda(
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
            LinearPath::Gemv(nt) => {
                let blocks = o.div_ceil(GEMV_WARPS).min(sms * GEMV_BLOCKS_PER_SM);
                let name = format!("gemv_{}_{nt}", kernel_suffix(dtype));
                launch(&name, (blocks as u32, 1), 128, GEMV_SMEM, &[])
            }
            LinearPath::Cublas | LinearPath::Tiles(_) => {
                let need = prefill_scratch(dtype, n, k);
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
                let narrow = ctx.kernel("linear.cu", LINEAR_CU, "linear_x_bf16")?;
                // SAFETY: linear_x_bf16(x, xb, total) reads n·k f32 of x and writes n·k bf16
                // at `base`, inside the scratch checked above.
                unsafe {
                    ctx.device
                        .launch(&narrow)
                        .grid(as_i32(op, "narrowing blocks", total.div_ceil(2048))? as u32)
                        .block(256)
                        .arg(x.ptr)
                        .arg(base)
                        .arg(total as i64)
                        .enqueue()
                        .map_err(dev_err)?;
                }
                match path {
                    LinearPath::Tiles(fit) => {
                        let grid = (o.div_ceil(128), n.div_ceil(128));
                        if grid.1 > 65535 {
                            return Err(OpError::shape(
                                op,
                                format!("n = {n} is more than 65535 tiles of 128"),
                            ));
                        }
                        let pair = i32::from(o.is_multiple_of(2) && y.ptr.is_multiple_of(8));
                        let name = format!("linear_tq_{}_{}", kernel_suffix(dtype), fit.name());
                        let kern = ctx.kernel("linear.cu", LINEAR_CU, &name)?;
                        // SAFETY: the arguments follow linear_tq's C signature; W, y as for
                        // the other paths, xb the n·k bf16 written just above.
                        unsafe {
                            ctx.device
                                .launch(&kern)
                                .grid((grid.0 as u32, grid.1 as u32))
                                .block(256)
                                .shared_mem(TqFit::SMEM_BYTES)
                                .arg(w.ptr)
                                .arg(x.ptr)
                                .arg(y.ptr)
                                .arg(ni)
                                .arg(ki)
                                .arg(oi)
                                .arg(rb as i64)
                                .arg(base)
                                .arg(pair)
                                .enqueue()
                                .map_err(dev_err)
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

    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        match (inputs.first(), inputs.get(1)) {
            (Some(x), Some(w)) => match x.shape.as_slice() {
                &[n, k] if self.kernel == LinearKernel::TensorCore && k.is_multiple_of(32) => {
                    prefill_scratch(w.dtype, n, k)
                }
                _ => 0,
            },
            _ => 0,
        }
    }
}

/// Two [`Linear`] products of the same `x` (the attention's q_a and kv_a): `y1 = x·W1ᵀ`,
/// `y2 = x·W2ᵀ`. One decode token over BF16 weights takes one launch (the blocks split between
/// the two weights); anything else runs the two products as [`Linear`] would. Same bits.
///
/// Inputs: x F32 `[n, in]`, W1 `[out1, in]`, W2 `[out2, in]`. Outputs: F32 `[n, out1]`,
/// `[n, out2]`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LinearPair {
    pub kernel: LinearKernel,
}

impl LinearPair {
    /// The decode plan both products share, when one launch can run them.
    fn fused_plan(
        kernel: LinearKernel,
        x: &DeviceTensor<'_>,
        w1: &DeviceTensor<'_>,
        w2: &DeviceTensor<'_>,
        sms: usize,
    ) -> Option<(usize, usize, usize)> {
        let (n, k) = (x.meta.shape[0], x.meta.shape[1]);
        let (o1, o2) = (w1.meta.shape[0], w2.meta.shape[0]);
        let one = |w: &DeviceTensor<'_>, o| {
            matches!(
                linear_path(kernel, w.meta.dtype, (n, k, o), x.ptr, w.ptr, sms),
                LinearPath::Bf16Dec(..)
            )
        };
        if !(one(w1, o1) && one(w2, o2)) {
            return None;
        }
        bf16_dec_plan(k, o1 + o2, sms)
    }
}

impl Op for LinearPair {
    fn name(&self) -> &'static str {
        "linear_pair"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        arity(self.name(), inputs, 3)?;
        let mut outs = Linear::default().infer(&inputs[..2])?;
        outs.extend(Linear::default().infer(&[inputs[0], inputs[2]])?);
        Ok(outs)
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let (first, second) = outputs.split_at_mut(1);
        Linear::default().cpu(&inputs[..2], first)?;
        Linear::default().cpu(&[inputs[0], inputs[2]], second)
    }

    fn describe(&self) -> String {
        format!("linear_pair{}", self.kernel.label())
    }

    /// The two products run one after the other, so they share one scratch.
    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        if inputs.len() != 3 {
            return 0;
        }
        let one = Linear::with(self.kernel);
        one.cuda_scratch_bytes(&inputs[..2])
            .max(one.cuda_scratch_bytes(&[inputs[0], inputs[2]]))
    }

    fn cuda(
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

/// `linear(rms_norm(x)·norm_w, W)` (q_b over q_a's RMSNorm): the normalised x has no other
/// reader, so one decode token over a BF16 weight normalises x inside the GEMV (every block
/// sums x's squares itself; x is short) and the norm has no launch. Otherwise the norm and
/// the product run as [`RmsNorm`](crate::norm::RmsNorm) and [`Linear`] would.
///
/// Inputs: x F32 `[n, in]`, norm_w F32 `[in]`, W `[out, in]`. Output: F32 `[n, out]`.
#[derive(Debug, Clone, PartialEq)]
pub struct NormLinear {
    pub eps: f32,
    pub kernel: LinearKernel,
}

impl NormLinear {
    /// Scratch of the unfused path: the normalised x, then what [`Linear`] needs.
    fn split_scratch(&self, inputs: &[&TensorMeta]) -> (usize, usize) {
        let normed = (inputs[0].numel() * 4).next_multiple_of(256);
        (
            normed,
            normed + Linear::with(self.kernel).cuda_scratch_bytes(&[inputs[0], inputs[2]]),
        )
    }
}

impl Op for NormLinear {
    fn name(&self) -> &'static str {
        "norm_linear"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        arity(op, inputs, 3)?;
        let outs = Linear::default().infer(&[inputs[0], inputs[2]])?;
        let k = inputs[0].shape[1];
        want_dtype(op, "norm weight", inputs[1], DType::F32)?;
        if inputs[1].shape != [k] {
            return Err(OpError::shape(
                op,
                format!("norm weight must be F32[{k}], found {}", inputs[1]),
            ));
        }
        Ok(outs)
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let meta = inputs[0].meta.clone();
        let mut normed = crate::AlignedBuf::zeroed(meta.numel() * 4);
        crate::norm::rms_norm_rows(
            inputs[0].f32()?,
            Some(inputs[1].f32()?),
            meta.shape[1],
            self.eps,
            normed.f32s_mut(),
        );
        Linear::default().cpu(
            &[HostTensor::new(&meta, normed.bytes()), inputs[2]],
            outputs,
        )
    }

    fn describe(&self) -> String {
        format!(
            "rms_norm(eps={:e}) then linear{}",
            self.eps,
            self.kernel.label()
        )
    }

    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        if self.infer(inputs).is_err() {
            return 0;
        }
        self.split_scratch(inputs).1
    }

    fn cuda(
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

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;
    use crate::elementwise::testkit::*;
    use loader::GgmlType;

    /// Weight bytes of `rows × cols` values for `dtype`: float types from random
    /// values, block types from random bytes with a finite random f16 scale.
    fn random_weight(r: &mut Lcg, dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
        let n = rows * cols;
        match dtype {
            DType::F32 => r
                .vec(n, -1.0, 1.0)
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            DType::F16 => r
                .vec(n, -1.0, 1.0)
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                .collect(),
            DType::BF16 => r
                .vec(n, -1.0, 1.0)
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
            DType::Q8_0 | DType::Q6_K | DType::IQ4_NL => {
                let ty = dtype.ggml().unwrap();
                let mut bytes: Vec<u8> = (0..ty.row_bytes(n).unwrap())
                    .map(|_| r.next_u32() as u8)
                    .collect();
                // Where each block keeps its f16 scale.
                let at = if ty == GgmlType::Q6_K { 208 } else { 0 };
                for b in bytes.chunks_exact_mut(ty.block_bytes()) {
                    let d = f16::from_f32(r.uniform(-0.02, 0.02));
                    b[at..at + 2].copy_from_slice(&d.to_le_bytes());
                }
                bytes
            }
            DType::I32 => unreachable!("not a weight type"),
        }
    }

    #[test]
    fn linear_matches_the_f64_product_of_the_dequantized_weight_for_every_weight_type() {
        let mut r = Lcg(11);
        let types = [
            DType::F32,
            DType::F16,
            DType::BF16,
            DType::Q8_0,
            DType::Q6_K,
            DType::IQ4_NL,
        ];
        for dtype in types {
            let (n, n_in, n_out) = (3, 512, 37);
            let wb = random_weight(&mut r, dtype, n_out, n_in);
            let mut wf = vec![0f32; n_out * n_in];
            loader::quant::dequantize(dtype.ggml().unwrap(), &wb, &mut wf).unwrap();
            let x = r.vec(n * n_in, -4.0, 4.0);
            let w = Owned::from_bytes(TensorMeta::new([n_out, n_in], dtype), &wb);
            let y = run(&Linear::default(), &[&Owned::f32([n, n_in], &x), &w]).unwrap()[0].to_f32();
            // f32 dot of n_in terms: |error| ≤ γ_n · Σ|w·x| with γ_n = n·u/(1 − n·u).
            let u = f32::EPSILON as f64 / 2.0;
            let gamma = n_in as f64 * u / (1.0 - n_in as f64 * u);
            for t in 0..n {
                for o in 0..n_out {
                    let terms = (0..n_in).map(|i| wf[o * n_in + i] as f64 * x[t * n_in + i] as f64);
                    let want: f64 = terms.clone().sum();
                    let abs: f64 = terms.map(f64::abs).sum();
                    let got = y[t * n_out + o] as f64;
                    assert!(
                        (got - want).abs() <= gamma * abs + 1e-30,
                        "{dtype} y[{t}][{o}] = {got}, f64 {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn linear_refuses_a_mismatched_input_width_a_partial_block_and_a_non_f32_input() {
        let e = infer(
            &Linear::default(),
            &[
                TensorMeta::f32([2, 64]),
                TensorMeta::new([8, 32], DType::BF16),
            ],
        )
        .unwrap_err();
        assert!(matches!(e, OpError::Shape { op: "linear", .. }), "{e}");
        let e = infer(
            &Linear::default(),
            &[
                TensorMeta::f32([2, 48]),
                TensorMeta::new([8, 48], DType::Q8_0),
            ],
        )
        .unwrap_err();
        assert!(
            matches!(e, OpError::Shape { .. }) && e.to_string().contains("Q8_0"),
            "{e}"
        );
        let e = infer(
            &Linear::default(),
            &[
                TensorMeta::new([2, 32], DType::BF16),
                TensorMeta::f32([8, 32]),
            ],
        )
        .unwrap_err();
        assert!(matches!(e, OpError::Shape { .. }), "{e}");
        let e = infer(
            &Linear::default(),
            &[TensorMeta::f32([2, 32]), TensorMeta::i32([8, 32])],
        )
        .unwrap_err();
        assert!(matches!(e, OpError::Shape { .. }), "{e}");
        assert_eq!(
            infer(
                &Linear::default(),
                &[
                    TensorMeta::f32([2, 256]),
                    TensorMeta::new([8, 256], DType::Q6_K)
                ]
            ),
            Ok(vec![TensorMeta::f32([2, 8])])
        );
    }

    #[test]
    fn rows_plans_fit_one_block_and_give_every_chunk_to_one_k_part() {
        for nch in 1..=96 {
            for n_out in [1, 7, 100, 1024, 3584, 9216] {
                for (slots, swiglu) in [(1, false), (4, false), (4, true), (32, true)] {
                    let p = RowsPlan::choose(nch, n_out, slots, swiglu, 132)
                        .unwrap_or_else(|| panic!("no plan for {nch} chunks, {n_out} rows"));
                    let at = format!("{nch} chunks, {n_out} rows, {slots} slots: {p:?}");
                    assert!(p.threads <= 256 && p.threads.is_multiple_of(32), "{at}");
                    assert!(
                        p.rt * p.kp <= p.threads && p.threads < p.rt * p.kp + 32,
                        "{at}"
                    );
                    assert!(p.kp <= nch && p.cw == nch.div_ceil(p.kp), "{at}");
                    // The kernel gives part q the chunks [q·nch/kp, (q+1)·nch/kp).
                    let covered: usize = (0..p.kp)
                        .map(|q| (q + 1) * nch / p.kp - q * nch / p.kp)
                        .inspect(|&c| assert!(c <= p.cw, "{at}"))
                        .sum();
                    assert_eq!(covered, nch, "{at}");
                    assert!(p.smem_bytes(8) <= 110 * 1024, "{at}");
                    assert!(!swiglu || p.rt.is_multiple_of(2), "{at}");
                }
            }
        }
    }

    #[test]
    fn the_decode_expert_shapes_keep_every_multiprocessor_within_five_percent_of_an_even_share() {
        // (chunks, rows per expert, experts, SwiGLU): Xing4.0's gate+up and down at top-4.
        for (nch, n_out, slots, swiglu) in [(14, 1024, 4, true), (4, 3584, 4, false)] {
            let p = RowsPlan::choose(nch, n_out, slots, swiglu, 132).unwrap();
            let outs = if swiglu { p.rt / 2 } else { p.rt };
            let blocks = n_out.div_ceil(outs) * slots;
            let busiest = blocks.div_ceil(132) * p.threads * p.cw;
            let rows = n_out * slots * if swiglu { 2 } else { 1 };
            let even = (rows * nch) as f64 / 132.0;
            assert!(busiest as f64 <= 1.05 * even, "{p:?}: {busiest} vs {even}");
        }
    }

    #[test]
    fn bf16_decode_plans_cover_the_row_with_an_instantiated_kernel() {
        for units in 1..=4096 {
            for o in [1, 576, 6144] {
                let (ju, r, s) = bf16_dec_plan(8 * units, o, 132).unwrap();
                assert!(32 * s * ju >= units, "{units} units: {ju} x {s} warps");
                assert!(s.is_power_of_two() && s <= 8, "{units} units: {s} warps");
                assert!(
                    [(16, 1), (8, 1), (4, 1), (4, 4), (2, 4), (1, 4)].contains(&(ju, r)),
                    "{units} units: no gemv_bf16_dec_{ju}_{r}"
                );
            }
        }
        assert_eq!(bf16_dec_plan(8 * 4097, 10, 132), None);
    }

    #[test]
    fn prefill_tiles_run_alone_on_a_multiprocessor_only_when_the_grid_leaves_them_alone() {
        // (n, out) at 132 multiprocessors: the shared expert's 1024 rows make 64 and 128
        // blocks at 1024 and 2048 tokens; its down projection and the dense FFN make 224+.
        let fit = |n, o| TqFit::choose(DType::IQ4_NL, n, o, 132);
        assert_eq!(fit(1024, 1024), TqFit::One);
        assert_eq!(fit(2048, 1024), TqFit::One);
        for (n, o) in [(1024, 3584), (2048, 3584), (1024, 9216), (2048, 9216)] {
            assert_eq!(fit(n, o), TqFit::Two, "n={n} out={o}");
        }
        // gpu_linear.rs's test of two-a-multiprocessor blocks relies on this grid taking them.
        assert_eq!(fit(150, 8500), TqFit::Two);
        assert_eq!(fit(256, 66 * 128), TqFit::One);
        assert_eq!(TqFit::choose(DType::F32, 2048, 9216, 132), TqFit::One);
    }

    #[test]
    fn prefill_scratch_holds_x_as_bf16_and_for_bf16_weights_the_cublas_workspace() {
        let metas = |dtype| {
            [
                TensorMeta::f32([100, 512]),
                TensorMeta::new([7, 512], dtype),
            ]
        };
        let [x, w] = metas(DType::IQ4_NL);
        let tc = Linear::with(LinearKernel::TensorCore);
        assert_eq!(tc.cuda_scratch_bytes(&[&x, &w]), 256 + 100 * 512 * 2);
        let [x, w] = metas(DType::BF16);
        assert_eq!(
            tc.cuda_scratch_bytes(&[&x, &w]),
            256 + 100 * 512 * 2 + CUBLAS_WORKSPACE
        );
        // The GEMV and widths that take the fallback need none.
        let gemv = Linear::with(LinearKernel::Gemv {
            weights_first: true,
        });
        let w = TensorMeta::new([7, 512], DType::BF16);
        assert_eq!(
            gemv.cuda_scratch_bytes(&[&TensorMeta::f32([8, 512]), &w]),
            0
        );
        let w = TensorMeta::new([7, 48], DType::F32);
        assert_eq!(tc.cuda_scratch_bytes(&[&TensorMeta::f32([100, 48]), &w]), 0);
    }

    #[test]
    fn a_weight_buffer_shorter_than_its_shape_is_an_error_not_a_panic() {
        let x = Owned::f32([1, 32], &[1.0; 32]);
        let w = Owned::from_bytes(TensorMeta::new([2, 32], DType::IQ4_NL), &[0u8; 18]);
        assert!(run(&Linear::default(), &[&x, &w]).is_err());
    }
}
