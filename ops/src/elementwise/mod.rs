//! Element-wise ops on f32 activations (`swiglu`, `add`): the shape rule here, the CPU
//! reference in `cpu.rs`, the CUDA launch in `cuda.rs` (kernels in `elementwise.cu`).

mod cpu;
mod cuda;
#[cfg(test)]
mod tests;

use crate::check::{arity, want_dtype};
use crate::gpu::{DeviceTensor, GpuCtx, Scratch};
use crate::tensor::{DType, HostTensor, HostTensorMut, TensorMeta};
use crate::{Op, OpError};

pub use cpu::{add, swiglu};
pub(crate) use cuda::ELEMENTWISE_CU;

/// Shape rule shared by the two binary element-wise ops: two F32 tensors of one shape.
fn same_shape_f32(op: &'static str, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
    arity(op, inputs, 2)?;
    let (a, b) = (inputs[0], inputs[1]);
    want_dtype(op, "first input", a, DType::F32)?;
    want_dtype(op, "second input", b, DType::F32)?;
    if a.shape.is_empty() {
        return Err(OpError::shape(
            op,
            "inputs must have at least one dimension",
        ));
    }
    if a.shape != b.shape {
        return Err(OpError::shape(
            op,
            format!("inputs must have one shape, found {a} and {b}"),
        ));
    }
    Ok(vec![TensorMeta::f32(a.shape.clone())])
}

/// `silu(gate) · up`, both F32 of one shape (`[n, F]`); the product stays f32
/// because it is what grows past f16 in a loud expert (seed §2).
#[derive(Debug, Clone, PartialEq)]
pub struct SwiGlu;

impl Op for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        same_shape_f32(self.name(), inputs)
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        "swiglu".to_string()
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

/// `a + b`, both F32 of one shape.
#[derive(Debug, Clone, PartialEq)]
pub struct Add;

impl Op for Add {
    fn name(&self) -> &'static str {
        "add"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        same_shape_f32(self.name(), inputs)
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        "add".to_string()
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
