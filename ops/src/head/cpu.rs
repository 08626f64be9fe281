//! CPU references of the head ops.

use rayon::prelude::*;

use super::{Argmax, PenalizeRows, SampleRows, SliceRows};
use crate::op::check_host;
use crate::tensor::{HostTensor, HostTensorMut};
use crate::{Op, OpError};

/// Index of the first largest value, or the index of the first NaN as `Err`.
pub fn argmax_row(x: &[f32]) -> Result<usize, usize> {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v.is_nan() {
            return Err(i);
        }
        // Strictly greater: ties keep the first index.
        if v > x[best] {
            best = i;
        }
    }
    Ok(best)
}

impl Argmax {
    pub(super) fn cpu_ref(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let v = inputs[0].meta.shape[1];
        let x = inputs[0].f32()?;
        let out = outputs[0].i32_mut()?;
        let picks: Vec<Result<usize, usize>> = x.par_chunks(v).map(argmax_row).collect();
        for (t, (o, p)) in out.iter_mut().zip(picks).enumerate() {
            match p {
                // V fits i32 (shape rule), so the index does.
                Ok(i) => *o = i as i32,
                Err(i) => {
                    return Err(OpError::data(
                        self.name(),
                        format!("row {t} holds NaN (first at column {i})"),
                    ));
                }
            }
        }
        Ok(())
    }
}

impl SliceRows {
    pub(super) fn cpu_ref(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let row: usize = inputs[0].meta.shape[1..].iter().product();
        let x = inputs[0].f32()?;
        outputs[0]
            .f32_mut()?
            .copy_from_slice(&x[self.start * row..(self.start + self.len) * row]);
        Ok(())
    }
}

/// Parameters a row of [`super::SampleRows`] reads.
pub const SAMPLE_FIELDS: usize = 5;

/// How one logits row is turned into a token (the fields of a `sample_rows` params row, in
/// order). `u` is the row's uniform draw in [0, 1), made by the caller from its seeded
/// generator, so the same seed chooses the same tokens on the CPU and the GPU.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowSampling {
    /// 1 / temperature, computed once by the caller (both sides then multiply, so they round
    /// alike); not positive: the argmax.
    pub scale: f32,
    /// 0: no top-k cut.
    pub top_k: u32,
    /// 1 (or more): no nucleus cut.
    pub top_p: f32,
    /// 0: no min-p cut; at most 1.
    pub min_p: f32,
    pub u: f32,
}

impl RowSampling {
    pub const GREEDY: RowSampling = RowSampling {
        scale: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        u: 0.0,
    };

    /// A sampled row at `temperature` (> 0) with draw `u` and no cuts.
    pub fn at_temperature(temperature: f32, u: f32) -> RowSampling {
        RowSampling {
            scale: 1.0 / temperature,
            u,
            ..RowSampling::GREEDY
        }
    }

    pub fn fields(&self) -> [f32; SAMPLE_FIELDS] {
        // top_k as f32 is exact to 2^24, past any vocabulary.
        [
            self.scale,
            self.top_k as f32,
            self.top_p,
            self.min_p,
            self.u,
        ]
    }

    pub fn from_fields(f: &[f32]) -> RowSampling {
        RowSampling {
            scale: f[0],
            top_k: if f[1] >= u32::MAX as f32 {
                u32::MAX
            } else {
                f[1].max(0.0) as u32
            },
            top_p: f[2],
            min_p: f[3],
            u: f[4],
        }
    }
}

/// The token a sampled row (`p.scale > 0`) chooses, or `None` when no `x * scale` is finite.
/// Candidates are the finite `x * scale`, ordered by value descending, then
/// id ascending; top-k keeps the first `top_k`; then, walking that order with weights
/// `w = exp(v - max)`, the head ends before the first candidate (after the first) whose
/// weight is below `min_p`, or with the first whose running weight reaches `top_p` of the
/// kept weight. The draw walks the kept ids in ascending order until the running weight
/// passes `u` times theirs (the last kept id if rounding leaves it short).
///
/// Only the head a cut keeps is ever sorted: a full sort of a 131,072-wide row per token
/// would be the host's cost of a batched step.
pub fn sample_row(x: &[f32], p: &RowSampling) -> Option<usize> {
    let mut cand: Vec<(u32, f32)> = x
        .iter()
        .enumerate()
        .filter_map(|(i, &v)| {
            let s = v * p.scale;
            s.is_finite().then_some((i as u32, s))
        })
        .collect();
    if cand.is_empty() {
        return None;
    }
    let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let k = p.top_k as usize;
    if k > 0 && k < cand.len() {
        cand.select_nth_unstable_by(k - 1, order);
        cand.truncate(k);
    }
    let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
    let weight = |c: &(u32, f32)| (c.1 - max).exp();
    let min_p = if p.min_p > 0.0 { p.min_p.min(1.0) } else { 0.0 };
    let top_p = p.top_p < 1.0;
    if min_p > 0.0 || top_p {
        let target = p.top_p as f64 * cand.iter().map(|c| weight(c) as f64).sum::<f64>();
        let mut head = 64.min(cand.len());
        let kept = loop {
            if head < cand.len() {
                cand.select_nth_unstable_by(head - 1, order);
            }
            cand[..head].sort_by(order);
            let mut acc = 0.0;
            let mut cut = None;
            for (i, c) in cand[..head].iter().enumerate() {
                let w = weight(c);
                if i > 0 && w < min_p {
                    cut = Some(i);
                    break;
                }
                acc += w as f64;
                if top_p && acc >= target {
                    cut = Some(i + 1);
                    break;
                }
            }
            match cut {
                Some(n) => break n,
                None if head == cand.len() => break head,
                None => head = (head * 8).min(cand.len()),
            }
        };
        cand.truncate(kept);
    }
    cand.sort_unstable_by_key(|c| c.0);
    let weights: Vec<f64> = cand.iter().map(|c| weight(c) as f64).collect();
    let goal = p.u as f64 * weights.iter().sum::<f64>();
    let mut acc = 0.0;
    for (c, w) in cand.iter().zip(&weights) {
        acc += w;
        if acc > goal {
            return Some(c.0 as usize);
        }
    }
    cand.last().map(|c| c.0 as usize)
}

impl SampleRows {
    pub(super) fn cpu_ref(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let v = inputs[0].meta.shape[1];
        let x = inputs[0].f32()?;
        let params = inputs[1].f32()?;
        let out = outputs[0].i32_mut()?;
        let picks: Vec<Result<usize, String>> = x
            .par_chunks(v)
            .zip(params.par_chunks(SAMPLE_FIELDS))
            .map(|(row, f)| {
                let p = RowSampling::from_fields(f);
                if p.scale > 0.0 {
                    sample_row(row, &p).ok_or_else(|| "no finite logit".to_string())
                } else {
                    argmax_row(row).map_err(|i| format!("NaN (first at column {i})"))
                }
            })
            .collect();
        for (t, (o, p)) in out.iter_mut().zip(picks).enumerate() {
            match p {
                Ok(i) => *o = i as i32,
                Err(why) => {
                    return Err(OpError::data(self.name(), format!("row {t} holds {why}")));
                }
            }
        }
        Ok(())
    }
}

/// The repetition penalty of one logit (llama.cpp and Hugging Face): divided by `penalty`
/// where positive, multiplied where not.
pub fn penalize(v: f32, penalty: f32) -> f32 {
    if v > 0.0 { v / penalty } else { v * penalty }
}

impl PenalizeRows {
    pub(super) fn cpu_ref(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let v = inputs[0].meta.shape[1];
        let w = inputs[1].meta.shape[1];
        let x = inputs[0].f32()?;
        let ids = inputs[1].i32()?;
        let pen = inputs[2].f32()?;
        let out = outputs[0].f32_mut()?;
        out.copy_from_slice(x);
        for (r, &p) in pen.iter().enumerate() {
            for &id in &ids[r * w..(r + 1) * w] {
                if let Some(i) = usize::try_from(id).ok().filter(|&i| i < v) {
                    out[r * v + i] = penalize(x[r * v + i], p);
                }
            }
        }
        Ok(())
    }
}
