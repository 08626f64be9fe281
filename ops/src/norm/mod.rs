//! RMSNorm over the innermost dimension, optionally weighted (spec §0): the op and its shape
//! rule here, the CPU reference in `cpu.rs`, the CUDA launch in `cuda.rs` (`norm.cu`).

pub mod cases;
mod cpu;
mod cuda;
#[cfg(test)]
mod tests;

use crate::check::want_dtype;
use crate::gpu::{DeviceTensor, GpuCtx, Scratch};
use crate::tensor::{DType, HostTensor, HostTensorMut, TensorMeta};
use crate::{Op, OpError};

pub use cpu::{rms_norm_row, rms_norm_rows, rms_scale};
pub(crate) use cuda::{NORM_CU, launch_rms_norm};

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
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        format!("rms_norm(eps={:e})", self.eps)
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
