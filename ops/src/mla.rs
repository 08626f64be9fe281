//! Multi-head latent attention in the absorbed form over a latent cache (spec §3.5, §5).
//!
//! Per token the cache holds one `W = kv_lora + qk_rope` row: the normalised latent ‖ the
//! roped shared key. Queries are mapped into the latent (`Kb`) so every head scores against
//! the same rows, and the value is the latent part of those rows, mapped out by `Vb`.

use rayon::prelude::*;

use crate::cpu::{dot, matmul};
use crate::rope::{RopeParams, rope_norm_cached};
use crate::tensor::{DType, HostTensor, HostTensorMut, TensorMeta};
use crate::{Op, OpError};

// ---- validation shared with the MoE ops ---------------------------------------------

pub(crate) fn expect_inputs(
    op: &'static str,
    inputs: &[&TensorMeta],
    n: usize,
) -> Result<(), OpError> {
    if inputs.len() != n {
        return Err(OpError::shape(
            op,
            format!("takes {n} inputs, got {}", inputs.len()),
        ));
    }
    Ok(())
}

pub(crate) fn expect(
    op: &'static str,
    what: &str,
    m: &TensorMeta,
    dtype: DType,
    shape: &[usize],
) -> Result<(), OpError> {
    if m.dtype != dtype || m.shape != shape {
        return Err(OpError::shape(
            op,
            format!(
                "{what} must be {}, found {m}",
                TensorMeta::new(shape, dtype)
            ),
        ));
    }
    Ok(())
}

pub(crate) fn nonzero(op: &'static str, params: &[(&str, usize)]) -> Result<(), OpError> {
    for (name, v) in params {
        if *v == 0 {
            return Err(OpError::shape(op, format!("{name} must be > 0")));
        }
    }
    Ok(())
}

/// A weight of `shape` in any stored type whose rows are whole blocks.
pub(crate) fn expect_weight(
    op: &'static str,
    what: &str,
    m: &TensorMeta,
    shape: &[usize],
) -> Result<(), OpError> {
    if m.shape != shape || m.dtype == DType::I32 || m.bytes().is_none() {
        return Err(OpError::shape(
            op,
            format!("{what} must be a weight of shape {shape:?} with whole-block rows, found {m}"),
        ));
    }
    Ok(())
}

/// Re-runs the shape rule on the actual views so the kernels can index without panicking.
pub(crate) fn check_views(
    op: &dyn Op,
    inputs: &[HostTensor<'_>],
    outputs: &[HostTensorMut<'_>],
) -> Result<(), OpError> {
    let metas: Vec<&TensorMeta> = inputs.iter().map(|t| t.meta).collect();
    let want = op.infer(&metas)?;
    if want.len() != outputs.len() {
        return Err(OpError::Type(format!(
            "{} writes {} outputs, given {}",
            op.name(),
            want.len(),
            outputs.len()
        )));
    }
    for (w, o) in want.iter().zip(outputs) {
        if w != o.meta {
            return Err(OpError::Type(format!(
                "{} output must be {w}, given {}",
                op.name(),
                o.meta
            )));
        }
    }
    Ok(())
}

/// The stored bytes of a weight view, checked against its metadata.
pub(crate) fn weight_bytes<'a>(t: &HostTensor<'a>) -> Result<&'a [u8], OpError> {
    let need = t
        .meta
        .bytes()
        .ok_or_else(|| OpError::Type(format!("{} rows are not whole blocks", t.meta)))?;
    t.data.get(..need).ok_or_else(|| {
        OpError::Type(format!(
            "{} needs {need} bytes, buffer has {}",
            t.meta,
            t.data.len()
        ))
    })
}

fn check_positions(op: &'static str, positions: &[i32], ctx: usize) -> Result<(), OpError> {
    for (i, &p) in positions.iter().enumerate() {
        if p < 0 || p as usize >= ctx {
            return Err(OpError::data(
                op,
                format!("position {p} of token {i} is outside the cache [0, {ctx})"),
            ));
        }
    }
    Ok(())
}

/// `y_h = W_h · x_h` for every head `h`, where `W_h` is head `h`'s `[n_out, n_in]` slice of a
/// `[n_head, n_out, n_in]` weight and `x_h[t] = x[(t·n_head + h)·stride ..][..n_in]`.
/// Returns one `[n_tok, n_out]` buffer per head.
#[allow(clippy::too_many_arguments)]
fn per_head_matmul(
    w: &[u8],
    dtype: DType,
    n_head: usize,
    n_out: usize,
    n_in: usize,
    x: &[f32],
    stride: usize,
    n_tok: usize,
) -> Result<Vec<Vec<f32>>, OpError> {
    let head_bytes = dtype
        .row_bytes(n_in)
        .ok_or_else(|| OpError::Type(format!("{dtype} rows of {n_in} are not whole blocks")))?
        * n_out;
    if n_in > stride || w.len() < n_head * head_bytes || x.len() < n_tok * n_head * stride {
        return Err(OpError::Type(format!(
            "per-head weight has {} bytes (need {}), input {} values (need {})",
            w.len(),
            n_head * head_bytes,
            x.len(),
            n_tok * n_head * stride
        )));
    }
    (0..n_head)
        .into_par_iter()
        .map(|h| {
            let mut xh = Vec::with_capacity(n_tok * n_in);
            for t in 0..n_tok {
                let s = (t * n_head + h) * stride;
                xh.extend_from_slice(&x[s..s + n_in]);
            }
            let mut y = vec![0f32; n_tok * n_out];
            matmul(
                &w[h * head_bytes..(h + 1) * head_bytes],
                dtype,
                n_out,
                n_in,
                &xh,
                n_tok,
                &mut y,
            )?;
            Ok(y)
        })
        .collect()
}

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
}

impl MlaQuery {
    /// Slice-level form of the op; `out` is `n × n_head × (kv_lora+qk_rope)`.
    pub fn compute(
        &self,
        q: &[f32],
        k_b: &[u8],
        k_b_dtype: DType,
        positions: &[i32],
        out: &mut [f32],
    ) -> Result<(), OpError> {
        let n = positions.len();
        let qk = self.qk_nope + self.qk_rope;
        let w = self.kv_lora + self.qk_rope;
        if q.len() < n * self.n_head * qk || out.len() < n * self.n_head * w {
            return Err(OpError::Type(format!(
                "mla_query buffers too small for {n} tokens: q {}, out {}",
                q.len(),
                out.len()
            )));
        }
        let lat = per_head_matmul(
            k_b,
            k_b_dtype,
            self.n_head,
            self.kv_lora,
            self.qk_nope,
            q,
            qk,
            n,
        )?;
        out[..n * self.n_head * w]
            .par_chunks_mut(self.n_head * w)
            .zip(positions.par_iter())
            .enumerate()
            .for_each(|(t, (row, &pos))| {
                let mut cache = vec![0f32; self.rope.n_rot];
                self.rope.cos_sin(pos, &mut cache);
                for (h, dst) in row.chunks_exact_mut(w).enumerate() {
                    let (dl, dr) = dst.split_at_mut(self.kv_lora);
                    dl.copy_from_slice(&lat[h][t * self.kv_lora..(t + 1) * self.kv_lora]);
                    let s = (t * self.n_head + h) * qk + self.qk_nope;
                    dr.copy_from_slice(&q[s..s + self.qk_rope]);
                    rope_norm_cached(dr, &cache);
                }
            });
        Ok(())
    }
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
        check_views(self, inputs, outputs)?;
        let q = inputs[0].f32()?;
        let k_b = weight_bytes(&inputs[1])?;
        let pos = inputs[2].i32()?;
        self.compute(q, k_b, inputs[1].meta.dtype, pos, outputs[0].f32_mut()?)
    }

    fn describe(&self) -> String {
        format!(
            "mla_query n_head={} qk_nope={} qk_rope={} kv_lora={} {}",
            self.n_head, self.qk_nope, self.qk_rope, self.kv_lora, self.rope
        )
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

impl MlaKv {
    /// Slice-level form of the op.
    pub fn compute(
        &self,
        kv: &[f32],
        norm_w: &[f32],
        positions: &[i32],
        out: &mut [f32],
    ) -> Result<(), OpError> {
        let n = positions.len();
        let w = self.kv_lora + self.qk_rope;
        if kv.len() < n * w || out.len() < n * w || norm_w.len() < self.kv_lora {
            return Err(OpError::Type(format!(
                "mla_kv buffers too small for {n} tokens: kv {}, norm_w {}, out {}",
                kv.len(),
                norm_w.len(),
                out.len()
            )));
        }
        out[..n * w]
            .par_chunks_mut(w)
            .zip(kv[..n * w].par_chunks(w))
            .zip(positions.par_iter())
            .for_each(|((dst, src), &pos)| {
                let (dl, dr) = dst.split_at_mut(self.kv_lora);
                let (sl, sr) = src.split_at(self.kv_lora);
                // As ggml's rms_norm: squares in f32, their sum in f64, the scale in f32.
                let sum: f64 = sl.iter().map(|&x| (x * x) as f64).sum();
                let mean = (sum / self.kv_lora as f64) as f32;
                let scale = 1.0 / (mean + self.eps).sqrt();
                for ((d, &x), &g) in dl.iter_mut().zip(sl).zip(norm_w) {
                    *d = (x * scale) * g;
                }
                dr.copy_from_slice(sr);
                let mut cache = vec![0f32; self.rope.n_rot];
                self.rope.cos_sin(pos, &mut cache);
                rope_norm_cached(dr, &cache);
            });
        Ok(())
    }
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
        check_views(self, inputs, outputs)?;
        let kv = inputs[0].f32()?;
        let w = inputs[1].f32()?;
        let pos = inputs[2].i32()?;
        self.compute(kv, w, pos, outputs[0].f32_mut()?)
    }

    fn describe(&self) -> String {
        format!(
            "mla_kv kv_lora={} qk_rope={} eps={:?} {}",
            self.kv_lora, self.qk_rope, self.eps, self.rope
        )
    }
}

// ---- KvCacheWrite --------------------------------------------------------------------

/// Writes `cache[positions[i]] = k[i]` in place.
///
/// Inputs: cache F32 `[ctx, W]` (persistent; aliased by output 0), k F32 `[n, W]`,
/// positions I32 `[n]`. Output: the cache. A position outside `[0, ctx)` is an
/// `OpError::Data` and nothing is written.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct KvCacheWrite;

impl KvCacheWrite {
    /// Slice-level form: `cache` is `ctx × w`.
    pub fn compute(
        cache: &mut [f32],
        w: usize,
        k: &[f32],
        positions: &[i32],
    ) -> Result<(), OpError> {
        let ctx = cache.len().checked_div(w).unwrap_or(0);
        check_positions("kv_cache_write", positions, ctx)?;
        if k.len() < positions.len() * w {
            return Err(OpError::Type(format!(
                "kv_cache_write: k has {} values, {} rows of {w} needed",
                k.len(),
                positions.len()
            )));
        }
        for (i, &p) in positions.iter().enumerate() {
            let p = p as usize;
            cache[p * w..(p + 1) * w].copy_from_slice(&k[i * w..(i + 1) * w]);
        }
        Ok(())
    }
}

impl Op for KvCacheWrite {
    fn name(&self) -> &'static str {
        "kv_cache_write"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        expect_inputs(op, inputs, 3)?;
        let cache = inputs[0];
        if cache.dtype != DType::F32 || cache.shape.len() != 2 || cache.shape[1] == 0 {
            return Err(OpError::shape(
                op,
                format!("cache must be F32[ctx, W] with W > 0, found {cache}"),
            ));
        }
        let w = cache.shape[1];
        let n = inputs[2].shape.first().copied().unwrap_or(0);
        expect(op, "positions", inputs[2], DType::I32, &[n])?;
        expect(op, "k", inputs[1], DType::F32, &[n, w])?;
        Ok(vec![cache.clone()])
    }

    /// Reads only inputs 1 and 2: input 0 is the same storage as the output.
    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_views(self, inputs, outputs)?;
        let w = outputs[0].meta.inner();
        let k = inputs[1].f32()?;
        let pos = inputs[2].i32()?;
        Self::compute(outputs[0].f32_mut()?, w, k, pos)
    }

    fn describe(&self) -> String {
        "kv_cache_write".to_string()
    }

    fn aliases(&self) -> &'static [(usize, usize)] {
        &[(0, 0)]
    }
}

// ---- MlaAttention --------------------------------------------------------------------

/// Causal attention of every head over the shared latent cache.
///
/// Inputs: Q F32 `[n, n_head, W]`, cache F32 `[ctx, W]`, positions I32 `[n]`.
/// Output: o_lat F32 `[n, n_head, kv_lora]`. Query `i` reads rows `0..=positions[i]`; rows
/// past it are never read, so `ctx` may be any bucket larger than the last position.
#[derive(Clone, Debug, PartialEq)]
pub struct MlaAttention {
    pub n_head: usize,
    pub kv_lora: usize,
    pub kq_scale: f32,
}

impl MlaAttention {
    /// Slice-level form: `q` is `n × n_head × w`, `cache` is `ctx × w`, `out` is
    /// `n × n_head × kv_lora`, with `w = cache.len() / ctx`.
    pub fn compute(
        &self,
        q: &[f32],
        cache: &[f32],
        w: usize,
        positions: &[i32],
        out: &mut [f32],
    ) -> Result<(), OpError> {
        let n = positions.len();
        let (nh, lora) = (self.n_head, self.kv_lora);
        if w < lora || lora == 0 || q.len() < n * nh * w || out.len() < n * nh * lora {
            return Err(OpError::Type(format!(
                "mla_attention buffers do not fit {n} tokens × {nh} heads of width {w} \
                 (kv_lora {lora}): q {}, out {}",
                q.len(),
                out.len()
            )));
        }
        let ctx = cache.len() / w;
        check_positions("mla_attention", positions, ctx)?;
        out[..n * nh * lora]
            .par_chunks_mut(lora)
            .enumerate()
            .for_each(|(ih, o)| {
                let qv = &q[ih * w..(ih + 1) * w];
                let rows = positions[ih / nh] as usize + 1;
                let mut p: Vec<f32> = cache[..rows * w]
                    .chunks_exact(w)
                    .map(|k| self.kq_scale * dot(qv, k))
                    .collect();
                let max = p.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
                // The denominator is summed in f64, as ggml's soft_max does: at long contexts
                // a sequential f32 sum of ~1e5 terms would drift by far more than f32 rounding.
                let mut sum = 0f64;
                for s in p.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s as f64;
                }
                let inv = (1.0 / sum) as f32;
                o.fill(0.0);
                for (pt, k) in p.iter().zip(cache.chunks_exact(w)) {
                    let pt = pt * inv;
                    for (a, &v) in o.iter_mut().zip(&k[..lora]) {
                        *a += pt * v;
                    }
                }
            });
        Ok(())
    }
}

impl Op for MlaAttention {
    fn name(&self) -> &'static str {
        "mla_attention"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        nonzero(op, &[("n_head", self.n_head), ("kv_lora", self.kv_lora)])?;
        expect_inputs(op, inputs, 3)?;
        let cache = inputs[1];
        if cache.dtype != DType::F32 || cache.shape.len() != 2 || cache.shape[1] < self.kv_lora {
            return Err(OpError::shape(
                op,
                format!(
                    "cache must be F32[ctx, W] with W >= kv_lora {}, found {cache}",
                    self.kv_lora
                ),
            ));
        }
        let w = cache.shape[1];
        let n = inputs[2].shape.first().copied().unwrap_or(0);
        expect(op, "positions", inputs[2], DType::I32, &[n])?;
        expect(op, "Q", inputs[0], DType::F32, &[n, self.n_head, w])?;
        Ok(vec![TensorMeta::f32([n, self.n_head, self.kv_lora])])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_views(self, inputs, outputs)?;
        let w = inputs[1].meta.inner();
        let q = inputs[0].f32()?;
        let cache = inputs[1].f32()?;
        let pos = inputs[2].i32()?;
        self.compute(q, cache, w, pos, outputs[0].f32_mut()?)
    }

    fn describe(&self) -> String {
        format!(
            "mla_attention n_head={} kv_lora={} kq_scale={:?}",
            self.n_head, self.kv_lora, self.kq_scale
        )
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
}

impl MlaValueOut {
    /// Slice-level form of the op.
    pub fn compute(
        &self,
        o_lat: &[f32],
        v_b: &[u8],
        v_b_dtype: DType,
        n: usize,
        out: &mut [f32],
    ) -> Result<(), OpError> {
        let (nh, lora, vh) = (self.n_head, self.kv_lora, self.v_head);
        if o_lat.len() < n * nh * lora || out.len() < n * nh * vh {
            return Err(OpError::Type(format!(
                "mla_value_out buffers too small for {n} tokens: o_lat {}, out {}",
                o_lat.len(),
                out.len()
            )));
        }
        let heads = per_head_matmul(v_b, v_b_dtype, nh, vh, lora, o_lat, lora, n)?;
        out[..n * nh * vh]
            .par_chunks_mut(nh * vh)
            .enumerate()
            .for_each(|(t, row)| {
                for (h, dst) in row.chunks_exact_mut(vh).enumerate() {
                    dst.copy_from_slice(&heads[h][t * vh..(t + 1) * vh]);
                }
            });
        Ok(())
    }
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
        check_views(self, inputs, outputs)?;
        let n = inputs[0].meta.shape[0];
        let o_lat = inputs[0].f32()?;
        let v_b = weight_bytes(&inputs[1])?;
        self.compute(o_lat, v_b, inputs[1].meta.dtype, n, outputs[0].f32_mut()?)
    }

    fn describe(&self) -> String {
        format!(
            "mla_value_out n_head={} kv_lora={} v_head={}",
            self.n_head, self.kv_lora, self.v_head
        )
    }
}
