//! CPU references of the MLA ops.

use std::borrow::Cow;

use half::f16;
use rayon::prelude::*;

use super::{
    KvCacheWrite, MlaAttention, MlaKv, MlaKvCacheWrite, MlaQuery, MlaQueryKv, MlaValueOut,
};
use crate::check::weight_bytes;
use crate::cpu::{dot, matmul};
use crate::op::check_host;
use crate::rope::rope_norm_cached;
use crate::tensor::{DType, HostTensor, HostTensorMut};
use crate::{Op, OpError};

pub(super) fn check_positions(
    op: &'static str,
    positions: &[i32],
    ctx: usize,
) -> Result<(), OpError> {
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
pub(super) fn per_head_matmul(
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

impl MlaQuery {
    pub(super) fn cpu_ref(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let q = inputs[0].f32()?;
        let k_b = weight_bytes(&inputs[1])?;
        let pos = inputs[2].i32()?;
        self.compute(q, k_b, inputs[1].meta.dtype, pos, outputs[0].f32_mut()?)
    }
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

impl MlaKv {
    pub(super) fn cpu_ref(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let kv = inputs[0].f32()?;
        let w = inputs[1].f32()?;
        let pos = inputs[2].i32()?;
        self.compute(kv, w, pos, outputs[0].f32_mut()?)
    }
}

impl MlaKvCacheWrite {
    pub(super) fn cpu_ref(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let pos = inputs[3].i32()?;
        let mut rows = vec![0f32; pos.len() * (self.kv.kv_lora + self.kv.qk_rope)];
        self.kv
            .compute(inputs[1].f32()?, inputs[2].f32()?, pos, &mut rows)?;
        write_cache_rows(&mut outputs[0], &rows, inputs[4].i32()?)
    }
}

impl MlaQueryKv {
    /// The two ops it replaces: the cache rows, then the query.
    pub(super) fn cpu_ref(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let (cache, q_abs) = outputs.split_at_mut(1);
        MlaKvCacheWrite {
            kv: self.kv.clone(),
        }
        .cpu_ref(&inputs[..5], cache)?;
        let query = [inputs[5], inputs[6], inputs[3]];
        self.query.cpu(&query, q_abs)
    }
}

impl KvCacheWrite {
    /// Slice-level form: `cache` is `pool rows × w`; a negative slot writes nothing.
    pub fn compute(cache: &mut [f32], w: usize, k: &[f32], slots: &[i32]) -> Result<(), OpError> {
        let rows = cache.len().checked_div(w).unwrap_or(0);
        if let Some((i, &s)) = slots
            .iter()
            .enumerate()
            .find(|&(_, &s)| s >= 0 && s as usize >= rows)
        {
            return Err(OpError::data(
                "kv_cache_write",
                format!("slot {s} of token {i} is outside the cache pool [0, {rows})"),
            ));
        }
        if k.len() < slots.len() * w {
            return Err(OpError::Type(format!(
                "kv_cache_write: k has {} values, {} rows of {w} needed",
                k.len(),
                slots.len()
            )));
        }
        for (i, &s) in slots.iter().enumerate() {
            if s >= 0 {
                let s = s as usize;
                cache[s * w..(s + 1) * w].copy_from_slice(&k[i * w..(i + 1) * w]);
            }
        }
        Ok(())
    }
}

impl KvCacheWrite {
    /// Reads only inputs 1 and 2: input 0 is the same storage as the output.
    pub(super) fn cpu_ref(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        write_cache_rows(&mut outputs[0], inputs[1].f32()?, inputs[2].i32()?)
    }
}

/// [`KvCacheWrite::compute`] into a cache of either [`super::LATENT_CACHE_TYPES`]: an F16
/// cache gets each value rounded to nearest and saturated to ±65504 (a NaN stays NaN).
pub(super) fn write_cache_rows(
    cache: &mut HostTensorMut<'_>,
    k: &[f32],
    slots: &[i32],
) -> Result<(), OpError> {
    let w = cache.meta.inner();
    if cache.meta.dtype == DType::F32 {
        return KvCacheWrite::compute(cache.f32_mut()?, w, k, slots);
    }
    let rows = cache.meta.shape[0];
    let mut staged = vec![0f32; rows * w];
    // Only the slots' rows are staged and written back: the rest of the pool is untouched.
    let touched: Vec<usize> = slots
        .iter()
        .filter(|&&s| s >= 0 && (s as usize) < rows)
        .map(|&s| s as usize)
        .collect();
    KvCacheWrite::compute(&mut staged, w, k, slots)?;
    let bytes = &mut *cache.data;
    for r in touched {
        for c in 0..w {
            let h = f16_saturated(staged[r * w + c]);
            let at = 2 * (r * w + c);
            bytes[at..at + 2].copy_from_slice(&h.to_le_bytes());
        }
    }
    Ok(())
}

/// x rounded to the nearest f16 and saturated to ±65504, a NaN kept NaN (PTX's
/// `cvt.rn.satfinite.f16.f32`, which the f16 kernels narrow with).
pub fn f16_saturated(x: f32) -> f16 {
    if x.is_nan() {
        f16::NAN
    } else {
        f16::from_f32(x.clamp(-65504.0, 65504.0))
    }
}

/// The cache's rows as f32: an F32 cache borrowed, an F16 one widened.
pub(super) fn cache_as_f32<'a>(cache: &HostTensor<'a>) -> Result<Cow<'a, [f32]>, OpError> {
    match cache.meta.dtype {
        DType::F16 => Ok(Cow::Owned(
            cache
                .data
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        )),
        _ => Ok(Cow::Borrowed(cache.f32()?)),
    }
}

/// A step's map from (sequence, position) to a row of the paged cache pool.
#[derive(Clone, Copy, Debug)]
pub struct Pages<'a> {
    /// `seqs × width` block ids.
    pub block_table: &'a [i32],
    pub width: usize,
    /// The sequence of each token row.
    pub row_seq: &'a [i32],
    pub block_size: usize,
}

impl Pages<'_> {
    /// Pool rows of the first `len` positions of token `i`'s sequence, checked against a pool
    /// of `pool_rows` rows.
    fn rows_of(&self, i: usize, len: usize, pool_rows: usize) -> Result<Vec<usize>, OpError> {
        let op = "mla_attention";
        let s = self.row_seq[i];
        let seqs = self.block_table.len() / self.width.max(1);
        if s < 0 || s as usize >= seqs {
            return Err(OpError::data(
                op,
                format!("token {i} names sequence {s}, the block table has {seqs}"),
            ));
        }
        let table = &self.block_table[s as usize * self.width..][..self.width];
        if len > self.width * self.block_size {
            return Err(OpError::data(
                op,
                format!(
                    "token {i} attends {len} positions, its block table covers {}",
                    self.width * self.block_size
                ),
            ));
        }
        (0..len)
            .map(|p| {
                let b = table[p / self.block_size];
                // A negative id is refused before it becomes a (huge) row.
                let row = usize::try_from(b)
                    .ok()
                    .and_then(|b| b.checked_mul(self.block_size))
                    .map_or(usize::MAX, |r| r + p % self.block_size);
                if row >= pool_rows {
                    Err(OpError::data(
                        op,
                        format!(
                            "block {b} of sequence {s} (position {p}) is outside the pool of {} blocks",
                            pool_rows / self.block_size.max(1)
                        ),
                    ))
                } else {
                    Ok(row)
                }
            })
            .collect()
    }
}

/// The block table and row map of one sequence whose positions are pool rows `0..rows`
/// (blocks in order): what a single-sequence caller and the tests give [`MlaAttention`].
#[derive(Clone, Debug)]
pub struct ContiguousPages {
    pub block_table: Vec<i32>,
    pub row_seq: Vec<i32>,
    pub block_size: usize,
}

impl ContiguousPages {
    pub fn new(rows: usize, block_size: usize, n_tokens: usize) -> ContiguousPages {
        ContiguousPages {
            block_table: (0..rows.div_ceil(block_size) as i32).collect(),
            row_seq: vec![0; n_tokens],
            block_size,
        }
    }

    pub fn view(&self) -> Pages<'_> {
        Pages {
            block_table: &self.block_table,
            width: self.block_table.len(),
            row_seq: &self.row_seq,
            block_size: self.block_size,
        }
    }
}

impl MlaAttention {
    /// Slice-level form: `q` is `n × n_head × w`, `cache` is `pool rows × w`, `out` is
    /// `n × n_head × kv_lora`, with `w = cache.len() / pool rows`; `pages` places each token's
    /// positions in the pool.
    pub fn compute(
        &self,
        q: &[f32],
        cache: &[f32],
        w: usize,
        positions: &[i32],
        pages: Pages<'_>,
        out: &mut [f32],
    ) -> Result<(), OpError> {
        let n = positions.len();
        let (nh, lora) = (self.n_head, self.kv_lora);
        if w < lora
            || lora == 0
            || q.len() < n * nh * w
            || out.len() < n * nh * lora
            || pages.row_seq.len() < n
        {
            return Err(OpError::Type(format!(
                "mla_attention buffers do not fit {n} tokens × {nh} heads of width {w} \
                 (kv_lora {lora}): q {}, out {}, row_seq {}",
                q.len(),
                out.len(),
                pages.row_seq.len()
            )));
        }
        let pool_rows = cache.len() / w;
        check_positions("mla_attention", positions, pages.width * pages.block_size)?;
        let rows: Vec<Vec<usize>> = positions
            .iter()
            .enumerate()
            .map(|(i, &p)| pages.rows_of(i, p as usize + 1, pool_rows))
            .collect::<Result<_, _>>()?;
        out[..n * nh * lora]
            .par_chunks_mut(lora)
            .enumerate()
            .for_each(|(ih, o)| {
                let qv = &q[ih * w..(ih + 1) * w];
                let rows = &rows[ih / nh];
                let key = |r: usize| &cache[r * w..(r + 1) * w];
                let mut p: Vec<f32> = rows
                    .iter()
                    .map(|&r| self.kq_scale * dot(qv, key(r)))
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
                for (pt, &r) in p.iter().zip(rows) {
                    let pt = pt * inv;
                    for (a, &v) in o.iter_mut().zip(&key(r)[..lora]) {
                        *a += pt * v;
                    }
                }
            });
        Ok(())
    }
}

impl MlaAttention {
    pub(super) fn cpu_ref(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let w = inputs[1].meta.inner();
        let q = inputs[0].f32()?;
        let cache = cache_as_f32(&inputs[1])?;
        let pos = inputs[2].i32()?;
        let pages = Pages {
            block_table: inputs[3].i32()?,
            width: inputs[3].meta.shape[1],
            row_seq: inputs[4].i32()?,
            block_size: self.block_size,
        };
        self.compute(q, &cache, w, pos, pages, outputs[0].f32_mut()?)
    }
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

impl MlaValueOut {
    pub(super) fn cpu_ref(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let n = inputs[0].meta.shape[0];
        let o_lat = inputs[0].f32()?;
        let v_b = weight_bytes(&inputs[1])?;
        self.compute(o_lat, v_b, inputs[1].meta.dtype, n, outputs[0].f32_mut()?)
    }
}
