//! The CPU reference of RMSNorm.

use rayon::prelude::*;

use super::RmsNorm;
use crate::OpError;
use crate::op::check_host;
use crate::tensor::{HostTensor, HostTensorMut};

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

impl RmsNorm {
    pub(super) fn cpu_ref(
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
}
