//! Routed experts (spec §3.7) with reproducible sums (seed §4).
//!
//! `Router` picks each token's experts, `RoutePlan` sorts the `n·top_k` routes by expert into
//! a static-size CSR table, `ExpertSwiGlu` and `ExpertDown` run every route of an expert
//! together (its weight rows are read once per chunk) and write one row per route, and
//! `TopKSum` adds each token's routes in slot order. No output element has two writers and
//! no sum depends on scheduling, so a chunk gives the same bits on every run and thread count.

use rayon::prelude::*;

use crate::cpu::{dot, matmul};
use crate::elementwise::{SwiGlu, swiglu};
use crate::gpu::{DeviceTensor, GpuCtx, Scratch, blocks_for, dev_err};
use crate::linear::{Linear, LinearKernel, RowsPlan, unlowered};
use crate::mla::{aligned16, as_i32, expect, expect_inputs, expect_weight, nonzero, weight_bytes};
use crate::moe_prefill::{TcKernel, launch_expert_gemm_tc_with};
use crate::op::{check_device, check_host};
use crate::tensor::{AlignedBuf, DType, HostTensor, HostTensorMut, TensorMeta};
use crate::{Op, OpError};

pub(crate) const MOE_CU: &str = concat!(
    include_str!("../kernels/dequant.cuh"),
    include_str!("../kernels/moe.cu")
);

/// Input values one `router_logits` block column sums (`RL_SLICE` there).
const ROUTER_SLICE: usize = 128;
/// The tiled router GEMM's slice of D (`router_logits_tiled`): a multiple of 128 (so the
/// partials fit the scratch sized for ROUTER_SLICE) that gives a 1024-token chunk ~200 blocks.
const ROUTER_TILED_SLICE: usize = 256;
/// The most routes the expert GEMV kernels take in one launch.
pub const GEMV_ROUTES_LIMIT: usize = 32;
/// Most routes a GEMV block sums at once (the largest `expert_rows_iq4_<NR>`).
const GEMV_MAXR: usize = 8;
/// Shared memory a block may use on the target (227 KiB opt-in on an H200).
const SMEM_LIMIT: usize = 227 * 1024;

/// llama.cpp's floor for the sum the top-k weights are normalised by: 6.103515625e-5 = 2⁻¹⁴,
/// the smallest normal f16.
pub const NORM_GUARD: f32 = 1.0 / 16384.0;

/// `σ(z)` in f32, as ggml's sigmoid.
#[inline]
fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// `silu(z) = z·σ(z)` in f32, as ggml's `ggml_silu_f32`.
#[inline]
fn silu(z: f32) -> f32 {
    z / (1.0 + (-z).exp())
}

fn too_big(op: &'static str, what: &str, v: usize) -> Result<(), OpError> {
    if v > i32::MAX as usize {
        return Err(OpError::shape(
            op,
            format!("{what} {v} does not fit an I32 index"),
        ));
    }
    Ok(())
}

// ---- Router --------------------------------------------------------------------------

/// How router logits become expert scores: the loader's reading of `expert_gating_func`.
pub use loader::hparams::ExpertGating as Gating;

/// Top-k expert selection (spec §3.7, llama.cpp `build_moe_ffn`).
///
/// Scores `p = gating(W·z)` in f32; the `top_k` largest `p + bias` are chosen in descending
/// order (ties: lower expert id first); the weights are the *unbiased* `p` of those experts,
/// divided by `max(Σ, 6.103515625e-5)` when `norm_topk`, then multiplied by `scale`.
///
/// Inputs: z F32 `[n, D]`, W F32 `[n_expert, D]`, optional bias F32 `[n_expert]`.
/// Outputs: ids I32 `[n, top_k]`, weights F32 `[n, top_k]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Router {
    pub n_expert: usize,
    pub top_k: usize,
    pub gating: Gating,
    pub norm_topk: bool,
    pub scale: f32,
    pub kernel: RouterKernel,
}

/// How the router's logits are computed on the GPU (chosen by the graph's lowering).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum RouterKernel {
    #[default]
    Unlowered,
    /// Split-K over 128-input slices (8 experts a block): fills the chip for a few tokens.
    Slices,
    /// A tiled f32 GEMM, 64 tokens × 64 experts a block (prefill chunks).
    Tiled,
}

impl RouterKernel {
    fn label(self) -> &'static str {
        match self {
            RouterKernel::Unlowered => "",
            RouterKernel::Slices => " [split-k]",
            RouterKernel::Tiled => " [tiled]",
        }
    }
}

/// How `topk_sum` finds each token's routes on the GPU (chosen by the graph's lowering).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TopKKernel {
    #[default]
    Unlowered,
    /// Blocks split over tokens and columns, each scanning the route table (few tokens).
    Scan,
    /// A slot → route inverse table first (one scatter), then a block a token (many tokens).
    InverseTable,
}

impl TopKKernel {
    fn label(self) -> &'static str {
        match self {
            TopKKernel::Unlowered => "",
            TopKKernel::Scan => " [scan]",
            TopKKernel::InverseTable => " [inverse table]",
        }
    }
}

/// How the routed expert products run on the GPU (chosen by the graph's lowering).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ExpertKernel {
    #[default]
    Unlowered,
    /// IQ4_NL row GEMVs reading each touched expert's rows once for all of its routes (at
    /// most [`GEMV_ROUTES_LIMIT`] routes).
    Gemv,
    /// The grouped GEMM on the tensor cores, on the given kernel.
    Grouped(TcKernel),
}

impl ExpertKernel {
    fn label(self) -> &'static str {
        match self {
            ExpertKernel::Unlowered => "",
            ExpertKernel::Gemv => " [gemv]",
            ExpertKernel::Grouped(TcKernel::MmaSync) => " [grouped mma.sync]",
            ExpertKernel::Grouped(TcKernel::Wgmma) => " [grouped wgmma]",
        }
    }
}

impl Router {
    /// Slice-level form: `z` is `n × d`, `w` is `n_expert × d`, `ids`/`weights` are `n × top_k`.
    pub fn compute(
        &self,
        z: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        d: usize,
        ids: &mut [i32],
        weights: &mut [f32],
    ) -> Result<(), OpError> {
        let (ne, k) = (self.n_expert, self.top_k);
        if k == 0 || k > ne || d == 0 {
            return Err(OpError::Type(format!(
                "router: top_k {k} must be in 1..={ne} and D {d} > 0"
            )));
        }
        let n = ids.len() / k;
        if z.len() < n * d
            || w.len() < ne * d
            || weights.len() < n * k
            || bias.is_some_and(|b| b.len() < ne)
        {
            return Err(OpError::Type(format!(
                "router buffers too small for {n} tokens: z {}, W {}, weights {}",
                z.len(),
                w.len(),
                weights.len()
            )));
        }
        ids[..n * k]
            .par_chunks_mut(k)
            .zip(weights[..n * k].par_chunks_mut(k))
            .zip(z[..n * d].par_chunks(d))
            .for_each(|((ids, wts), zt)| {
                let mut p: Vec<f32> = w[..ne * d].chunks_exact(d).map(|r| dot(r, zt)).collect();
                match self.gating {
                    Gating::Sigmoid => p.iter_mut().for_each(|x| *x = sigmoid(*x)),
                    Gating::Softmax => {
                        let max = p.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                        let mut sum = 0f32;
                        for x in p.iter_mut() {
                            *x = (*x - max).exp();
                            sum += *x;
                        }
                        let inv = 1.0 / sum;
                        p.iter_mut().for_each(|x| *x *= inv);
                    }
                }
                let sel: Vec<f32> = match bias {
                    Some(b) => p.iter().zip(b).map(|(&x, &b)| x + b).collect(),
                    None => p.clone(),
                };
                let mut order: Vec<usize> = (0..ne).collect();
                order.sort_by(|&a, &b| sel[b].total_cmp(&sel[a]).then(a.cmp(&b)));
                for (j, &e) in order[..k].iter().enumerate() {
                    ids[j] = e as i32;
                    wts[j] = p[e];
                }
                if self.norm_topk {
                    let sum = wts.iter().fold(0f32, |s, &x| s + x).max(NORM_GUARD);
                    wts.iter_mut().for_each(|x| *x /= sum);
                }
                wts.iter_mut().for_each(|x| *x *= self.scale);
            });
        Ok(())
    }
}

impl Op for Router {
    fn name(&self) -> &'static str {
        "router"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        nonzero(op, &[("n_expert", self.n_expert), ("top_k", self.top_k)])?;
        if self.top_k > self.n_expert {
            return Err(OpError::shape(
                op,
                format!("top_k {} exceeds n_expert {}", self.top_k, self.n_expert),
            ));
        }
        if !(2..=3).contains(&inputs.len()) {
            return Err(OpError::shape(
                op,
                format!("takes 2 or 3 inputs (z, W, bias), got {}", inputs.len()),
            ));
        }
        let z = inputs[0];
        if z.dtype != DType::F32 || z.shape.len() != 2 || z.shape[1] == 0 {
            return Err(OpError::shape(
                op,
                format!("z must be F32[n, D] with D > 0, found {z}"),
            ));
        }
        let (n, d) = (z.shape[0], z.shape[1]);
        expect(op, "W", inputs[1], DType::F32, &[self.n_expert, d])?;
        if let Some(b) = inputs.get(2) {
            expect(op, "bias", b, DType::F32, &[self.n_expert])?;
        }
        Ok(vec![
            TensorMeta::i32([n, self.top_k]),
            TensorMeta::f32([n, self.top_k]),
        ])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let d = inputs[0].meta.inner();
        let z = inputs[0].f32()?;
        let w = inputs[1].f32()?;
        let bias = inputs.get(2).map(|b| b.f32()).transpose()?;
        let (ids, wts) = outputs.split_at_mut(1);
        self.compute(z, w, bias, d, ids[0].i32_mut()?, wts[0].f32_mut()?)
    }

    fn describe(&self) -> String {
        format!(
            "router n_expert={} top_k={} gating={} norm_topk={} scale={:?}{}",
            self.n_expert,
            self.top_k,
            self.gating,
            self.norm_topk,
            self.scale,
            self.kernel.label()
        )
    }

    /// Two launches: `router_logits` spreads the f32 product over (8 experts × 128 inputs)
    /// blocks into per-slice partials (scratch), `router_select` (a warp a token) sums them
    /// in slice order and selects. (A one-launch variant, a cluster of 8 blocks meeting in
    /// distributed shared memory, measured 7.3 µs against these two's 6.1 µs at one token:
    /// eight multiprocessors cannot pull the 0.9 MB of weights as fast as all of them.)
    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let (n, d) = (inputs[0].meta.shape[0], inputs[0].meta.shape[1]);
        let ne = self.n_expert;
        if n == 0 {
            return Ok(());
        }
        if !d.is_multiple_of(4) {
            return Err(OpError::shape(
                op,
                format!("the CUDA kernel needs D to be a multiple of 4, found {d}"),
            ));
        }
        aligned16(op, "z", &inputs[0])?;
        aligned16(op, "W", &inputs[1])?;
        let select_smem = 8 * 3 * ne * 4;
        if select_smem > SMEM_LIMIT {
            return Err(OpError::shape(
                op,
                format!("{ne} experts exceed the select kernel's shared memory"),
            ));
        }
        let need = router_scratch(n, d, ne);
        scratch.require(op, need)?;
        let tiled = match self.kernel {
            RouterKernel::Unlowered => return Err(unlowered(op)),
            RouterKernel::Slices => false,
            RouterKernel::Tiled => true,
        };
        let slices = if tiled {
            let slices = d.div_ceil(ROUTER_TILED_SLICE);
            let token_tiles = n.div_ceil(64);
            if token_tiles > 65535 || slices > 65535 {
                return Err(OpError::shape(
                    op,
                    format!("{n} tokens of {d} exceed the grid"),
                ));
            }
            let logits = ctx.kernel("moe.cu", MOE_CU, "router_logits_tiled")?;
            // SAFETY: argument list matches router_logits_tiled; it writes n × slices × E
            // partials, slices ≤ ⌈D/128⌉ (the scratch checked above).
            unsafe {
                ctx.device
                    .launch(&logits)
                    .grid((blocks_for(ne, 64), slices as u32, token_tiles as u32))
                    .block(256)
                    .arg(inputs[0].ptr)
                    .arg(inputs[1].ptr)
                    .arg(scratch.ptr)
                    .arg(as_i32(op, "tokens", n)?)
                    .arg(as_i32(op, "D", d)?)
                    .arg(as_i32(op, "n_expert", ne)?)
                    .arg(slices as i32)
                    .arg(ROUTER_TILED_SLICE as i32)
                    .enqueue()
                    .map_err(dev_err)?;
            }
            slices
        } else {
            let slices = d.div_ceil(ROUTER_SLICE);
            let tok_tile = n.div_ceil(n.div_ceil(64).min(65535));
            let logits = ctx.kernel("moe.cu", MOE_CU, "router_logits")?;
            // SAFETY: argument list matches router_logits; it writes n × slices × E partials.
            unsafe {
                ctx.device
                    .launch(&logits)
                    .grid((
                        blocks_for(ne, 8),
                        as_i32(op, "slices", slices)? as u32,
                        n.div_ceil(tok_tile) as u32,
                    ))
                    .block(256)
                    .arg(inputs[0].ptr)
                    .arg(inputs[1].ptr)
                    .arg(scratch.ptr)
                    .arg(as_i32(op, "tokens", n)?)
                    .arg(as_i32(op, "D", d)?)
                    .arg(as_i32(op, "n_expert", ne)?)
                    .arg(slices as i32)
                    .arg(as_i32(op, "token tile", tok_tile)?)
                    .enqueue()
                    .map_err(dev_err)?;
            }
            slices
        };
        let select = ctx.kernel("moe.cu", MOE_CU, "router_select")?;
        let bias = inputs.get(2).map_or(0, |b| b.ptr);
        // SAFETY: argument list matches router_select; it reads the partials written above.
        unsafe {
            ctx.device
                .launch(&select)
                .grid(blocks_for(n, 8))
                .block(256)
                .shared_mem(select_smem as u32)
                .arg(scratch.ptr)
                .arg(bias)
                .arg(outputs[0].ptr)
                .arg(outputs[1].ptr)
                .arg(n as i32)
                .arg(ne as i32)
                .arg(slices as i32)
                .arg(self.top_k as i32)
                .arg(i32::from(self.gating == Gating::Softmax))
                .arg(i32::from(self.norm_topk))
                .arg(self.scale)
                .arg(NORM_GUARD)
                .enqueue()
                .map_err(dev_err)
        }
    }

    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        match inputs.first().map(|z| z.shape.as_slice()) {
            Some(&[n, d]) => router_scratch(n, d, self.n_expert),
            _ => 0,
        }
    }
}

/// The router's per-slice logit partials: `[n, ⌈D/128⌉, n_expert]` f32.
fn router_scratch(n: usize, d: usize, n_expert: usize) -> usize {
    n * d.div_ceil(ROUTER_SLICE) * n_expert * 4
}

// ---- RoutePlan -----------------------------------------------------------------------

/// Sorts the routes by expert (ties in slot order, slot = `t·top_k + j`) into a CSR table.
///
/// Input: ids I32 `[n, top_k]`. Outputs: offsets I32 `[n_expert+1]` (expert `e`'s routes are
/// `offsets[e]..offsets[e+1]`), route_token I32 `[n·top_k]`, route_slot I32 `[n·top_k]`.
/// Every size is static; an id outside `[0, n_expert)` is an `OpError::Data`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoutePlan {
    pub n_expert: usize,
    pub top_k: usize,
}

impl RoutePlan {
    /// Slice-level form: a stable counting sort of the slots by expert.
    pub fn compute(
        &self,
        ids: &[i32],
        offsets: &mut [i32],
        route_token: &mut [i32],
        route_slot: &mut [i32],
    ) -> Result<(), OpError> {
        let (ne, k) = (self.n_expert, self.top_k);
        let r = ids.len();
        if k == 0
            || offsets.len() < ne + 1
            || route_token.len() < r
            || route_slot.len() < r
            || r > i32::MAX as usize
        {
            return Err(OpError::Type(format!(
                "route_plan buffers do not fit {r} routes of {ne} experts (top_k {k})"
            )));
        }
        let mut count = vec![0usize; ne + 1];
        for (s, &e) in ids.iter().enumerate() {
            if e < 0 || e as usize >= ne {
                return Err(OpError::data(
                    "route_plan",
                    format!(
                        "expert id {e} of token {} slot {} is outside [0, {ne})",
                        s / k,
                        s % k
                    ),
                ));
            }
            count[e as usize + 1] += 1;
        }
        for e in 0..ne {
            count[e + 1] += count[e];
        }
        for (o, &c) in offsets.iter_mut().zip(&count) {
            *o = c as i32;
        }
        let mut cursor = count;
        for (s, &e) in ids.iter().enumerate() {
            let at = &mut cursor[e as usize];
            route_token[*at] = (s / k) as i32;
            route_slot[*at] = s as i32;
            *at += 1;
        }
        Ok(())
    }
}

impl Op for RoutePlan {
    fn name(&self) -> &'static str {
        "route_plan"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        nonzero(op, &[("n_expert", self.n_expert), ("top_k", self.top_k)])?;
        expect_inputs(op, inputs, 1)?;
        let n = inputs[0].shape.first().copied().unwrap_or(0);
        expect(op, "ids", inputs[0], DType::I32, &[n, self.top_k])?;
        let r = n * self.top_k;
        too_big(op, "route count", r)?;
        too_big(op, "n_expert", self.n_expert)?;
        Ok(vec![
            TensorMeta::i32([self.n_expert + 1]),
            TensorMeta::i32([r]),
            TensorMeta::i32([r]),
        ])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let ids = inputs[0].i32()?;
        let [off, tok, slot] = outputs else {
            return Err(OpError::Type("route_plan writes 3 outputs".into()));
        };
        self.compute(ids, off.i32_mut()?, tok.i32_mut()?, slot.i32_mut()?)
    }

    fn describe(&self) -> String {
        format!("route_plan n_expert={} top_k={}", self.n_expert, self.top_k)
    }

    /// One block (up to 1024 threads) sorts on the device (no read-back, so it can be captured).
    /// An id outside `[0, n_expert)` is skipped and the rows it leaves are marked -1; the
    /// engine refuses such ids before they reach the device.
    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let r = inputs[0].meta.numel();
        let ne = self.n_expert;
        // As many warps as the routes need (a decode step's 4 routes: one warp), up to 32.
        let threads = r.div_ceil(32).clamp(1, 32) * 32;
        let smem = (2 + threads / 32) * ne * 4;
        if smem > SMEM_LIMIT {
            return Err(OpError::shape(
                op,
                format!("{ne} experts exceed the plan kernel's shared memory"),
            ));
        }
        let kern = ctx.kernel("moe.cu", MOE_CU, "route_plan")?;
        // SAFETY: argument list matches route_plan; it writes E+1 offsets and R rows.
        unsafe {
            ctx.device
                .launch(&kern)
                .grid(1)
                .block(threads as u32)
                .shared_mem(smem as u32)
                .arg(inputs[0].ptr)
                .arg(outputs[0].ptr)
                .arg(outputs[1].ptr)
                .arg(outputs[2].ptr)
                .arg(as_i32(op, "routes", r)?)
                .arg(as_i32(op, "n_expert", ne)?)
                .arg(as_i32(op, "top_k", self.top_k)?)
                .enqueue()
                .map_err(dev_err)
        }
    }
}

// ---- grouped experts -----------------------------------------------------------------

/// A stacked `[n_expert, n_out, n_in]` expert weight as stored (expert `e` outermost).
#[derive(Clone, Copy, Debug)]
pub struct ExpertStack<'a> {
    pub data: &'a [u8],
    pub dtype: DType,
    pub n_in: usize,
}

impl<'a> ExpertStack<'a> {
    /// The stack a weight view holds, rows of `n_in` values.
    pub fn of(t: &HostTensor<'a>, n_in: usize) -> Result<Self, OpError> {
        Ok(ExpertStack {
            data: weight_bytes(t)?,
            dtype: t.meta.dtype,
            n_in,
        })
    }

    /// Expert `e`'s `n_out` rows.
    fn expert(&self, e: usize, n_out: usize) -> Result<&'a [u8], OpError> {
        let row = self.dtype.row_bytes(self.n_in).ok_or_else(|| {
            OpError::Type(format!(
                "{} rows of {} are not whole blocks",
                self.dtype, self.n_in
            ))
        })?;
        let size = row * n_out;
        self.data.get(e * size..(e + 1) * size).ok_or_else(|| {
            OpError::Type(format!(
                "expert {e} lies past the {} bytes of its stacked weight",
                self.data.len()
            ))
        })
    }
}

/// Checks a CSR table against `n_expert` and `r` routes and returns it as `usize` bounds.
fn csr(
    op: &'static str,
    offsets: &[i32],
    n_expert: usize,
    r: usize,
) -> Result<Vec<usize>, OpError> {
    if offsets.len() < n_expert + 1 {
        return Err(OpError::Type(format!(
            "{op}: offsets has {} entries, {} needed",
            offsets.len(),
            n_expert + 1
        )));
    }
    let off = &offsets[..n_expert + 1];
    let bad =
        off[0] != 0 || off[n_expert] as i64 != r as i64 || off.windows(2).any(|p| p[1] < p[0]);
    if bad {
        return Err(OpError::data(
            op,
            format!("offsets must rise from 0 to the route count {r}, found {off:?}"),
        ));
    }
    Ok(off.iter().map(|&o| o as usize).collect())
}

/// Splits `buf` into each non-empty expert's rows (`width` values a route).
fn per_expert<'b>(
    buf: &'b mut [f32],
    off: &[usize],
    width: usize,
) -> Vec<(usize, std::ops::Range<usize>, &'b mut [f32])> {
    let mut rest = buf;
    let mut parts = Vec::new();
    for e in 0..off.len() - 1 {
        let (a, b) = std::mem::take(&mut rest).split_at_mut((off[e + 1] - off[e]) * width);
        rest = b;
        if !a.is_empty() {
            parts.push((e, off[e]..off[e + 1], a));
        }
    }
    parts
}

/// `act[r] = silu(Wg_e·z[tok_r]) ⊙ (Wu_e·z[tok_r])` for every route `r` of every expert `e`,
/// in sorted route order, kept f32 (this product is what overflows f16; seed §2).
///
/// Inputs: z F32 `[n, D]`, gate_exps and up_exps `[n_expert, n_ff, D]` (any weight type),
/// offsets I32 `[n_expert+1]`, route_token I32 `[R]`. Output: act F32 `[R, n_ff]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertSwiGlu {
    pub n_expert: usize,
    pub n_ff: usize,
    pub kernel: ExpertKernel,
}

impl ExpertSwiGlu {
    /// Slice-level form: `z` is `n × gate.n_in`; `act` is `route_token.len() × n_ff`.
    pub fn compute(
        &self,
        z: &[f32],
        gate: ExpertStack<'_>,
        up: ExpertStack<'_>,
        offsets: &[i32],
        route_token: &[i32],
        act: &mut [f32],
    ) -> Result<(), OpError> {
        let op = "expert_swiglu";
        let (d, nf, r) = (gate.n_in, self.n_ff, route_token.len());
        if d == 0 || up.n_in != d || act.len() < r * nf {
            return Err(OpError::Type(format!(
                "{op}: D {d} (up {}), act {} values for {r} routes of {nf}",
                up.n_in,
                act.len()
            )));
        }
        let n = z.len() / d;
        let off = csr(op, offsets, self.n_expert, r)?;
        if let Some((r, &t)) = route_token
            .iter()
            .enumerate()
            .find(|&(_, &t)| t < 0 || t as usize >= n)
        {
            return Err(OpError::data(
                op,
                format!("route {r} names token {t}, outside [0, {n})"),
            ));
        }
        per_expert(&mut act[..r * nf], &off, nf)
            .into_par_iter()
            .try_for_each(|(e, routes, a)| {
                let m = routes.len();
                let mut x = Vec::with_capacity(m * d);
                for &t in &route_token[routes] {
                    let t = t as usize;
                    x.extend_from_slice(&z[t * d..(t + 1) * d]);
                }
                let mut g = vec![0f32; m * nf];
                matmul(gate.expert(e, nf)?, gate.dtype, nf, d, &x, m, &mut g)?;
                matmul(up.expert(e, nf)?, up.dtype, nf, d, &x, m, a)?;
                for (a, &g) in a.iter_mut().zip(&g) {
                    *a *= silu(g);
                }
                Ok(())
            })
    }
}

impl Op for ExpertSwiGlu {
    fn name(&self) -> &'static str {
        "expert_swiglu"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        nonzero(op, &[("n_expert", self.n_expert), ("n_ff", self.n_ff)])?;
        expect_inputs(op, inputs, 5)?;
        let z = inputs[0];
        if z.dtype != DType::F32 || z.shape.len() != 2 || z.shape[1] == 0 {
            return Err(OpError::shape(
                op,
                format!("z must be F32[n, D] with D > 0, found {z}"),
            ));
        }
        let d = z.shape[1];
        let shape = [self.n_expert, self.n_ff, d];
        expect_weight(op, "gate_exps", inputs[1], &shape)?;
        expect_weight(op, "up_exps", inputs[2], &shape)?;
        expect(op, "offsets", inputs[3], DType::I32, &[self.n_expert + 1])?;
        let r = inputs[4].shape.first().copied().unwrap_or(0);
        expect(op, "route_token", inputs[4], DType::I32, &[r])?;
        Ok(vec![TensorMeta::f32([r, self.n_ff])])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let d = inputs[0].meta.inner();
        self.compute(
            inputs[0].f32()?,
            ExpertStack::of(&inputs[1], d)?,
            ExpertStack::of(&inputs[2], d)?,
            inputs[3].i32()?,
            inputs[4].i32()?,
            outputs[0].f32_mut()?,
        )
    }

    fn describe(&self) -> String {
        format!(
            "expert_swiglu n_expert={} n_ff={}{}",
            self.n_expert,
            self.n_ff,
            self.kernel.label()
        )
    }

    /// Gate and up rows of an expert in one pass, SwiGLU in the epilogue, f32 out. The
    /// static route count picks the path: GEMV for a few routes, grouped GEMM beyond.
    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let (n, d) = (inputs[0].meta.shape[0], inputs[0].meta.shape[1]);
        expert_launch(
            ctx,
            self.name(),
            self.kernel,
            &Experts {
                wa: &inputs[1],
                wb: Some(&inputs[2]),
                x: &inputs[0],
                offsets: inputs[3].ptr,
                route_token: inputs[4].ptr,
                y: outputs[0].ptr,
                n_in: d,
                n_out: self.n_ff,
                n_expert: self.n_expert,
                x_rows: n,
                routes: inputs[4].meta.shape[0],
                nr: n.clamp(1, GEMV_MAXR).next_power_of_two(),
            },
        )
    }
}

/// One grouped expert product on the device (see `expert_rows_iq4_*` in moe.cu and
/// `expert_gemm_tc_iq4` in moe_prefill.cu).
struct Experts<'a> {
    wa: &'a DeviceTensor<'a>,
    /// The up projection for SwiGLU (`wa` is then the gate); `None` for the down projection.
    wb: Option<&'a DeviceTensor<'a>>,
    x: &'a DeviceTensor<'a>,
    offsets: u64,
    /// Token of each route (SwiGLU); the down projection reads route rows directly.
    route_token: u64,
    y: u64,
    n_in: usize,
    n_out: usize,
    n_expert: usize,
    x_rows: usize,
    routes: usize,
    /// Routes a GEMV block sums at once (1, 2, 4 or 8): about the most an expert has; more
    /// are taken in further rounds over the same staged weights.
    nr: usize,
}

fn expert_launch(
    ctx: &GpuCtx,
    op: &'static str,
    kernel: ExpertKernel,
    a: &Experts<'_>,
) -> Result<(), OpError> {
    if a.routes == 0 {
        return Ok(());
    }
    let tc = match kernel {
        ExpertKernel::Unlowered => return Err(unlowered(op)),
        ExpertKernel::Gemv if a.routes > GEMV_ROUTES_LIMIT => {
            return Err(OpError::shape(
                op,
                format!(
                    "the expert GEMV takes at most {GEMV_ROUTES_LIMIT} routes, found {}",
                    a.routes
                ),
            ));
        }
        ExpertKernel::Gemv => None,
        ExpertKernel::Grouped(tc) => Some(tc),
    };
    for w in std::iter::once(a.wa).chain(a.wb) {
        if w.meta.dtype != DType::IQ4_NL {
            return Err(OpError::shape(
                op,
                format!(
                    "the CUDA kernels read expert weights as IQ4_NL, found {}",
                    w.meta
                ),
            ));
        }
        aligned16(op, "expert weight", w)?;
    }
    if !a.n_in.is_multiple_of(256) {
        return Err(OpError::shape(
            op,
            format!(
                "the CUDA kernels need the expert input width to be a multiple of 256 \
                 (whole 16-byte groups of 8 IQ4_NL blocks), found {}",
                a.n_in
            ),
        ));
    }
    aligned16(op, "expert input", a.x)?;
    let swiglu = a.wb.is_some();
    let wb = a.wb.map_or(0, |w| w.ptr);
    let slots = a.n_expert.min(a.routes);
    let i = |what, v| as_i32(op, what, v);
    let Some(tc) = tc else {
        let sms = ctx.device.sm_count() as usize;
        let plan =
            RowsPlan::choose(a.n_in / 256, a.n_out, slots, swiglu, sms).ok_or_else(|| {
                OpError::shape(
                    op,
                    format!(
                        "an input width of {} is more than one GEMV block can split",
                        a.n_in
                    ),
                )
            })?;
        let outs = if swiglu { plan.rt / 2 } else { plan.rt };
        let kern = ctx.kernel("moe.cu", MOE_CU, &format!("expert_rows_iq4_{}", a.nr))?;
        // SAFETY: argument list matches expert_rows_iq4_<NR>; weight rows, inputs and outputs
        // are indexed within the shapes check_device verified, route ids are bounds-checked.
        return unsafe {
            ctx.device
                .launch(&kern)
                .grid((
                    i("row tiles", a.n_out.div_ceil(outs))? as u32,
                    i("experts", slots)? as u32,
                ))
                .block(plan.threads as u32)
                .shared_mem(plan.smem_bytes(a.nr) as u32)
                .arg(a.wa.ptr)
                .arg(wb)
                .arg(a.x.ptr)
                .arg(a.offsets)
                .arg(a.route_token)
                .arg(a.y)
                .arg(i("input width", a.n_in)?)
                .arg(i("rows", a.n_out)?)
                .arg(i("n_expert", a.n_expert)?)
                .arg(i("input rows", a.x_rows)?)
                .arg(i("routes", a.routes)?)
                .arg(plan.rt as i32)
                .arg(plan.kp as i32)
                .enqueue()
                .map_err(dev_err)
        };
    };
    // A chunk's routes: the grouped GEMM on the tensor cores (f16 operands, f32 sums).
    // SAFETY: the weights, inputs, route table and output were checked by check_device
    // against the op's shapes; route ids are bounds-checked by the kernel.
    unsafe {
        launch_expert_gemm_tc_with(
            ctx,
            tc,
            a.wa.ptr,
            a.wb.map(|w| w.ptr),
            a.x.ptr,
            a.offsets,
            a.route_token,
            a.y,
            a.n_in,
            a.n_out,
            a.n_expert,
            a.x_rows,
            a.routes,
        )
    }
}

/// `out[r] = Wd_e · act[r]` for every route `r` of every expert `e`: one row per route.
///
/// Inputs: act F32 `[R, n_ff]`, down_exps `[n_expert, n_embd, n_ff]` (any weight type),
/// offsets I32 `[n_expert+1]`. Output: F32 `[R, n_embd]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertDown {
    pub n_expert: usize,
    pub n_embd: usize,
    pub kernel: ExpertKernel,
}

impl ExpertDown {
    /// Slice-level form: `act` is `R × down.n_in`, `out` is `R × n_embd` with `R = offsets[n_expert]`.
    pub fn compute(
        &self,
        act: &[f32],
        down: ExpertStack<'_>,
        offsets: &[i32],
        out: &mut [f32],
    ) -> Result<(), OpError> {
        let op = "expert_down";
        let (nf, ne) = (down.n_in, self.n_embd);
        let r = offsets.get(self.n_expert).map_or(0, |&o| o.max(0) as usize);
        if nf == 0 || act.len() < r * nf || out.len() < r * ne {
            return Err(OpError::Type(format!(
                "{op}: act {} values, out {} values for {r} routes ({nf} → {ne})",
                act.len(),
                out.len()
            )));
        }
        let off = csr(op, offsets, self.n_expert, r)?;
        per_expert(&mut out[..r * ne], &off, ne)
            .into_par_iter()
            .try_for_each(|(e, routes, y)| {
                let m = routes.len();
                let x = &act[routes.start * nf..routes.end * nf];
                matmul(down.expert(e, ne)?, down.dtype, ne, nf, x, m, y)
            })
    }
}

impl Op for ExpertDown {
    fn name(&self) -> &'static str {
        "expert_down"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        nonzero(op, &[("n_expert", self.n_expert), ("n_embd", self.n_embd)])?;
        expect_inputs(op, inputs, 3)?;
        let act = inputs[0];
        if act.dtype != DType::F32 || act.shape.len() != 2 || act.shape[1] == 0 {
            return Err(OpError::shape(
                op,
                format!("act must be F32[R, n_ff] with n_ff > 0, found {act}"),
            ));
        }
        let (r, nf) = (act.shape[0], act.shape[1]);
        expect_weight(
            op,
            "down_exps",
            inputs[1],
            &[self.n_expert, self.n_embd, nf],
        )?;
        expect(op, "offsets", inputs[2], DType::I32, &[self.n_expert + 1])?;
        Ok(vec![TensorMeta::f32([r, self.n_embd])])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let r = inputs[0].meta.shape[0];
        let down = ExpertStack::of(&inputs[1], inputs[0].meta.inner())?;
        let offsets = inputs[2].i32()?;
        // The table must cover exactly the routes the activation holds.
        if offsets
            .get(self.n_expert)
            .is_some_and(|&o| o as i64 != r as i64)
        {
            return Err(OpError::data(
                "expert_down",
                format!(
                    "offsets end at {:?}, the activation has {r} routes",
                    offsets.get(self.n_expert)
                ),
            ));
        }
        self.compute(inputs[0].f32()?, down, offsets, outputs[0].f32_mut()?)
    }

    fn describe(&self) -> String {
        format!(
            "expert_down n_expert={} n_embd={}{}",
            self.n_expert,
            self.n_embd,
            self.kernel.label()
        )
    }

    /// One output row per route (one writer an element); GEMV or grouped GEMM by route count.
    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let (r, nf) = (inputs[0].meta.shape[0], inputs[0].meta.shape[1]);
        expert_launch(
            ctx,
            self.name(),
            self.kernel,
            &Experts {
                wa: &inputs[1],
                wb: None,
                x: &inputs[0],
                offsets: inputs[2].ptr,
                route_token: 0,
                y: outputs[0].ptr,
                n_in: nf,
                n_out: self.n_embd,
                n_expert: self.n_expert,
                x_rows: r,
                routes: r,
                // The down projection does not know the tokens; at top-k ≥ 4 an expert has
                // at most R/4 of the R routes unless ids repeat (then more rounds).
                nr: r.div_ceil(4).clamp(1, GEMV_MAXR).next_power_of_two(),
            },
        )
    }
}

// ---- GateUpSwiGlu ---------------------------------------------------------------------

/// `silu(x·W_gateᵀ) · (x·W_upᵀ)`: the first half of a dense SwiGLU FFN (the shared expert and
/// the leading dense blocks), the two products and their combination as one op. Its CPU
/// reference is the `linear`, `linear`, `swiglu` chain it replaces (same bits); on the GPU a
/// decode step's few tokens over IQ4_NL weights take one launch (`dense_swiglu_iq4_*`, the
/// routed experts' tiles with token r as route r), and larger ones the chain's own kernels.
///
/// Inputs: x F32 `[n, in]`, W_gate and W_up `[ff, in]` (any `linear` weight type).
/// Output: F32 `[n, ff]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GateUpSwiGlu {
    /// The GEMV kernel family takes the one-launch kernel where it can; the chain's products
    /// run on this family either way.
    pub kernel: LinearKernel,
}

impl GateUpSwiGlu {
    /// Whether the one-launch decode kernel takes these inputs.
    fn fused(&self, x: &TensorMeta, wg: &TensorMeta, wu: &TensorMeta) -> bool {
        matches!(self.kernel, LinearKernel::Gemv { .. })
            && x.shape[0] <= GEMV_MAXR
            && wg.dtype == DType::IQ4_NL
            && wu.dtype == DType::IQ4_NL
            && x.shape[1].is_multiple_of(256)
    }

    /// Scratch of the unfused chain: gate and up `[n, ff]` each, then what `linear` needs.
    fn chain_scratch(&self, inputs: &[&TensorMeta]) -> (usize, usize) {
        let (n, ff) = (inputs[0].shape[0], inputs[1].shape[0]);
        let half = (n * ff * 4).next_multiple_of(256);
        let one = Linear::with(self.kernel);
        let lin = one
            .cuda_scratch_bytes(&inputs[..2])
            .max(one.cuda_scratch_bytes(&[inputs[0], inputs[2]]));
        (half, 2 * half + lin)
    }
}

impl Op for GateUpSwiGlu {
    fn name(&self) -> &'static str {
        "gate_up_swiglu"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        expect_inputs(op, inputs, 3)?;
        let gate = Linear::default().infer(&inputs[..2])?;
        let up = Linear::default().infer(&[inputs[0], inputs[2]])?;
        if gate != up {
            return Err(OpError::shape(
                op,
                format!(
                    "gate weight {} and up weight {} give different outputs",
                    inputs[1], inputs[2]
                ),
            ));
        }
        Ok(gate)
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let meta = outputs[0].meta.clone();
        let bytes = meta.numel() * 4;
        let (mut gate, mut up) = (AlignedBuf::zeroed(bytes), AlignedBuf::zeroed(bytes));
        Linear::default().cpu(
            &[inputs[0], inputs[1]],
            &mut [HostTensorMut::new(&meta, gate.bytes_mut())],
        )?;
        Linear::default().cpu(
            &[inputs[0], inputs[2]],
            &mut [HostTensorMut::new(&meta, up.bytes_mut())],
        )?;
        swiglu(gate.f32s(), up.f32s(), outputs[0].f32_mut()?);
        Ok(())
    }

    fn describe(&self) -> String {
        format!("gate_up_swiglu{}", self.kernel.label())
    }

    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        if inputs.len() != 3 || self.infer(inputs).is_err() {
            return 0;
        }
        if self.fused(inputs[0], inputs[1], inputs[2]) {
            0
        } else {
            self.chain_scratch(inputs).1
        }
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
        let (x, wg, wu, y) = (&inputs[0], &inputs[1], &inputs[2], &outputs[0]);
        let (n, k, ff) = (x.meta.shape[0], x.meta.shape[1], wg.meta.shape[0]);
        if n == 0 || ff == 0 {
            return Ok(());
        }
        let kernel = self.kernel.chosen(op, n)?;
        if self.fused(x.meta, wg.meta, wu.meta) {
            aligned16(op, "x", x)?;
            aligned16(op, "gate weight", wg)?;
            aligned16(op, "up weight", wu)?;
            let sms = ctx.device.sm_count() as usize;
            let plan = RowsPlan::choose(k / 256, ff, 1, true, sms).ok_or_else(|| {
                OpError::shape(
                    op,
                    format!("an input width of {k} is more than one GEMV block can split"),
                )
            })?;
            let nr = n.next_power_of_two();
            let kern = ctx.kernel("moe.cu", MOE_CU, &format!("dense_swiglu_iq4_{nr}"))?;
            // SAFETY: argument list matches dense_swiglu_iq4_<NR>; rows, inputs and outputs
            // are indexed within the shapes check_device verified.
            return unsafe {
                ctx.device
                    .launch(&kern)
                    .grid(as_i32(op, "row tiles", ff.div_ceil(plan.rt / 2))? as u32)
                    .block(plan.threads as u32)
                    .shared_mem(plan.smem_bytes(nr) as u32)
                    .arg(wg.ptr)
                    .arg(wu.ptr)
                    .arg(x.ptr)
                    .arg(y.ptr)
                    .arg(as_i32(op, "input width", k)?)
                    .arg(as_i32(op, "rows", ff)?)
                    .arg(as_i32(op, "tokens", n)?)
                    .arg(plan.rt as i32)
                    .arg(plan.kp as i32)
                    .enqueue()
                    .map_err(dev_err)
            };
        }
        let metas = [x.meta, wg.meta, wu.meta];
        let (half, need) = self.chain_scratch(&metas);
        scratch.require(op, need)?;
        let out_meta = TensorMeta::f32([n, ff]);
        let part = |i: u64| DeviceTensor {
            meta: &out_meta,
            ptr: scratch.ptr + i * half as u64,
            bytes: n * ff * 4,
        };
        let (gate, up) = (part(0), part(1));
        let lin_scratch = Scratch {
            ptr: scratch.ptr + 2 * half as u64,
            bytes: need - 2 * half,
        };
        let one = Linear::with(kernel);
        one.cuda(ctx, &[*x, *wg], &[gate], lin_scratch)?;
        one.cuda(ctx, &[*x, *wu], &[up], lin_scratch)?;
        SwiGlu.cuda(ctx, &[gate, up], &[*y], Scratch::default())
    }
}

// ---- TopKSum -------------------------------------------------------------------------

/// `out[t] = Σ_{j=0..top_k} weights[t][j] · route_out[route of slot t·top_k+j]`, summed in
/// slot order starting from the first term (as llama.cpp's chain of adds).
///
/// Inputs: route_out F32 `[R, D]`, route_slot I32 `[R]` (a permutation of `0..R`), weights
/// F32 `[n, top_k]` with `R = n·top_k`, and optionally an addend F32 `[n, D]` (the shared
/// expert's output) added last, as a separate `add` after the sum would. Output: F32 `[n, D]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopKSum {
    pub top_k: usize,
    pub kernel: TopKKernel,
}

impl TopKSum {
    /// Slice-level form: `route_out` is `R × d`, `weights` is `n × top_k`, `out` is `n × d`.
    pub fn compute(
        &self,
        route_out: &[f32],
        d: usize,
        route_slot: &[i32],
        weights: &[f32],
        out: &mut [f32],
    ) -> Result<(), OpError> {
        let op = "topk_sum";
        let k = self.top_k;
        let r = route_slot.len();
        if k == 0 || d == 0 || !r.is_multiple_of(k) {
            return Err(OpError::Type(format!(
                "{op}: {r} routes are not whole tokens of top_k {k} (D {d})"
            )));
        }
        let n = r / k;
        if route_out.len() < r * d || weights.len() < r || out.len() < n * d {
            return Err(OpError::Type(format!(
                "{op} buffers too small for {n} tokens: route_out {}, weights {}, out {}",
                route_out.len(),
                weights.len(),
                out.len()
            )));
        }
        let mut route_of = vec![usize::MAX; r];
        for (route, &s) in route_slot.iter().enumerate() {
            let slot = usize::try_from(s).ok().filter(|&s| s < r);
            match slot.map(|s| &mut route_of[s]) {
                Some(at) if *at == usize::MAX => *at = route,
                _ => {
                    return Err(OpError::data(
                        op,
                        format!("route {route} names slot {s}: out of [0, {r}) or taken twice"),
                    ));
                }
            }
        }
        out[..n * d]
            .par_chunks_mut(d)
            .enumerate()
            .for_each(|(t, o)| {
                for j in 0..k {
                    let w = weights[t * k + j];
                    let ro = route_of[t * k + j];
                    let src = &route_out[ro * d..(ro + 1) * d];
                    if j == 0 {
                        o.iter_mut().zip(src).for_each(|(o, &x)| *o = w * x);
                    } else {
                        o.iter_mut().zip(src).for_each(|(o, &x)| *o += w * x);
                    }
                }
            });
        Ok(())
    }
}

impl Op for TopKSum {
    fn name(&self) -> &'static str {
        "topk_sum"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        nonzero(op, &[("top_k", self.top_k)])?;
        if inputs.len() != 4 {
            expect_inputs(op, inputs, 3)?;
        }
        let ro = inputs[0];
        if ro.dtype != DType::F32 || ro.shape.len() != 2 || ro.shape[1] == 0 {
            return Err(OpError::shape(
                op,
                format!("route_out must be F32[R, D] with D > 0, found {ro}"),
            ));
        }
        let (r, d) = (ro.shape[0], ro.shape[1]);
        expect(op, "route_slot", inputs[1], DType::I32, &[r])?;
        let n = inputs[2].shape.first().copied().unwrap_or(0);
        expect(op, "weights", inputs[2], DType::F32, &[n, self.top_k])?;
        if n * self.top_k != r {
            return Err(OpError::shape(
                op,
                format!(
                    "route_out has {r} routes, weights {n} tokens × top_k {}",
                    self.top_k
                ),
            ));
        }
        if let Some(a) = inputs.get(3) {
            expect(op, "addend", a, DType::F32, &[n, d])?;
        }
        Ok(vec![TensorMeta::f32([n, d])])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let d = inputs[0].meta.inner();
        let out = outputs[0].f32_mut()?;
        self.compute(inputs[0].f32()?, d, inputs[1].i32()?, inputs[2].f32()?, out)?;
        if let Some(a) = inputs.get(3) {
            out.par_iter_mut()
                .zip(a.f32()?.par_iter())
                .for_each(|(o, &a)| *o += a);
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!("topk_sum top_k={}{}", self.top_k, self.kernel.label())
    }

    /// With the inverse table, the slot → route table (R i32).
    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        match (self.kernel, inputs.first()) {
            (TopKKernel::InverseTable, Some(ro)) => ro.shape.first().copied().unwrap_or(0) * 4,
            _ => 0,
        }
    }

    /// A block per token (split over columns when tokens are few) finds its routes by
    /// scanning `route_slot`, then sums in slot order with the CPU's roundings (same bits).
    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let (r, d) = (inputs[0].meta.shape[0], inputs[0].meta.shape[1]);
        let n = inputs[2].meta.shape[0];
        if n == 0 {
            return Ok(());
        }
        // Many tokens fill the chip by themselves: a block a token, which finds its routes in
        // an inverse table made first (scanning the whole route table in every block cost a
        // 4096-token chunk 164 µs a layer); few tokens split the columns too and scan.
        let many = match self.kernel {
            TopKKernel::Unlowered => return Err(unlowered(op)),
            TopKKernel::Scan => false,
            TopKKernel::InverseTable => true,
        };
        let col_blocks = if many { 1 } else { blocks_for(d, 256) };
        let slot_route = if many {
            scratch.require(op, r * 4)?;
            let inv = ctx.kernel("moe.cu", MOE_CU, "topk_slot_routes")?;
            // SAFETY: reads the R-entry route_slot, writes R ints of scratch (checked above).
            unsafe {
                ctx.device
                    .launch(&inv)
                    .grid(blocks_for(r, 256).min(1024))
                    .block(256)
                    .arg(inputs[1].ptr)
                    .arg(scratch.ptr)
                    .arg(as_i32(op, "routes", r)?)
                    .enqueue()
                    .map_err(dev_err)?;
            }
            scratch.ptr
        } else {
            0
        };
        let kern = ctx.kernel("moe.cu", MOE_CU, "topk_sum")?;
        // SAFETY: argument list matches topk_sum; route indices come from the table's own
        // positions (< R), slots are range-checked in the kernel.
        unsafe {
            ctx.device
                .launch(&kern)
                .grid((as_i32(op, "tokens", n)? as u32, col_blocks))
                .block(256)
                .shared_mem((self.top_k * 4) as u32)
                .arg(inputs[0].ptr)
                .arg(inputs[1].ptr)
                .arg(slot_route)
                .arg(inputs[2].ptr)
                .arg(inputs.get(3).map_or(0, |a| a.ptr))
                .arg(outputs[0].ptr)
                .arg(as_i32(op, "routes", r)?)
                .arg(as_i32(op, "D", d)?)
                .arg(as_i32(op, "top_k", self.top_k)?)
                .enqueue()
                .map_err(dev_err)
        }
    }
}
