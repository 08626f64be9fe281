//! Hyper-connections (spec §3.0, §3.2–3.4, §3.6, §3.8): the residual state is
//! `hc` f32 streams per token, stored `[n, hc, D]` (stream-major within a token).
//! `hc_pre` turns them into the sub-layer input and two gates, `hc_post`
//! rebuilds them from the sub-layer output, `stream_mean` collapses them for the head.
//!
//! The mixing matrix `comb` is `[n, hc, hc]` indexed `[d][s]` (flat `hc·d + s`):
//! the weight of source stream `s` in destination stream `d` (spec §9 item 2).

use rayon::prelude::*;

use crate::cpu::matmul;
use crate::elementwise::{arity, want_dtype};
use crate::gpu::{DeviceTensor, GpuCtx, Scratch, blocks_for, dev_err};
use crate::linear::as_i32;
use crate::norm::{launch_rms_norm, rms_norm_rows};
use crate::op::check_device;
use crate::op::check_host;
use crate::tensor::{DType, HostTensor, HostTensorMut, TensorMeta};
use crate::{Op, OpError};

pub(crate) const HC_CU: &str = include_str!("../kernels/hc.cu");

/// Suffix of the kernels specialised on the stream count (loops over streams unrolled,
/// so a thread's stream loads are in flight together); 0 is the run-time-hc variant.
fn hc_variant(hc: usize) -> usize {
    if matches!(hc, 1 | 2 | 4) { hc } else { 0 }
}

/// Grid of a grid-stride element-wise kernel over `total` items.
fn stride_grid(total: usize) -> u32 {
    blocks_for(total, 256).min(32768)
}

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

/// Threads of an `hc_pre_finish` block (its `__launch_bounds__`): a warp per mix total.
const PRE_FINISH_THREADS: usize = 1024;

/// `(n, hc·D, mixes, splits)` of an `hc_pre` call, from its input metadata.
fn pre_dims(p: &HcPre, inputs: &[&TensorMeta]) -> Option<(usize, usize, usize, usize)> {
    p.infer(inputs).ok()?;
    let (n, d) = (inputs[0].shape[0], inputs[0].shape[2]);
    let w = p.hc * d;
    Some((n, w, p.mixes(), w.div_ceil(pre_segment(w))))
}

fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// Clamps to `[-c, c]` letting NaN through (`f32::clamp` panics on a NaN
/// bound; `max`/`min` would turn a NaN logit into a finite one).
fn clamp_logit(l: f32, c: f32) -> f32 {
    if l > c {
        c
    } else if l < -c {
        -c
    } else {
        l
    }
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

/// Sinkhorn normalisation of `m` (`hc × hc`, `[d][s]`) in place: `iters` times,
/// divide each destination row by (its sum over sources + eps), then each source
/// column by (its sum over destinations + eps). Sums run in index order.
pub fn sinkhorn(m: &mut [f32], hc: usize, iters: usize, eps: f32) {
    let m = &mut m[..hc * hc];
    for _ in 0..iters {
        for row in m.chunks_exact_mut(hc) {
            let den = row.iter().fold(0f32, |a, &v| a + v) + eps;
            row.iter_mut().for_each(|v| *v /= den);
        }
        for s in 0..hc {
            let den = (0..hc).fold(0f32, |a, d| a + m[hc * d + s]) + eps;
            (0..hc).for_each(|d| m[hc * d + s] /= den);
        }
    }
}

/// The gates of one token from its `2hc + hc²` mixes (spec §3.2–3.3):
/// `pre[s] = σ(m[s]·S0 + B[s])`, `post[d] = 2σ(m[hc+d]·S1 + B[hc+d])`,
/// `comb = sinkhorn(exp(L − max_s L))` with `L[d][s] = clamp(m[2hc+hc·d+s]·S2 + B[..], ±clamp)`.
pub fn hc_gates_row(
    p: &HcPre,
    mixes: &[f32],
    base: &[f32],
    scale: &[f32],
    pre: &mut [f32],
    post: &mut [f32],
    comb: &mut [f32],
) {
    let hc = p.hc;
    let z = |k: usize, s: f32| mixes[k] * s + base[k];
    for (s, o) in pre[..hc].iter_mut().enumerate() {
        *o = sigmoid(z(s, scale[0]));
    }
    for (d, o) in post[..hc].iter_mut().enumerate() {
        *o = 2.0 * sigmoid(z(hc + d, scale[1]));
    }
    for (d, row) in comb[..hc * hc].chunks_exact_mut(hc).enumerate() {
        for (s, o) in row.iter_mut().enumerate() {
            *o = clamp_logit(z(2 * hc + hc * d + s, scale[2]), p.clamp);
        }
        let max = row.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
        row.iter_mut().for_each(|v| *v = (*v - max).exp());
    }
    sinkhorn(comb, hc, p.sinkhorn_iters, p.hc_eps);
}

/// `x[i] = Σ_s pre[s]·H[s][i]`, summed s = 0, 1, … in order (spec §3.4).
/// `h` holds `pre.len()` streams of `x.len()` values.
pub fn hc_collapse_row(pre: &[f32], h: &[f32], x: &mut [f32]) {
    let d = x.len();
    if d == 0 {
        return;
    }
    for (s, (&p, hs)) in pre.iter().zip(h.chunks_exact(d)).enumerate() {
        if s == 0 {
            x.iter_mut().zip(hs).for_each(|(x, &v)| *x = p * v);
        } else {
            x.iter_mut().zip(hs).for_each(|(x, &v)| *x += p * v);
        }
    }
}

/// `hc_pre` over `n` tokens of `hc` streams of `d` values: the flat unweighted
/// RMS over each token's `hc·d` values, the mixes `Fn · f̂` (f32, `Fn` stored as
/// `fn_dtype`, `2hc + hc²` rows of `hc·d`), then the gates and the collapse.
#[allow(clippy::too_many_arguments)]
pub fn hc_pre_rows(
    p: &HcPre,
    n: usize,
    d: usize,
    h: &[f32],
    fn_w: &[u8],
    fn_dtype: DType,
    base: &[f32],
    scale: &[f32],
    x: &mut [f32],
    post: &mut [f32],
    comb: &mut [f32],
) -> Result<(), OpError> {
    let hc = p.hc;
    let (k, w) = (p.mixes(), hc * d);
    if hc == 0
        || d == 0
        || h.len() < n * w
        || base.len() < k
        || scale.len() < 3
        || x.len() < n * d
        || post.len() < n * hc
        || comb.len() < n * hc * hc
    {
        return Err(OpError::Type(format!(
            "hc_pre buffers do not fit hc={hc}, n={n}, D={d}: streams {}, base {}, scale {}, \
             x {}, post {}, comb {}",
            h.len(),
            base.len(),
            scale.len(),
            x.len(),
            post.len(),
            comb.len()
        )));
    }
    let mut flat = vec![0f32; n * w];
    rms_norm_rows(&h[..n * w], None, w, p.rms_eps, &mut flat);
    let mut mixes = vec![0f32; n * k];
    matmul(fn_w, fn_dtype, k, w, &flat, n, &mut mixes)?;
    x[..n * d]
        .par_chunks_mut(d)
        .zip(post[..n * hc].par_chunks_mut(hc))
        .zip(comb[..n * hc * hc].par_chunks_mut(hc * hc))
        .zip(h.par_chunks(w))
        .zip(mixes.par_chunks(k))
        .for_each(|((((x, post), comb), h), m)| {
            let mut pre = vec![0f32; hc];
            hc_gates_row(p, m, base, scale, &mut pre, post, comb);
            hc_collapse_row(&pre, h, x);
        });
    Ok(())
}

/// One token's new streams: `out[d][i] = post[d]·y[i] + Σ_s comb[d][s]·H[s][i]`
/// (spec §3.6), the comb sum in source order after the `post·y` term.
pub fn hc_post_row(y: &[f32], h: &[f32], post: &[f32], comb: &[f32], out: &mut [f32]) {
    let (dim, hc) = (y.len(), post.len());
    if dim == 0 {
        return;
    }
    for (dst, o) in out.chunks_exact_mut(dim).take(hc).enumerate() {
        hc_post_stream(y, h, post[dst], &comb[hc * dst..hc * (dst + 1)], o);
    }
}

/// Destination stream `o` from its `post` gate and its row of `comb`.
fn hc_post_stream(y: &[f32], h: &[f32], post: f32, comb_row: &[f32], o: &mut [f32]) {
    let dim = o.len();
    o.iter_mut().zip(y).for_each(|(o, &y)| *o = post * y);
    for (&c, hs) in comb_row.iter().zip(h.chunks_exact(dim)) {
        o.iter_mut().zip(hs).for_each(|(o, &v)| *o += c * v);
    }
}

/// `out = (((H[0] + H[1]) + H[2]) + …) · (1/hc)` (spec §3.8: sequential adds, then the scale).
pub fn stream_mean_row(h: &[f32], out: &mut [f32]) {
    let dim = out.len();
    if dim == 0 {
        return;
    }
    let hc = h.len() / dim;
    for (s, hs) in h.chunks_exact(dim).enumerate() {
        if s == 0 {
            out.copy_from_slice(hs);
        } else {
            out.iter_mut().zip(hs).for_each(|(o, &v)| *o += v);
        }
    }
    let inv = 1.0 / hc as f32;
    out.iter_mut().for_each(|o| *o *= inv);
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
        check_host(self, inputs, outputs)?;
        let d = inputs[0].meta.shape[1];
        let x = inputs[0].f32()?;
        outputs[0]
            .f32_mut()?
            .par_chunks_mut(d)
            .enumerate()
            .for_each(|(i, o)| {
                let t = i / self.hc;
                o.copy_from_slice(&x[t * d..(t + 1) * d]);
            });
        Ok(())
    }

    fn describe(&self) -> String {
        format!("hc_expand(hc={})", self.hc)
    }

    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let total = outputs[0].meta.numel();
        if total == 0 {
            return Ok(());
        }
        let k = ctx.kernel("hc.cu", HC_CU, "hc_expand")?;
        // SAFETY: hc_expand(x, out, hc, D, total); check_device checked x is n×D and out
        // n×hc×D f32 = total elements.
        unsafe {
            ctx.device
                .launch(&k)
                .grid(stride_grid(total))
                .block(256)
                .arg(inputs[0].ptr)
                .arg(outputs[0].ptr)
                .arg(as_i32(op, "hc", self.hc)?)
                .arg(as_i32(op, "D", inputs[0].meta.shape[1])?)
                .arg(total as i64)
                .enqueue()
                .map_err(dev_err)
        }
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
        check_host(self, inputs, outputs)?;
        let (n, d) = (inputs[0].meta.shape[0], inputs[0].meta.shape[2]);
        let h = inputs[0].f32()?;
        let (base, scale) = (inputs[2].f32()?, inputs[3].f32()?);
        let [x, post, comb] = outputs else {
            return Err(OpError::shape(self.name(), "expects 3 outputs"));
        };
        hc_pre_rows(
            self,
            n,
            d,
            h,
            inputs[1].data,
            inputs[1].meta.dtype,
            base,
            scale,
            x.f32_mut()?,
            post.f32_mut()?,
            comb.f32_mut()?,
        )
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

    /// Two launches: ~128 blocks each take a column segment of `fn` (and up to 8
    /// tokens) and write partial dots and sums of squares to scratch; then per token
    /// one block runs the gates and the Sinkhorn chain (one warp, fast reciprocal
    /// divisions) while another collapses D with 16-byte loads. Partials are summed in
    /// a fixed order (deterministic). The mixes are `(Σ fn·f)·r` rather than the
    /// reference's `Σ fn·(f·r)`, and the dot order differs, so this is the reference up
    /// to f32 rounding (not bit-identical).
    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let [x, post, comb] = outputs else {
            return Err(OpError::shape(self.name(), "expects 3 outputs"));
        };
        // SAFETY: check_device checked every input and output against the op's shapes.
        unsafe {
            self.enqueue(
                ctx,
                inputs,
                [x.ptr, post.ptr, comb.ptr],
                scratch,
                None,
                None,
            )
        }
    }
}

impl HcPre {
    /// The two launches of `hc_pre` over `inputs` (H, fn, base, scale), writing x, post and
    /// comb at `outs`. With `norm = Some((w, eps))` the collapse block also applies the
    /// sub-layer's RMSNorm to x (only when [`HcPre::norm_fuses`] said so).
    ///
    /// # Safety
    /// `inputs` must be checked against [`Op::infer`] and `outs` must address buffers of the
    /// inferred output sizes; `norm`'s weight must hold D f32.
    unsafe fn enqueue(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outs: [u64; 3],
        scratch: Scratch,
        norm: Option<(u64, f32)>,
        post: Option<[u64; 4]>,
    ) -> Result<(), OpError> {
        let op = self.name();
        let metas: Vec<&TensorMeta> = inputs.iter().take(4).map(|t| t.meta).collect();
        let (n, w, k, splits) =
            pre_dims(self, &metas).ok_or_else(|| OpError::shape(op, "inputs refused"))?;
        if n == 0 {
            return Ok(());
        }
        let need = self.cuda_scratch_bytes(&metas);
        scratch.require("hc_pre", need)?;
        let (h, f) = (&inputs[0], &inputs[1]);
        let d = w / self.hc;
        let tb = if n >= 8 { 8 } else { 1 };
        let groups = n.div_ceil(tb);
        if groups > 65535 {
            return Err(OpError::shape(op, format!("{n} tokens in one launch")));
        }
        let vec = w.is_multiple_of(8) && f.ptr.is_multiple_of(16) && h.ptr.is_multiple_of(16);
        let seg = pre_segment(w);
        let fn_ty = if f.meta.dtype == DType::BF16 {
            "bf16"
        } else {
            "f32"
        };
        // The pair kernel keeps every (mix, 8-column) product of its tokens in shared memory;
        // fused with hc_post, also the segment of H' it forms.
        let pair_smem = tb * (k + 1) * (seg / 8) * 4;
        let fused_smem = pair_smem.next_multiple_of(16) + tb * seg * 4;
        let pairs = vec && fused_smem <= 48 << 10;
        let part = scratch.ptr;
        let (wi, ki) = (as_i32(op, "hc·D", w)?, as_i32(op, "mixes", k)?);
        let cpw = match self.kernel {
            HcPreKernel::Unlowered => return Err(crate::linear::unlowered(op)),
            HcPreKernel::SplitK => 0,
            HcPreKernel::Rows { chunks_per_warp } => {
                chunks_per_warp.clamp(1, ROWS_CHUNKS_PER_WARP_LIMIT)
            }
        };
        let rows = cpw > 0
            && self.rows_supports(d, f.meta.dtype)
            && [h.ptr, f.ptr].iter().all(|p| p.is_multiple_of(16));
        let mut post = post;
        if let Some(p) = post {
            let fuses = if rows {
                p[..2].iter().all(|a| a.is_multiple_of(16))
            } else {
                pairs
            };
            if !fuses {
                // SAFETY: the caller's hc_post inputs and H' (inputs[0]) are n×… as checked.
                unsafe { launch_hc_post(ctx, self.hc, p, h.ptr, n, d)? };
                post = None;
            }
        }
        if rows {
            let splits = (d / 32).div_ceil(8 * cpw);
            let tiles = n.div_ceil(16);
            if tiles > 65535 {
                return Err(OpError::shape(op, format!("{n} tokens in one launch")));
            }
            let (ni, di, ci) = (
                as_i32(op, "n", n)?,
                as_i32(op, "D", d)?,
                as_i32(op, "chunks", cpw)?,
            );
            let grid = (splits as u32, tiles as u32);
            // SAFETY: the row kernels read H (or hc_post's y, H, post, comb) for n tokens of
            // W = 4·D f32 and fn (24×W bf16), write H' (with hc_post) and part[n][25][splits],
            // splits ≤ pre_dims' count, inside the scratch checked above.
            unsafe {
                if let Some(p) = post {
                    let kp = ctx.kernel("hc.cu", HC_CU, "hc_post_pre_rows")?;
                    ctx.device
                        .launch(&kp)
                        .grid(grid)
                        .block(256)
                        .arg(p[0])
                        .arg(p[1])
                        .arg(p[2])
                        .arg(p[3])
                        .arg(h.ptr)
                        .arg(f.ptr)
                        .arg(part)
                        .arg(ni)
                        .arg(di)
                        .arg(ci)
                        .enqueue()
                        .map_err(dev_err)?;
                } else {
                    let kp = ctx.kernel("hc.cu", HC_CU, "hc_pre_rows")?;
                    ctx.device
                        .launch(&kp)
                        .grid(grid)
                        .block(256)
                        .arg(h.ptr)
                        .arg(f.ptr)
                        .arg(part)
                        .arg(ni)
                        .arg(di)
                        .arg(ci)
                        .enqueue()
                        .map_err(dev_err)?;
                }
                return self.enqueue_finish(ctx, inputs, outs, scratch, norm, splits);
            }
        }
        if let Some(p) = post {
            let kp = ctx.kernel("hc.cu", HC_CU, &format!("hc_post_pre_pairs_{fn_ty}_{tb}"))?;
            // SAFETY: the fused partial kernel reads y, H, post, comb (the caller's hc_post
            // inputs), writes H' (n×W) at inputs[0] and part[n][K+1][splits] in scratch.
            unsafe {
                ctx.device
                    .launch(&kp)
                    .grid((splits as u32, groups as u32))
                    .block(256)
                    .shared_mem(fused_smem as u32)
                    .arg(p[0])
                    .arg(p[1])
                    .arg(p[2])
                    .arg(p[3])
                    .arg(h.ptr)
                    .arg(f.ptr)
                    .arg(part)
                    .arg(as_i32(op, "n", n)?)
                    .arg(wi)
                    .arg(ki)
                    .arg(as_i32(op, "segment", seg)?)
                    .arg(as_i32(op, "hc", self.hc)?)
                    .arg(as_i32(op, "D", d)?)
                    .enqueue()
                    .map_err(dev_err)?;
            }
            // SAFETY: as for the partial kernel below.
            return unsafe { self.enqueue_finish(ctx, inputs, outs, scratch, norm, splits) };
        }
        let (name, smem) = if vec && pair_smem <= 48 << 10 {
            (format!("hc_pre_pairs_{fn_ty}_{tb}"), pair_smem as u32)
        } else {
            let v = if vec { "vec" } else { "any" };
            (format!("hc_pre_partial_{fn_ty}_{v}_{tb}"), 0)
        };
        let kp = ctx.kernel("hc.cu", HC_CU, &name)?;
        // SAFETY: the partial kernel reads H (n×W f32) and fn (K×W) and writes
        // part[n][K+1][splits] inside the scratch checked above.
        unsafe {
            ctx.device
                .launch(&kp)
                .grid((splits as u32, groups as u32))
                .block(256)
                .shared_mem(smem)
                .arg(h.ptr)
                .arg(f.ptr)
                .arg(part)
                .arg(as_i32(op, "n", n)?)
                .arg(wi)
                .arg(ki)
                .arg(as_i32(op, "segment", seg)?)
                .enqueue()
                .map_err(dev_err)?;
        }
        // SAFETY: the partials are in scratch; the caller's contract covers the rest.
        unsafe { self.enqueue_finish(ctx, inputs, outs, scratch, norm, splits) }
    }

    /// The finishing launch of `hc_pre` (totals, gates, Sinkhorn, collapse and the optional
    /// fused norm), once the partials are in `scratch`.
    ///
    /// # Safety
    /// As [`HcPre::enqueue`], with the partial pass already enqueued.
    unsafe fn enqueue_finish(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outs: [u64; 3],
        scratch: Scratch,
        norm: Option<(u64, f32)>,
        splits: usize,
    ) -> Result<(), OpError> {
        let op = self.name();
        let metas: Vec<&TensorMeta> = inputs.iter().take(4).map(|t| t.meta).collect();
        let (n, w, k, _) =
            pre_dims(self, &metas).ok_or_else(|| OpError::shape(op, "inputs refused"))?;
        let (h, d, part) = (&inputs[0], w / self.hc, scratch.ptr);
        let ki = as_i32(op, "mixes", k)?;
        // Four collapse columns per thread (one 16-byte load a stream), all in flight at once.
        let cb = d.div_ceil(4 * PRE_FINISH_THREADS).max(1);
        let smem = (k + 1 + self.hc * self.hc) * 4;
        if smem > 48 << 10 {
            return Err(OpError::shape(
                op,
                format!(
                    "hc = {}: the finishing kernel's {smem} bytes of totals exceed shared memory",
                    self.hc
                ),
            ));
        }
        let kf = ctx.kernel(
            "hc.cu",
            HC_CU,
            &format!("hc_pre_finish_{}", hc_variant(self.hc)),
        )?;
        let n32 = u32::try_from(n).map_err(|_| OpError::shape(op, format!("{n} tokens")))?;
        // SAFETY: hc_pre_finish reads the partials written above, base (K) and scale (3),
        // and writes x (n×D), post (n×hc) and comb (n×hc×hc), all checked by check_device.
        unsafe {
            ctx.device
                .launch(&kf)
                .grid((n32, (cb + 1) as u32))
                .block(PRE_FINISH_THREADS as u32)
                .shared_mem(smem as u32)
                .arg(h.ptr)
                .arg(part)
                .arg(inputs[2].ptr)
                .arg(inputs[3].ptr)
                .arg(outs[0])
                .arg(outs[1])
                .arg(outs[2])
                .arg(as_i32(op, "hc", self.hc)?)
                .arg(as_i32(op, "D", d)?)
                .arg(ki)
                .arg(as_i32(op, "splits", splits)?)
                .arg(self.rms_eps)
                .arg(self.hc_eps)
                .arg(self.clamp)
                .arg(as_i32(op, "iters", self.sinkhorn_iters)?)
                .arg(cb as i32)
                .arg(norm.map_or(0, |(w, _)| w))
                .arg(norm.map_or(0.0, |(_, eps)| eps))
                .enqueue()
                .map_err(dev_err)
        }
    }

    /// Whether the finishing kernel can apply the RMSNorm itself: one collapse block holding
    /// all of x, one float4 a thread, 16-byte aligned streams, output and weight.
    fn norm_fuses(d: usize, ptrs: &[u64]) -> bool {
        d.is_multiple_of(4)
            && d / 4 <= PRE_FINISH_THREADS
            && ptrs.iter().all(|p| p.is_multiple_of(16))
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
        check_host(self, inputs, outputs)?;
        self.pre.cpu(&inputs[..4], outputs)?;
        let d = inputs[0].meta.shape[2];
        let w = inputs[4].f32()?;
        let x = outputs[0].f32_mut()?;
        let collapsed = x.to_vec();
        rms_norm_rows(&collapsed, Some(w), d, self.norm_eps, x);
        Ok(())
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
        check_device(self, inputs, outputs)?;
        let [x, post, comb] = outputs else {
            return Err(OpError::shape(self.name(), "expects 3 outputs"));
        };
        // SAFETY: check_device checked every input and output.
        unsafe { self.enqueue(ctx, inputs, [x.ptr, post.ptr, comb.ptr], scratch, None) }
    }
}

impl HcPreNorm {
    /// `inputs`: H (or, with `hc_post`, the H' it is to write), fn, base, scale, norm weight.
    ///
    /// # Safety
    /// `inputs` checked against [`Op::infer`], `outs` addressing the outputs' sizes, and
    /// `hc_post`'s y, H, post and comb (when given) of the shapes `HcPost` checks.
    unsafe fn enqueue(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        [x, post, comb]: [u64; 3],
        scratch: Scratch,
        hc_post: Option<[u64; 4]>,
    ) -> Result<(), OpError> {
        let (n, d) = (inputs[0].meta.shape[0], inputs[0].meta.shape[2]);
        if n == 0 {
            return Ok(());
        }
        let w = inputs[4].ptr;
        if HcPre::norm_fuses(d, &[inputs[0].ptr, x, w]) {
            // SAFETY: the caller's contract; w holds D f32.
            return unsafe {
                self.pre.enqueue(
                    ctx,
                    inputs,
                    [x, post, comb],
                    scratch,
                    Some((w, self.norm_eps)),
                    hc_post,
                )
            };
        }
        let metas: Vec<&TensorMeta> = inputs.iter().take(5).map(|t| t.meta).collect();
        let need = self.cuda_scratch_bytes(&metas);
        scratch.require("hc_pre_norm", need)?;
        let partials = self
            .pre
            .cuda_scratch_bytes(&metas[..4])
            .next_multiple_of(16);
        let collapsed = scratch.ptr + partials as u64;
        // SAFETY: as above; the collapsed x goes to the scratch past the partials (n·D f32,
        // checked against `need`), then the norm reads it into the output.
        unsafe {
            self.pre
                .enqueue(ctx, inputs, [collapsed, post, comb], scratch, None, hc_post)?;
            launch_rms_norm(ctx, collapsed, Some(w), x, n, d, self.norm_eps)
        }
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
        check_host(self, inputs, outputs)?;
        let (streams, rest) = outputs.split_at_mut(1);
        self.post.cpu(&inputs[..4], streams)?;
        let h = HostTensor {
            meta: streams[0].meta,
            data: &*streams[0].data,
        };
        let pre_inputs: Vec<HostTensor<'_>> = std::iter::once(h)
            .chain(inputs[4..].iter().cloned())
            .collect();
        self.pre_norm.cpu(&pre_inputs, rest)
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
        check_device(self, inputs, outputs)?;
        let [streams, x, post, comb] = outputs else {
            return Err(OpError::shape(self.name(), "expects 4 outputs"));
        };
        let pre_inputs: Vec<DeviceTensor<'_>> = std::iter::once(DeviceTensor {
            meta: streams.meta,
            ptr: streams.ptr,
            bytes: streams.bytes,
        })
        .chain(inputs[4..].iter().map(|t| DeviceTensor {
            meta: t.meta,
            ptr: t.ptr,
            bytes: t.bytes,
        }))
        .collect();
        let hc_post = [inputs[0].ptr, inputs[1].ptr, inputs[2].ptr, inputs[3].ptr];
        // SAFETY: check_device checked all eight inputs and four outputs; H' is an output.
        unsafe {
            self.pre_norm.enqueue(
                ctx,
                &pre_inputs,
                [x.ptr, post.ptr, comb.ptr],
                scratch,
                Some(hc_post),
            )
        }
    }
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
        check_host(self, inputs, outputs)?;
        let (hc, d) = (self.hc, inputs[1].meta.shape[2]);
        let (y, h) = (inputs[0].f32()?, inputs[1].f32()?);
        let (post, comb) = (inputs[2].f32()?, inputs[3].f32()?);
        // One task per (token, destination stream), so a single decode token still spreads.
        outputs[0]
            .f32_mut()?
            .par_chunks_mut(d)
            .enumerate()
            .for_each(|(i, o)| {
                let (t, dst) = (i / hc, i % hc);
                let row = &comb[t * hc * hc + dst * hc..t * hc * hc + (dst + 1) * hc];
                let h = &h[t * hc * d..(t + 1) * hc * d];
                hc_post_stream(&y[t * d..(t + 1) * d], h, post[t * hc + dst], row, o);
            });
        Ok(())
    }

    fn describe(&self) -> String {
        format!("hc_post(hc={})", self.hc)
    }

    /// One thread per (token, column) writing all hc destinations; bit-identical to
    /// the reference (separately rounded products and sums, in its order).
    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let (n, d) = (inputs[0].meta.shape[0], inputs[0].meta.shape[1]);
        // SAFETY: check_device checked every view against the shape rule (y n×D, H and out
        // n×hc×D, post n×hc, comb n×hc×hc).
        unsafe {
            launch_hc_post(
                ctx,
                self.hc,
                [inputs[0].ptr, inputs[1].ptr, inputs[2].ptr, inputs[3].ptr],
                outputs[0].ptr,
                n,
                d,
            )
        }
    }
}

/// Enqueues `hc_post` over `[y, H, post, comb]` into `out` for n tokens of width D.
///
/// # Safety
/// The addresses must hold y n×D, H n×hc×D, post n×hc, comb n×hc×hc and out n×hc×D f32,
/// alive until the kernel has run.
unsafe fn launch_hc_post(
    ctx: &GpuCtx,
    hc: usize,
    [y, h, post, comb]: [u64; 4],
    out: u64,
    n: usize,
    d: usize,
) -> Result<(), OpError> {
    let op = "hc_post";
    let total = n * d;
    if total == 0 {
        return Ok(());
    }
    let k = ctx.kernel("hc.cu", HC_CU, &format!("hc_post_{}", hc_variant(hc)))?;
    // SAFETY: hc_post(y, h, post, comb, out, hc, D, n·D) over the caller's buffers.
    unsafe {
        ctx.device
            .launch(&k)
            .grid(stride_grid(total))
            .block(256)
            .arg(y)
            .arg(h)
            .arg(post)
            .arg(comb)
            .arg(out)
            .arg(as_i32(op, "hc", hc)?)
            .arg(as_i32(op, "D", d)?)
            .arg(total as i64)
            .enqueue()
            .map_err(dev_err)
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
        check_host(self, inputs, outputs)?;
        let d = inputs[0].meta.shape[2];
        let h = inputs[0].f32()?;
        outputs[0]
            .f32_mut()?
            .par_chunks_mut(d)
            .zip(h.par_chunks(self.hc * d))
            .for_each(|(o, h)| stream_mean_row(h, o));
        Ok(())
    }

    fn describe(&self) -> String {
        format!("stream_mean(hc={})", self.hc)
    }

    /// Bit-identical to the reference: adds in stream order, then the 1/hc scale.
    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let total = outputs[0].meta.numel();
        if total == 0 {
            return Ok(());
        }
        let k = ctx.kernel(
            "hc.cu",
            HC_CU,
            &format!("stream_mean_{}", hc_variant(self.hc)),
        )?;
        // SAFETY: stream_mean(h, out, hc, D, n·D); check_device checked H is n×hc×D and
        // out n×D f32.
        unsafe {
            ctx.device
                .launch(&k)
                .grid(stride_grid(total))
                .block(256)
                .arg(inputs[0].ptr)
                .arg(outputs[0].ptr)
                .arg(as_i32(op, "hc", self.hc)?)
                .arg(as_i32(op, "D", inputs[0].meta.shape[2])?)
                .arg(total as i64)
                .enqueue()
                .map_err(dev_err)
        }
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;
    use proptest::prelude::*;

    use super::*;
    use crate::elementwise::testkit::*;

    /// f32 unit roundoff.
    const U: f64 = f32::EPSILON as f64 / 2.0;

    fn hc_pre_op(hc: usize) -> HcPre {
        HcPre {
            hc,
            sinkhorn_iters: 20,
            rms_eps: 1e-6,
            hc_eps: 1e-6,
            clamp: 30.0,
            kernel: HcPreKernel::Unlowered,
        }
    }

    /// Inputs of one `hc_pre` call; `fnw` holds the stored values (bf16-exact when BF16).
    struct Case {
        hc: usize,
        n: usize,
        d: usize,
        h: Vec<f32>,
        fnw: Vec<f32>,
        fn_dtype: DType,
        base: Vec<f32>,
        scale: Vec<f32>,
    }

    impl Case {
        fn random(seed: u64, hc: usize, n: usize, d: usize, fn_dtype: DType, h_mag: f32) -> Case {
            let mut r = Lcg(seed);
            let (k, w) = (2 * hc + hc * hc, hc * d);
            // Mixes of order one (f̂ has unit RMS), so S2 up to 20 reaches the ±30 clamp.
            let a = 2.0 / (w as f32).sqrt();
            let mut fnw = r.vec(k * w, -a, a);
            if fn_dtype == DType::BF16 {
                fnw.iter_mut()
                    .for_each(|v| *v = bf16::from_f32(*v).to_f32());
            }
            Case {
                hc,
                n,
                d,
                h: r.vec(n * w, -h_mag, h_mag),
                fnw,
                fn_dtype,
                base: r.vec(k, -3.0, 3.0),
                scale: vec![
                    r.uniform(-3.0, 3.0),
                    r.uniform(-3.0, 3.0),
                    r.uniform(-20.0, 20.0),
                ],
            }
        }

        fn fn_tensor(&self) -> Owned {
            let (k, w) = (2 * self.hc + self.hc * self.hc, self.hc * self.d);
            let bytes: Vec<u8> = match self.fn_dtype {
                DType::BF16 => self
                    .fnw
                    .iter()
                    .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                    .collect(),
                _ => self.fnw.iter().flat_map(|v| v.to_le_bytes()).collect(),
            };
            Owned::from_bytes(TensorMeta::new([k, w], self.fn_dtype), &bytes)
        }

        fn streams(&self) -> Owned {
            Owned::f32([self.n, self.hc, self.d], &self.h)
        }

        /// (x, post, comb) through the op.
        fn run(&self, p: &HcPre) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
            let k = 2 * self.hc + self.hc * self.hc;
            let out = run(
                p,
                &[
                    &self.streams(),
                    &self.fn_tensor(),
                    &Owned::f32([k], &self.base),
                    &Owned::f32([3], &self.scale),
                ],
            )
            .unwrap();
            (out[0].to_f32(), out[1].to_f32(), out[2].to_f32())
        }
    }

    fn sig(z: f64) -> f64 {
        1.0 / (1.0 + (-z).exp())
    }

    /// Spec §3.2–3.4 for one token in f64, with the f32 error bound of each output.
    struct RefPre {
        x: Vec<f64>,
        pre: Vec<f64>,
        post: Vec<f64>,
        comb: Vec<f64>,
        tol_x: Vec<f64>,
        tol_pre: Vec<f64>,
        tol_post: Vec<f64>,
        tol_comb: f64,
    }

    fn reference_pre(p: &HcPre, c: &Case, t: usize) -> RefPre {
        let (hc, d) = (c.hc, c.d);
        let (k, w) = (2 * hc + hc * hc, hc * d);
        let f: Vec<f64> = c.h[t * w..(t + 1) * w].iter().map(|&v| v as f64).collect();
        let r = 1.0 / (f.iter().map(|v| v * v).sum::<f64>() / w as f64 + p.rms_eps as f64).sqrt();
        let fh: Vec<f64> = f.iter().map(|v| v * r).collect();
        let (mut m, mut abs) = (vec![0f64; k], vec![0f64; k]);
        for kk in 0..k {
            for (&fw, &fh) in c.fnw[kk * w..(kk + 1) * w].iter().zip(&fh) {
                let term = fw as f64 * fh;
                m[kk] += term;
                abs[kk] += term.abs();
            }
        }
        let (b, s) = (&c.base, &c.scale);
        let z = |kk: usize, sc: f32| m[kk] * sc as f64 + b[kk] as f64;
        // f32 error of a mix: the dot's γ_w·Σ|Fn·f̂| plus ~8 roundings in forming f̂
        // (square, mean, eps, sqrt, divide, scale), all relative to the same Σ|Fn·f̂|.
        let e_z = |kk: usize, sc: f32| {
            let em = (w as f64 + 8.0) * U / (1.0 - w as f64 * U) * abs[kk];
            sc.abs() as f64 * em + 2.0 * U * (m[kk] * sc as f64).abs() + 2.0 * U * z(kk, sc).abs()
        };
        let pre: Vec<f64> = (0..hc).map(|i| sig(z(i, s[0]))).collect();
        // σ' ≤ 1/4; the f32 σ itself costs a few ulp of a value below 1.
        let tol_pre: Vec<f64> = (0..hc).map(|i| e_z(i, s[0]) / 4.0 + 4.0 * U).collect();
        let post: Vec<f64> = (0..hc).map(|i| 2.0 * sig(z(hc + i, s[1]))).collect();
        let tol_post: Vec<f64> = (0..hc).map(|i| e_z(hc + i, s[1]) / 2.0 + 8.0 * U).collect();
        let clamp = p.clamp as f64;
        let mut comb = vec![0f64; hc * hc];
        let mut e_log = 0f64;
        for dd in 0..hc {
            let l: Vec<f64> = (0..hc)
                .map(|ss| z(2 * hc + hc * dd + ss, s[2]).clamp(-clamp, clamp))
                .collect();
            let mx = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            for ss in 0..hc {
                comb[hc * dd + ss] = (l[ss] - mx).exp();
                // Error in the exponent: the logit's, the row max's, the subtraction's and exp's.
                let e =
                    2.0 * e_z(2 * hc + hc * dd + ss, s[2]) + U * (2.0 * (l[ss] - mx).abs() + 4.0);
                e_log = e_log.max(e);
            }
        }
        for _ in 0..p.sinkhorn_iters {
            for dd in 0..hc {
                let den = (0..hc).map(|ss| comb[hc * dd + ss]).sum::<f64>() + p.hc_eps as f64;
                (0..hc).for_each(|ss| comb[hc * dd + ss] /= den);
            }
            for ss in 0..hc {
                let den = (0..hc).map(|dd| comb[hc * dd + ss]).sum::<f64>() + p.hc_eps as f64;
                (0..hc).for_each(|dd| comb[hc * dd + ss] /= den);
            }
        }
        // Each normalisation divides by a weighted mean of the entries it scales, so a
        // relative perturbation of the entries is carried, not amplified (a few times
        // e_log at most), and each of the 2·iters normalisations adds ~(hc + 2) roundings.
        // Entries are at most ~1, so relative and absolute coincide.
        let tol_comb = 4.0 * e_log + 2.0 * p.sinkhorn_iters as f64 * (hc as f64 + 2.0) * U + 1e-7;
        let hs = |ss: usize, i: usize| c.h[t * w + ss * d + i] as f64;
        let x: Vec<f64> = (0..d)
            .map(|i| (0..hc).map(|ss| pre[ss] * hs(ss, i)).sum())
            .collect();
        let tol_x = (0..d)
            .map(|i| {
                (0..hc)
                    .map(|ss| hs(ss, i).abs() * (tol_pre[ss] + (hc as f64 + 1.0) * U * pre[ss]))
                    .sum()
            })
            .collect();
        RefPre {
            x,
            pre,
            post,
            comb,
            tol_x,
            tol_pre,
            tol_post,
            tol_comb,
        }
    }

    /// Compares one `hc_pre` run with the f64 reference; the `pre` gates are only
    /// visible through `x`, so they are checked by recomputing them from the f32 path.
    fn check_pre_against_f64(p: &HcPre, c: &Case) -> Result<(), TestCaseError> {
        let (hc, d) = (c.hc, c.d);
        let (x, post, comb) = c.run(p);
        for t in 0..c.n {
            let r = reference_pre(p, c, t);
            for i in 0..d {
                let got = x[t * d + i] as f64;
                prop_assert!(
                    got.is_finite() && (got - r.x[i]).abs() <= r.tol_x[i],
                    "x[{t}][{i}] = {got}, f64 {} (tol {:e})",
                    r.x[i],
                    r.tol_x[i]
                );
            }
            for i in 0..hc {
                let got = post[t * hc + i] as f64;
                prop_assert!(
                    (got - r.post[i]).abs() <= r.tol_post[i],
                    "post[{t}][{i}] = {got}, f64 {} (tol {:e})",
                    r.post[i],
                    r.tol_post[i]
                );
            }
            for i in 0..hc * hc {
                let got = comb[t * hc * hc + i] as f64;
                prop_assert!(
                    got >= 0.0 && (got - r.comb[i]).abs() <= r.tol_comb,
                    "comb[{t}][{i}] = {got}, f64 {} (tol {:e})",
                    r.comb[i],
                    r.tol_comb
                );
            }
            prop_assert!(
                r.pre
                    .iter()
                    .zip(&r.tol_pre)
                    .all(|(p, e)| *p > -e && *p < 1.0 + e)
            );
        }
        Ok(())
    }

    fn pick_hc(i: usize) -> usize {
        [1, 2, 4][i]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn hc_pre_matches_an_f64_reading_of_the_spec(
            seed in any::<u64>(),
            hc_i in 0usize..3,
            d in 1usize..48,
            n in 1usize..4,
            bf in any::<bool>(),
            mag_exp in 0i32..6,
            iters in prop::sample::select(vec![0usize, 1, 20]),
            rms_eps in prop::sample::select(vec![1e-6f32, 0.5]),
            hc_eps in prop::sample::select(vec![1e-6f32, 0.05]),
            clamp in prop::sample::select(vec![30f32, 4.0]),
        ) {
            // Besides the model's parameters, large epsilons and a tight clamp, so that
            // where ε enters (denominators only; none in `pre`) and the clamp are visible
            // far above the f32 tolerance.
            let dtype = if bf { DType::BF16 } else { DType::F32 };
            let c = Case::random(seed, pick_hc(hc_i), n, d, dtype, 10f32.powi(mag_exp));
            let p = HcPre { hc: c.hc, sinkhorn_iters: iters, rms_eps, hc_eps, clamp, kernel: HcPreKernel::Unlowered };
            check_pre_against_f64(&p, &c)?;
        }

        #[test]
        fn hc_post_matches_f64_within_the_rounding_of_its_sum(
            seed in any::<u64>(),
            hc_i in 0usize..3,
            d in 1usize..48,
            n in 1usize..4,
        ) {
            let hc = pick_hc(hc_i);
            let c = Case::random(seed, hc, n, d, DType::F32, 100.0);
            let (_, post, comb) = c.run(&hc_pre_op(hc));
            let y = Lcg(seed ^ 0x5eed).vec(n * d, -50.0, 50.0);
            let out = run(&HcPost { hc }, &[
                &Owned::f32([n, d], &y),
                &c.streams(),
                &Owned::f32([n, hc], &post),
                &Owned::f32([n, hc, hc], &comb),
            ]).unwrap()[0].to_f32();
            for t in 0..n {
                for dst in 0..hc {
                    for i in 0..d {
                        let terms: Vec<f64> = std::iter::once(post[t * hc + dst] as f64 * y[t * d + i] as f64)
                            .chain((0..hc).map(|s| {
                                comb[t * hc * hc + hc * dst + s] as f64 * c.h[(t * hc + s) * d + i] as f64
                            }))
                            .collect();
                        let want: f64 = terms.iter().sum();
                        // hc + 1 products and hc adds in f32: γ_{hc+1}·Σ|terms|.
                        let tol = (hc as f64 + 2.0) * U * terms.iter().map(|v| v.abs()).sum::<f64>();
                        let got = out[(t * hc + dst) * d + i] as f64;
                        prop_assert!((got - want).abs() <= tol, "H'[{t}][{dst}][{i}] = {got}, f64 {want}");
                    }
                }
            }
        }

        #[test]
        fn stream_mean_matches_f64(seed in any::<u64>(), hc_i in 0usize..3, d in 1usize..48, n in 1usize..4) {
            let hc = pick_hc(hc_i);
            let h = Lcg(seed).vec(n * hc * d, -1e5, 1e5);
            let out = run(&StreamMean { hc }, &[&Owned::f32([n, hc, d], &h)]).unwrap()[0].to_f32();
            for t in 0..n {
                for i in 0..d {
                    let vals = (0..hc).map(|s| h[(t * hc + s) * d + i] as f64);
                    let want = vals.clone().sum::<f64>() / hc as f64;
                    let tol = (hc as f64 + 1.0) * U * vals.map(f64::abs).sum::<f64>() / hc as f64;
                    prop_assert!((out[t * d + i] as f64 - want).abs() <= tol);
                }
            }
        }
    }

    /// Largest |column sum − 1| and |row sum − 1| of the comb matrices over 50
    /// random tokens whose comb logits are `base` drawn from ±`range`.
    fn stochastic_defects(range: f32) -> (f64, f64) {
        let p = hc_pre_op(4);
        let mut worst = (0f64, 0f64);
        for seed in 0..50 {
            let mut c = Case::random(seed, 4, 2, 64, DType::BF16, 1.0);
            c.scale[2] = 0.0;
            let mut r = Lcg(seed + 1000);
            c.base[8..]
                .iter_mut()
                .for_each(|b| *b = r.uniform(-range, range));
            let (_, _, comb) = c.run(&p);
            for m in comb.chunks_exact(16) {
                for j in 0..4 {
                    let col: f64 = (0..4).map(|i| m[4 * i + j] as f64).sum();
                    let row: f64 = (0..4).map(|s| m[4 * j + s] as f64).sum();
                    worst = (
                        worst.0.max((col - 1.0).abs()),
                        worst.1.max((row - 1.0).abs()),
                    );
                }
            }
        }
        worst
    }

    #[test]
    fn sinkhorn_output_is_doubly_stochastic() {
        // Logits within ±1: 20 iterations converge, rows and columns sum to 1 − O(ε).
        let (col, row) = stochastic_defects(1.0);
        assert!(col <= 1e-5 && row <= 1e-5, "column {col:e}, row {row:e}");
    }

    #[test]
    fn sinkhorn_columns_sum_to_one_even_where_rows_have_not_converged() {
        // The last normalisation is over destinations, so columns sum to S/(S + ε)
        // whatever the logits; with logits over ±3, 20 iterations leave rows off by up
        // to ~1e-2 (an f64 run of the same recurrence over 3000 draws: 9.2e-3).
        let (col, row) = stochastic_defects(3.0);
        assert!(col <= 1e-5, "column {col:e}");
        assert!(row <= 2e-2, "row {row:e}");
    }

    /// Streams `e_s` (stream `s` is the unit vector along `s`) and `fn = 0`, so the
    /// logits are exactly `base`.
    fn unit_streams_case(comb_base: &[(usize, usize, f32)]) -> Case {
        let hc = 4;
        let mut h = vec![0f32; hc * hc];
        (0..hc).for_each(|s| h[s * hc + s] = 1.0);
        let mut base = vec![0f32; 24];
        for &(d, s, v) in comb_base {
            base[8 + 4 * d + s] = v;
        }
        Case {
            hc,
            n: 1,
            d: hc,
            h,
            fnw: vec![0.0; 24 * 16],
            fn_dtype: DType::F32,
            base,
            scale: vec![1.0, 1.0, 1.0],
        }
    }

    #[test]
    fn comb_flat_index_4d_plus_s_moves_source_s_into_destination_d() {
        // Only the logit at 4·d + s for (d, s) = (1, 3) is large: stream 3 must land in
        // stream 1. The transposed reading would put stream 1 into stream 3 instead.
        let c = unit_streams_case(&[(1, 3, 20.0)]);
        let (_, post, comb) = c.run(&hc_pre_op(4));
        // A lone large logit makes Sinkhorn converge slowly (the limit has zeros):
        // after 20 iterations the weight is ~0.96, not 1.
        assert!(comb[4 + 3] > 0.9 && comb[4 * 3 + 1] < 0.5, "comb {comb:?}");
        let new = run(
            &HcPost { hc: 4 },
            &[
                &Owned::f32([1, 4], &[0.0; 4]),
                &c.streams(),
                &Owned::f32([1, 4], &post),
                &Owned::f32([1, 4, 4], &comb),
            ],
        )
        .unwrap()[0]
            .to_f32();
        let stream = |d: usize| &new[4 * d..4 * d + 4];
        assert!(stream(1)[3] > 0.9, "stream 1 = {:?}", stream(1));
        assert!(
            stream(1)[..3].iter().all(|v| *v < 0.01),
            "stream 1 = {:?}",
            stream(1)
        );
        assert!(stream(3)[1] < 0.5, "stream 3 = {:?}", stream(3));
    }

    #[test]
    fn comb_logits_beyond_the_clamp_act_as_the_clamp() {
        let beyond = unit_streams_case(&[(0, 2, 50.0), (2, 1, -45.0), (3, 3, 31.0)]);
        let at = unit_streams_case(&[(0, 2, 30.0), (2, 1, -30.0), (3, 3, 30.0)]);
        let p = hc_pre_op(4);
        let (b, a) = (beyond.run(&p), at.run(&p));
        assert_eq!(
            b.2.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            a.2.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!((b.0, b.1), (a.0, a.1));
        // Without the clamp the same logits give another matrix: the clamp is doing work.
        let loose = HcPre { clamp: 1000.0, ..p };
        assert_ne!(beyond.run(&loose).2, a.2);
    }

    #[test]
    fn the_residual_stream_is_wider_than_the_sublayer_post_keeps_values_beyond_f16() {
        // Every value here is an exact f32 integer, so the f32 result is exact; 2e5 + 75000
        // is far outside f16 (65504), the width that produced NaN in the seed's §2.
        let (hc, d) = (4, 8);
        let y = vec![1e5f32; d];
        let h: Vec<f32> = (0..hc)
            .flat_map(|s| vec![6e4 + 1e4 * s as f32; d])
            .collect();
        let post = [1.5f32, 2.0, 0.5, 1.0];
        let out = run(
            &HcPost { hc },
            &[
                &Owned::f32([1, d], &y),
                &Owned::f32([1, hc, d], &h),
                &Owned::f32([1, hc], &post),
                &Owned::f32([1, hc, hc], &[0.25; 16]),
            ],
        )
        .unwrap()[0]
            .to_f32();
        for (dst, p) in post.iter().enumerate() {
            let want = p * 1e5 + 0.25 * (6e4 + 7e4 + 8e4 + 9e4);
            assert!(
                out[dst * d..(dst + 1) * d].iter().all(|v| *v == want),
                "stream {dst}"
            );
        }
        assert!(out.iter().all(|v| *v > 65504.0));
    }

    #[test]
    fn the_residual_stream_is_wider_than_the_sublayer_pre_collapses_large_streams_like_f64() {
        let p = hc_pre_op(4);
        for seed in 0..8 {
            let mut c = Case::random(seed, 4, 2, 64, DType::BF16, 1.0);
            let mut r = Lcg(seed + 100);
            // |H| in [6e4, 1e5], random sign: beyond f16 in every element.
            c.h.iter_mut()
                .for_each(|v| *v = r.uniform(6e4, 1e5).copysign(r.uniform(-1.0, 1.0)));
            check_pre_against_f64(&p, &c).unwrap();
            // The narrow half: what the sub-layer is handed after its norm is O(1).
            let (x, _, _) = c.run(&p);
            let mut y = vec![0f32; x.len()];
            rms_norm_rows(&x, None, c.d, 1e-6, &mut y);
            assert!(y.iter().all(|v| v.abs() <= (c.d as f32).sqrt()));
        }
    }

    #[test]
    fn stream_mean_adds_streams_in_order_then_scales() {
        // ((1e8 + −1e8) + 1) + 0 = 1 → 0.25; a pairwise order would give (1e8+1) − 1e8 = 0.
        let out = run(
            &StreamMean { hc: 4 },
            &[&Owned::f32([1, 4, 1], &[1e8, -1e8, 1.0, 0.0])],
        )
        .unwrap();
        assert_eq!(out[0].to_f32(), vec![0.25]);
    }

    #[test]
    fn hc_expand_copies_the_row_into_every_stream() {
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        for hc in [1, 2, 4] {
            let out = run(&HcExpand { hc }, &[&Owned::f32([2, 3], &x)]).unwrap()[0].to_f32();
            for t in 0..2 {
                for s in 0..hc {
                    assert_eq!(
                        out[(t * hc + s) * 3..(t * hc + s + 1) * 3],
                        x[t * 3..t * 3 + 3]
                    );
                }
            }
        }
    }

    #[test]
    fn hc_pre_with_zero_iterations_leaves_the_row_softmax_numerators() {
        // iters = 0: comb is exp(L − rowmax), un-normalised (spec §3.3).
        let c = unit_streams_case(&[(0, 1, 2.0), (0, 2, -1.0)]);
        let (_, _, comb) = c.run(&HcPre {
            sinkhorn_iters: 0,
            ..hc_pre_op(4)
        });
        let want = [(-2f32).exp(), 1.0, (-3f32).exp(), (-2f32).exp()];
        assert_eq!(&comb[..4], &want);
        assert!(comb[4..].iter().all(|v| *v == 1.0));
    }

    #[test]
    fn hc_ops_refuse_wrong_widths_types_and_stream_counts() {
        let p = hc_pre_op(4);
        let good = [
            TensorMeta::f32([2, 4, 8]),
            TensorMeta::new([24, 32], DType::BF16),
            TensorMeta::f32([24]),
            TensorMeta::f32([3]),
        ];
        assert_eq!(
            infer(&p, &good),
            Ok(vec![
                TensorMeta::f32([2, 8]),
                TensorMeta::f32([2, 4]),
                TensorMeta::f32([2, 4, 4])
            ])
        );
        let bad = |i: usize, m: TensorMeta| {
            let mut v = good.to_vec();
            v[i] = m;
            v
        };
        for metas in [
            bad(0, TensorMeta::f32([2, 2, 8])), // 2 streams for hc = 4
            bad(0, TensorMeta::new([2, 4, 8], DType::BF16)), // narrow streams
            bad(1, TensorMeta::new([24, 31], DType::BF16)), // fn width ≠ hc·D
            bad(1, TensorMeta::new([16, 32], DType::BF16)), // "4 streams × 4" rows
            bad(1, TensorMeta::new([24, 32], DType::Q8_0)), // quantized fn
            bad(2, TensorMeta::f32([16])),
            bad(3, TensorMeta::f32([2])),
        ] {
            let e = infer(&p, &metas).unwrap_err();
            assert!(matches!(e, OpError::Shape { op: "hc_pre", .. }), "{e}");
        }
        assert!(
            infer(
                &HcPre {
                    clamp: f32::NAN,
                    ..p.clone()
                },
                &good
            )
            .is_err()
        );
        assert!(infer(&HcPre { hc: 0, ..p.clone() }, &good).is_err());

        let post = HcPost { hc: 4 };
        let good = [
            TensorMeta::f32([2, 8]),
            TensorMeta::f32([2, 4, 8]),
            TensorMeta::f32([2, 4]),
            TensorMeta::f32([2, 4, 4]),
        ];
        assert_eq!(infer(&post, &good), Ok(vec![TensorMeta::f32([2, 4, 8])]));
        for (i, m) in [
            (0, TensorMeta::f32([2, 9])),
            (0, TensorMeta::new([2, 8], DType::BF16)),
            (2, TensorMeta::f32([2, 3])),
            (3, TensorMeta::f32([2, 16])),
        ] {
            let mut v = good.to_vec();
            v[i] = m;
            let e = infer(&post, &v).unwrap_err();
            assert!(matches!(e, OpError::Shape { op: "hc_post", .. }), "{e}");
        }
        let e = infer(&StreamMean { hc: 4 }, &[TensorMeta::f32([2, 2, 8])]).unwrap_err();
        assert!(
            matches!(
                e,
                OpError::Shape {
                    op: "stream_mean",
                    ..
                }
            ),
            "{e}"
        );
        let e = infer(&HcExpand { hc: 4 }, &[TensorMeta::f32([2, 4, 8])]).unwrap_err();
        assert!(
            matches!(
                e,
                OpError::Shape {
                    op: "hc_expand",
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn describe_lines_name_every_parameter() {
        assert_eq!(
            hc_pre_op(4).describe(),
            "hc_pre(hc=4, iters=20, rms_eps=1e-6, hc_eps=1e-6, clamp=30)"
        );
        assert_eq!(HcPost { hc: 2 }.describe(), "hc_post(hc=2)");
        assert_eq!(StreamMean { hc: 4 }.describe(), "stream_mean(hc=4)");
        assert_eq!(HcExpand { hc: 1 }.describe(), "hc_expand(hc=1)");
    }
}
