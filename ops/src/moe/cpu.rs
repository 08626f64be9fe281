//! CPU references of the MoE ops.

use rayon::prelude::*;

use super::*;
use crate::check::weight_bytes;
use crate::cpu::{dot, matmul};
use crate::elementwise::swiglu;
use crate::op::check_host;
use crate::tensor::AlignedBuf;

/// `σ(z)` in f32, as ggml's sigmoid.
#[inline]
pub(super) fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// `silu(z) = z·σ(z)` in f32, as ggml's `ggml_silu_f32`.
#[inline]
pub(super) fn silu(z: f32) -> f32 {
    z / (1.0 + (-z).exp())
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

impl Router {
    pub(super) fn cpu_ref(
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

impl RoutePlan {
    pub(super) fn cpu_ref(
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
}

impl RouterRoutes {
    pub(super) fn cpu_ref(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let [ids, wts, off, tok, slot] = outputs else {
            return Err(OpError::Type("router_routes writes 5 outputs".into()));
        };
        let d = inputs[0].meta.inner();
        let bias = inputs.get(2).map(|b| b.f32()).transpose()?;
        let (z, w) = (inputs[0].f32()?, inputs[1].f32()?);
        self.router
            .compute(z, w, bias, d, ids.i32_mut()?, wts.f32_mut()?)?;
        self.plan.compute(
            ids.i32_mut()?,
            off.i32_mut()?,
            tok.i32_mut()?,
            slot.i32_mut()?,
        )
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
    pub(super) fn expert(&self, e: usize, n_out: usize) -> Result<&'a [u8], OpError> {
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
pub(super) fn csr(
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
pub(super) fn per_expert<'b>(
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

impl ExpertSwiGlu {
    pub(super) fn cpu_ref(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        if inputs.len() == 7 {
            // The shared expert carried beside: the two ops' references, one after the other.
            let (routed, shared) = outputs.split_at_mut(1);
            self.cpu_ref(&inputs[..5], routed)?;
            return GateUpSwiGlu::default().cpu(&[inputs[0], inputs[5], inputs[6]], shared);
        }
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

impl ExpertDown {
    pub(super) fn cpu_ref(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        if inputs.len() == 5 {
            let (routed, shared) = outputs.split_at_mut(1);
            self.cpu_ref(&inputs[..3], routed)?;
            return Linear::default().cpu(&[inputs[3], inputs[4]], shared);
        }
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
}

impl GateUpSwiGlu {
    pub(super) fn cpu_ref(
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

impl TopKSum {
    pub(super) fn cpu_ref(
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
}
