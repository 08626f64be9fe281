//! CPU references of the hyper-connection ops.

use rayon::prelude::*;

use super::{HcExpand, HcPost, HcPostPreNorm, HcPre, HcPreNorm, HcRoutedPostPreNorm, StreamMean};
use crate::cpu::matmul;
use crate::norm::rms_norm_rows;
use crate::op::check_host;
use crate::tensor::{AlignedBuf, DType, HostTensor, HostTensorMut};
use crate::{Op, OpError};

pub(super) fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// Clamps to `[-c, c]` letting NaN through (`f32::clamp` panics on a NaN
/// bound; `max`/`min` would turn a NaN logit into a finite one).
pub(super) fn clamp_logit(l: f32, c: f32) -> f32 {
    if l > c {
        c
    } else if l < -c {
        -c
    } else {
        l
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
pub(super) fn hc_post_stream(y: &[f32], h: &[f32], post: f32, comb_row: &[f32], o: &mut [f32]) {
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

impl HcExpand {
    pub(super) fn cpu_ref(
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
}

impl HcPre {
    pub(super) fn cpu_ref(
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
}

impl HcPreNorm {
    pub(super) fn cpu_ref(
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
}

impl HcPostPreNorm {
    pub(super) fn cpu_ref(
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
}

impl HcRoutedPostPreNorm {
    /// The chain it replaces: the top-k sum into a buffer, then the boundary over it.
    pub(super) fn cpu_ref(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let metas: Vec<_> = inputs[..4].iter().map(|t| t.meta).collect();
        let y_meta = self.sum.infer(&metas)?.remove(0);
        let mut y = AlignedBuf::zeroed(y_meta.bytes().unwrap_or(0));
        self.sum.cpu(
            &inputs[..4],
            &mut [HostTensorMut::new(&y_meta, y.bytes_mut())],
        )?;
        let boundary: Vec<HostTensor<'_>> = std::iter::once(HostTensor::new(&y_meta, y.bytes()))
            .chain(inputs[4..].iter().cloned())
            .collect();
        self.boundary.cpu(&boundary, outputs)
    }
}

impl HcPost {
    pub(super) fn cpu_ref(
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
}

impl StreamMean {
    pub(super) fn cpu_ref(
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
}
