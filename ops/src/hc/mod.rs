//! Hyper-connections (spec §3.0, §3.2–3.4, §3.6, §3.8): the residual state is
//! `hc` f32 streams per token, stored `[n, hc, D]` (stream-major within a token).
//! `hc_pre` turns them into the sub-layer input and two gates, `hc_post`
//! rebuilds them from the sub-layer output, `stream_mean` collapses them for the head.
//!
//! The mixing matrix `comb` is `[n, hc, hc]` indexed `[d][s]` (flat `hc·d + s`):
//! the weight of source stream `s` in destination stream `d` (spec §9 item 2).
//!
//! The ops and their shape rules are here, the CPU references in `cpu.rs`, the CUDA launches
//! in `cuda.rs` (kernels in `hc.cu`).

pub mod cases;
mod cpu;
mod cuda;
#[cfg(test)]
mod tests;

use crate::check::{arity, want_dtype};
use crate::gpu::{DeviceTensor, GpuCtx, Scratch};
use crate::moe::TopKSum;
use crate::tensor::{DType, HostTensor, HostTensorMut, TensorMeta};
use crate::{Op, OpError};

pub use cpu::{hc_collapse_row, hc_gates_row, hc_post_row, hc_pre_rows, sinkhorn, stream_mean_row};
pub(crate) use cuda::HC_CU;

/// Column segment of `hc_pre`'s split-K pass for rows of `w` values: about 128
/// segments (one a block, so one decode token spreads over the chip), whole groups
/// of 8 so the 16-byte loads stay aligned.
fn pre_segment(w: usize) -> usize {
    w.div_ceil(128).next_multiple_of(8).max(32)
}

/// The most 32-column chunks a warp of `hc_pre_rows` takes (a block spans 8 × this many).
pub const ROWS_CHUNKS_PER_WARP_LIMIT: usize = 64;

/// How `hc_pre`'s partial dots run on the GPU (chosen by the graph's lowering).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HcPreKernel {
    #[default]
    Unlowered,
    /// ~128 blocks each take a column segment of `fn` for up to 8 tokens (decode: one token
    /// spread over the chip).
    SplitK,
    /// 16-token tiles on the tensor cores (`hc_pre_rows`: tf32 hi + lo against the bf16 fn),
    /// each warp taking `chunks_per_warp` 32-column chunks (1..=64). Needs hc = 4, D a multiple
    /// of 32 and a BF16 fn ([`HcPre::rows_supports`]); the split-K pass runs otherwise.
    Rows { chunks_per_warp: usize },
}

impl HcPreKernel {
    fn label(self) -> String {
        match self {
            HcPreKernel::Unlowered => String::new(),
            HcPreKernel::SplitK => " [split-k]".into(),
            HcPreKernel::Rows { chunks_per_warp } => format!(" [rows cpw={chunks_per_warp}]"),
        }
    }
}

/// `(n, hc·D, mixes, splits)` of an `hc_pre` call, from its input metadata.
fn pre_dims(p: &HcPre, inputs: &[&TensorMeta]) -> Option<(usize, usize, usize, usize)> {
    p.infer(inputs).ok()?;
    let (n, d) = (inputs[0].shape[0], inputs[0].shape[2]);
    let w = p.hc * d;
    Some((n, w, p.mixes(), w.div_ceil(pre_segment(w))))
}

fn want_hc(op: &'static str, hc: usize) -> Result<(), OpError> {
    if hc == 0 {
        return Err(OpError::shape(op, "hc must be at least 1"));
    }
    Ok(())
}

/// Checks `meta` is F32 of exactly `shape`.
fn want_f32(
    op: &'static str,
    what: &str,
    meta: &TensorMeta,
    shape: &[usize],
) -> Result<(), OpError> {
    want_dtype(op, what, meta, DType::F32)?;
    if meta.shape != shape {
        return Err(OpError::shape(
            op,
            format!("{what} must be {}, found {meta}", TensorMeta::f32(shape)),
        ));
    }
    Ok(())
}

/// `(n, D)` of a stream tensor `[n, hc, D]`.
fn streams_dims(op: &'static str, hc: usize, h: &TensorMeta) -> Result<(usize, usize), OpError> {
    want_dtype(op, "streams", h, DType::F32)?;
    match h.shape[..] {
        [n, s, d] if s == hc && d > 0 => Ok((n, d)),
        _ => Err(OpError::shape(
            op,
            format!("streams must be F32[n, {hc}, D] with D > 0, found {h}"),
        )),
    }
}

/// F32 `[n, D]` → F32 `[n, hc, D]`: every stream a copy of the token's row (spec §3.1).
#[derive(Debug, Clone, PartialEq)]
pub struct HcExpand {
    pub hc: usize,
}

impl Op for HcExpand {
    fn name(&self) -> &'static str {
        "hc_expand"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        want_hc(op, self.hc)?;
        arity(op, inputs, 1)?;
        let x = inputs[0];
        want_dtype(op, "x", x, DType::F32)?;
        match x.shape[..] {
            [n, d] if d > 0 => Ok(vec![TensorMeta::f32([n, self.hc, d])]),
            _ => Err(OpError::shape(
                op,
                format!("x must be F32[n, D] with D > 0, found {x}"),
            )),
        }
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        format!("hc_expand(hc={})", self.hc)
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

/// The hyper-connection's entry (spec §3.2–3.4).
///
/// Inputs: streams `H` F32 `[n, hc, D]`; `fn` `[2hc+hc², hc·D]` BF16 or F32 (GGUF
/// `ne = [hc·D, 2hc+hc²]`); `base` F32 `[2hc+hc²]`; `scale` F32 `[3]`.
/// Outputs: `x` F32 `[n, D]` (the sub-layer input, before its own norm),
/// `post` F32 `[n, hc]`, `comb` F32 `[n, hc, hc]` indexed `[d][s]`.
#[derive(Debug, Clone, PartialEq)]
pub struct HcPre {
    pub hc: usize,
    pub sinkhorn_iters: usize,
    pub rms_eps: f32,
    pub hc_eps: f32,
    pub clamp: f32,
    pub kernel: HcPreKernel,
}

impl HcPre {
    /// Rows of `fn`: `[pre (hc) | post (hc) | comb (hc²)]`.
    pub fn mixes(&self) -> usize {
        2 * self.hc + self.hc * self.hc
    }

    /// Whether the tensor-core rows pass takes streams of width `d` and an `fn` of `fn_dtype`.
    pub fn rows_supports(&self, d: usize, fn_dtype: DType) -> bool {
        self.hc == 4 && self.mixes() == 24 && d.is_multiple_of(32) && fn_dtype == DType::BF16
    }
}

impl Op for HcPre {
    fn name(&self) -> &'static str {
        "hc_pre"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        let hc = self.hc;
        want_hc(op, hc)?;
        if hc > 64 {
            return Err(OpError::shape(
                op,
                format!("hc = {hc} is not a stream count (at most 64)"),
            ));
        }
        if self.clamp.is_nan() || self.clamp < 0.0 {
            return Err(OpError::shape(
                op,
                format!("clamp must be a non-negative bound, found {}", self.clamp),
            ));
        }
        arity(op, inputs, 4)?;
        let (n, d) = streams_dims(op, hc, inputs[0])?;
        let k = self.mixes();
        let w = hc
            .checked_mul(d)
            .ok_or_else(|| OpError::shape(op, format!("hc·D overflows for D = {d}")))?;
        let f = inputs[1];
        if !matches!(f.dtype, DType::BF16 | DType::F32) || f.shape != [k, w] {
            return Err(OpError::shape(
                op,
                format!("fn must be BF16 or F32 [{k}, {w}] (2hc+hc² rows of hc·D), found {f}"),
            ));
        }
        want_f32(op, "base", inputs[2], &[k])?;
        want_f32(op, "scale", inputs[3], &[3])?;
        Ok(vec![
            TensorMeta::f32([n, d]),
            TensorMeta::f32([n, hc]),
            TensorMeta::f32([n, hc, hc]),
        ])
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
            "hc_pre(hc={}, iters={}, rms_eps={:e}, hc_eps={:e}, clamp={}){}",
            self.hc,
            self.sinkhorn_iters,
            self.rms_eps,
            self.hc_eps,
            self.clamp,
            self.kernel.label()
        )
    }

    /// Split-K partial dots and sums of squares of every token, f32
    /// `[n][mixes + 1][splits]` (the last row: the sums of squares).
    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        pre_dims(self, inputs).map_or(0, |(n, _, k, splits)| n * splits * (k + 1) * 4)
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

/// `hc_pre` followed by the sub-layer's RMSNorm of its collapsed x (spec §3.0's `rms(x)`):
/// the pre-norm x has no other reader, so on the GPU the finishing kernel normalises the row
/// it has just collapsed instead of a separate kernel reading it back.
///
/// Inputs: H, fn, base, scale (as [`HcPre`]) and the norm weight F32 `[D]`.
/// Outputs: `rms_norm(x)·w` F32 `[n, D]`, post, comb.
#[derive(Debug, Clone, PartialEq)]
pub struct HcPreNorm {
    pub pre: HcPre,
    pub norm_eps: f32,
}

impl Op for HcPreNorm {
    fn name(&self) -> &'static str {
        "hc_pre_norm"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        arity(op, inputs, 5)?;
        let outs = self.pre.infer(&inputs[..4])?;
        let d = outs[0].shape[1];
        want_f32(op, "norm weight", inputs[4], &[d])?;
        Ok(outs)
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
            "{} then rms_norm(eps={:e})",
            self.pre.describe(),
            self.norm_eps
        )
    }

    /// The partials of `hc_pre`, then room for the collapsed x when the norm cannot be fused.
    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        let partials = self.pre.cuda_scratch_bytes(&inputs[..4.min(inputs.len())]);
        let x = inputs.first().map_or(0, |h| {
            h.shape.first().copied().unwrap_or(0) * h.shape.last().copied().unwrap_or(0)
        });
        partials.next_multiple_of(16) + x * 4
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

/// `hc_post` of one sub-layer straight into the next one's `hc_pre` and norm (spec §3.0: the
/// streams a sub-layer leaves are the next one's input). The new streams H' are an output (the
/// residual), and on the GPU the partial pass of `hc_pre` forms them itself, so hc_post has no
/// launch of its own.
///
/// Inputs: y, H, post, comb (as [`HcPost`]), then fn, base, scale and the norm weight (as
/// [`HcPreNorm`]). Outputs: H', the normalised x, post', comb'.
#[derive(Debug, Clone, PartialEq)]
pub struct HcPostPreNorm {
    pub post: HcPost,
    pub pre_norm: HcPreNorm,
}

impl HcPostPreNorm {
    fn pre_metas<'a>(&self, h: &'a TensorMeta, inputs: &[&'a TensorMeta]) -> Vec<&'a TensorMeta> {
        std::iter::once(h)
            .chain(inputs[4..].iter().copied())
            .collect()
    }
}

impl Op for HcPostPreNorm {
    fn name(&self) -> &'static str {
        "hc_post_pre_norm"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        arity(self.name(), inputs, 8)?;
        if self.post.hc != self.pre_norm.pre.hc {
            return Err(OpError::shape(
                self.name(),
                format!(
                    "hc_post has {} streams, hc_pre {}",
                    self.post.hc, self.pre_norm.pre.hc
                ),
            ));
        }
        let streams = self.post.infer(&inputs[..4])?.remove(0);
        let mut outs = vec![streams.clone()];
        outs.extend(self.pre_norm.infer(&self.pre_metas(&streams, inputs))?);
        Ok(outs)
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        format!("{} then {}", self.post.describe(), self.pre_norm.describe())
    }

    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        match self.post.infer(&inputs[..4.min(inputs.len())]) {
            Ok(streams) if inputs.len() == 8 => self
                .pre_norm
                .cuda_scratch_bytes(&self.pre_metas(&streams[0], inputs)),
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

/// The MoE's routed sum ([`TopKSum`] with the shared expert's addend) as the y of the
/// [`HcPostPreNorm`] after it: on the GPU the fused pair kernel forms each element of y as the
/// top-k sum does (same roundings, same bits) where it needs it, so a decode step's top-k sum
/// has no launch of its own. Where the step takes another pass (the tensor-core rows pass), y
/// is formed into scratch first, as two launches did before.
///
/// Inputs: route_out, route_slot, weights, addend (as [`TopKSum`]), then H, post, comb (as
/// [`HcPost`]), then fn, base, scale and the norm weight. Outputs: as [`HcPostPreNorm`].
#[derive(Debug, Clone, PartialEq)]
pub struct HcRoutedPostPreNorm {
    pub sum: TopKSum,
    pub boundary: HcPostPreNorm,
}

impl HcRoutedPostPreNorm {
    /// y's shape, and the boundary's inputs with y in front.
    fn boundary_metas<'a>(
        &self,
        y: &'a TensorMeta,
        inputs: &[&'a TensorMeta],
    ) -> Vec<&'a TensorMeta> {
        std::iter::once(y)
            .chain(inputs[4..].iter().copied())
            .collect()
    }

    fn y_meta(&self, inputs: &[&TensorMeta]) -> Result<TensorMeta, OpError> {
        arity(self.name(), inputs, 11)?;
        Ok(self.sum.infer(&inputs[..4])?.remove(0))
    }
}

impl Op for HcRoutedPostPreNorm {
    fn name(&self) -> &'static str {
        "hc_routed_post_pre_norm"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let y = self.y_meta(inputs)?;
        self.boundary.infer(&self.boundary_metas(&y, inputs))
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        format!("{} into {}", self.sum.describe(), self.boundary.describe())
    }

    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        let Ok(y) = self.y_meta(inputs) else {
            return 0;
        };
        // The boundary's own scratch, then (another pass than the pair kernel) y and the top-k
        // sum's scratch.
        routed_y_offset(&self.boundary, &self.boundary_metas(&y, inputs))
            + y.bytes().unwrap_or(0).next_multiple_of(256)
            + self.sum.cuda_scratch_bytes(&inputs[..4])
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

/// Where y goes in the routed boundary's scratch: past the boundary's own.
fn routed_y_offset(boundary: &HcPostPreNorm, metas: &[&TensorMeta]) -> usize {
    boundary.cuda_scratch_bytes(metas).next_multiple_of(256)
}

/// The hyper-connection's exit (spec §3.6).
///
/// Inputs: `y` F32 `[n, D]` (sub-layer output), `H` F32 `[n, hc, D]` (the streams
/// `hc_pre` read), `post` F32 `[n, hc]`, `comb` F32 `[n, hc, hc]` (`[d][s]`).
/// Output: F32 `[n, hc, D]`, `H'[d] = post[d]·y + Σ_s comb[d][s]·H[s]`.
#[derive(Debug, Clone, PartialEq)]
pub struct HcPost {
    pub hc: usize,
}

impl Op for HcPost {
    fn name(&self) -> &'static str {
        "hc_post"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        let hc = self.hc;
        want_hc(op, hc)?;
        arity(op, inputs, 4)?;
        let (n, d) = streams_dims(op, hc, inputs[1])?;
        want_f32(op, "y", inputs[0], &[n, d])?;
        want_f32(op, "post", inputs[2], &[n, hc])?;
        want_f32(op, "comb", inputs[3], &[n, hc, hc])?;
        Ok(vec![TensorMeta::f32([n, hc, d])])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        format!("hc_post(hc={})", self.hc)
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

/// F32 `[n, hc, D]` → F32 `[n, D]`: the mean of the streams (spec §3.8), added in
/// stream order then scaled by `1/hc`.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamMean {
    pub hc: usize,
}

impl Op for StreamMean {
    fn name(&self) -> &'static str {
        "stream_mean"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        want_hc(op, self.hc)?;
        arity(op, inputs, 1)?;
        let (n, d) = streams_dims(op, self.hc, inputs[0])?;
        Ok(vec![TensorMeta::f32([n, d])])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        format!("stream_mean(hc={})", self.hc)
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
