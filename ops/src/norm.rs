//! RMSNorm over the innermost dimension, optionally weighted (spec §0).

use rayon::prelude::*;

use crate::elementwise::want_dtype;
use crate::gpu::{DeviceTensor, GpuCtx, Scratch, dev_err};
use crate::linear::as_i32;
use crate::op::check_device;
use crate::op::check_host;
use crate::tensor::{DType, HostTensor, HostTensorMut, TensorMeta};
use crate::{Op, OpError};

pub(crate) const NORM_CU: &str = include_str!("../kernels/norm.cu");

/// `(mean(x²) + eps)^{−½}` the way ggml's CPU kernel forms it: each square in
/// f32, summed in f64, the mean narrowed to f32 before `eps` and the root.
pub fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let sum: f64 = x.iter().map(|&v| (v * v) as f64).sum();
    let mean = (sum / x.len().max(1) as f64) as f32;
    1.0 / (mean + eps).sqrt()
}

/// One row: `y = (x · rms_scale(x)) ⊙ w` (`w = None` is unweighted). The two
/// products are rounded separately, as ggml's norm and mul are separate ops.
pub fn rms_norm_row(x: &[f32], w: Option<&[f32]>, eps: f32, y: &mut [f32]) {
    let s = rms_scale(x, eps);
    match w {
        Some(w) => {
            for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
                *y = (x * s) * w;
            }
        }
        None => {
            for (y, &x) in y.iter_mut().zip(x) {
                *y = x * s;
            }
        }
    }
}

/// Every row of `x` (rows of `d` values) normalised into `y`.
pub fn rms_norm_rows(x: &[f32], w: Option<&[f32]>, d: usize, eps: f32, y: &mut [f32]) {
    if d == 0 {
        return;
    }
    y.par_chunks_mut(d)
        .zip(x.par_chunks(d))
        .for_each(|(y, x)| rms_norm_row(x, w, eps, y));
}

/// `y = x · (mean(x²) + eps)^{−½} (⊙ w)` over the innermost dimension.
/// Inputs: `x` F32 `[.., D]`, optionally `w` F32 `[D]`; output F32, `x`'s shape.
#[derive(Debug, Clone, PartialEq)]
pub struct RmsNorm {
    pub eps: f32,
}

impl Op for RmsNorm {
    fn name(&self) -> &'static str {
        "rms_norm"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        if !(1..=2).contains(&inputs.len()) {
            return Err(OpError::shape(
                op,
                format!("expects x or (x, weight), got {} inputs", inputs.len()),
            ));
        }
        let x = inputs[0];
        want_dtype(op, "x", x, DType::F32)?;
        if x.shape.is_empty() || x.inner() == 0 {
            return Err(OpError::shape(
                op,
                format!("x must have a non-empty innermost dimension, found {x}"),
            ));
        }
        if let Some(w) = inputs.get(1) {
            want_dtype(op, "weight", w, DType::F32)?;
            if w.shape != [x.inner()] {
                return Err(OpError::shape(
                    op,
                    format!(
                        "weight must be F32[{}] to match x {x}, found {w}",
                        x.inner()
                    ),
                ));
            }
        }
        Ok(vec![TensorMeta::f32(x.shape.clone())])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let x = inputs[0].f32()?;
        let w = inputs.get(1).map(|w| w.f32()).transpose()?;
        rms_norm_rows(
            x,
            w,
            inputs[0].meta.inner(),
            self.eps,
            outputs[0].f32_mut()?,
        );
        Ok(())
    }

    fn describe(&self) -> String {
        format!("rms_norm(eps={:e})", self.eps)
    }

    /// One block a row; the sum of squares is f32 in a fixed order (deterministic),
    /// within `Tolerance::F32` of the reference's f64 sum.
    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let x = &inputs[0];
        let rows = x.meta.rows();
        if rows == 0 {
            return Ok(());
        }
        let w = inputs.get(1).map(|w| w.ptr);
        // SAFETY: check_device checked x and y hold rows×D f32 and w (when given) D f32.
        unsafe {
            launch_rms_norm(
                ctx,
                x.ptr,
                w,
                outputs[0].ptr,
                rows,
                x.meta.inner(),
                self.eps,
            )
        }
    }
}

/// Enqueues `y[r] = rms_norm(x[r]) (· w)` over `rows` rows of `d` f32.
///
/// # Safety
/// `x` and `y` must address `rows·d` f32 each and `w` (when given) `d` f32, alive until the
/// kernel has run.
pub(crate) unsafe fn launch_rms_norm(
    ctx: &GpuCtx,
    x: u64,
    w: Option<u64>,
    y: u64,
    rows: usize,
    d: usize,
    eps: f32,
) -> Result<(), OpError> {
    let op = "rms_norm";
    let di = as_i32(op, "D", d)?;
    let rows = u32::try_from(rows)
        .map_err(|_| OpError::shape(op, format!("{rows} rows in one launch")))?;
    let aligned = |p: u64| p.is_multiple_of(16);
    let vec = d.is_multiple_of(4) && aligned(x) && aligned(y) && w.is_none_or(aligned);
    let name = if vec {
        "rms_norm_f32_vec"
    } else {
        "rms_norm_f32"
    };
    // About one float4 a thread: the row's loads are in flight at once.
    let per_thread = if vec { 4 } else { 1 };
    let block = (d as u32)
        .div_ceil(per_thread)
        .next_multiple_of(32)
        .clamp(32, 1024);
    let k = ctx.kernel("norm.cu", NORM_CU, name)?;
    // SAFETY: rms_norm_f32[_vec](x, w or null, y, D, eps) over the caller's buffers.
    unsafe {
        ctx.device
            .launch(&k)
            .grid(rows)
            .block(block)
            .arg(x)
            .arg(w.unwrap_or(0))
            .arg(y)
            .arg(di)
            .arg(eps)
            .enqueue()
            .map_err(dev_err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::elementwise::testkit::*;

    fn f64_rms(x: &[f32], w: Option<&[f32]>, eps: f64) -> Vec<f64> {
        let ms = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / x.len() as f64;
        let s = 1.0 / (ms + eps).sqrt();
        x.iter()
            .enumerate()
            .map(|(i, &v)| v as f64 * s * w.map_or(1.0, |w| w[i] as f64))
            .collect()
    }

    #[test]
    fn rms_norm_matches_f64_weighted_and_unweighted() {
        let mut r = Lcg(7);
        for &(n, d) in &[(1, 1), (3, 17), (2, 3584), (5, 512)] {
            let x = r.vec(n * d, -50.0, 50.0);
            let w = r.vec(d, -2.0, 2.0);
            for weighted in [false, true] {
                let xs = Owned::f32([n, d], &x);
                let ws = Owned::f32([d], &w);
                let op = RmsNorm { eps: 1e-6 };
                let out = if weighted {
                    run(&op, &[&xs, &ws])
                } else {
                    run(&op, &[&xs])
                }
                .unwrap()[0]
                    .to_f32();
                for t in 0..n {
                    let row = &x[t * d..(t + 1) * d];
                    let want = f64_rms(row, weighted.then_some(&w[..]), 1e-6);
                    for (o, w) in out[t * d..(t + 1) * d].iter().zip(want) {
                        // A handful of f32 roundings on an O(√D)-bounded value: a few ulp.
                        assert!(
                            (*o as f64 - w).abs() <= 4e-7 * w.abs() + 1e-12,
                            "{o} vs {w}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn rms_norm_of_large_values_is_of_order_one() {
        // The sub-layer is handed an RMS-normed input: whatever the residual holds, each
        // |y| ≤ √D, so it fits a narrow type (seed §2).
        let d = 64;
        let x: Vec<f32> = (0..d).map(|i| 1e5 * (i as f32 - 31.5)).collect();
        let out = run(&RmsNorm { eps: 1e-6 }, &[&Owned::f32([1, d], &x)]).unwrap()[0].to_f32();
        let ss: f64 = out.iter().map(|&v| (v as f64).powi(2)).sum();
        assert!(
            (ss / d as f64 - 1.0).abs() < 1e-5,
            "mean square {}",
            ss / d as f64
        );
        assert!(out.iter().all(|v| v.abs() <= (d as f32).sqrt()));
    }

    #[test]
    fn eps_keeps_a_zero_row_finite() {
        let out = run(&RmsNorm { eps: 1e-6 }, &[&Owned::f32([1, 4], &[0.0; 4])]).unwrap();
        assert_eq!(out[0].to_f32(), vec![0.0; 4]);
    }

    #[test]
    fn rms_norm_refuses_a_weight_of_the_wrong_length_or_type() {
        let op = RmsNorm { eps: 1e-6 };
        let e = infer(&op, &[TensorMeta::f32([2, 8]), TensorMeta::f32([7])]).unwrap_err();
        assert!(matches!(e, OpError::Shape { op: "rms_norm", .. }), "{e}");
        let e = infer(
            &op,
            &[TensorMeta::f32([2, 8]), TensorMeta::new([8], DType::BF16)],
        )
        .unwrap_err();
        assert!(matches!(e, OpError::Shape { .. }), "{e}");
        let e = infer(&op, &[TensorMeta::new([2, 8], DType::F16)]).unwrap_err();
        assert!(matches!(e, OpError::Shape { .. }), "{e}");
        assert_eq!(op.describe(), "rms_norm(eps=1e-6)");
    }
}
