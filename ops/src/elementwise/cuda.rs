//! CUDA launches of the element-wise ops.

use super::{Add, SwiGlu};
use crate::OpError;
use crate::gpu::{DeviceTensor, GpuCtx, Scratch, blocks_for, dev_err};

impl SwiGlu {
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        launch_binary(ctx, "swiglu_f32", inputs, outputs)
    }
}

pub(crate) const ELEMENTWISE_CU: &str = include_str!("elementwise.cu");

/// One thread an element over two f32 inputs of one shape.
pub(super) fn launch_binary(
    ctx: &GpuCtx,
    kernel: &str,
    inputs: &[DeviceTensor<'_>],
    outputs: &[DeviceTensor<'_>],
) -> Result<(), OpError> {
    let (a, b, out) = match (inputs, outputs) {
        ([a, b], [out]) => (a, b, out),
        _ => return Err(OpError::shape("elementwise", "two inputs and one output")),
    };
    let n = out.meta.numel();
    let k = ctx.kernel("elementwise.cu", ELEMENTWISE_CU, kernel)?;
    // SAFETY: three f32 buffers of n elements (shapes checked by infer); the kernel is
    // grid-stride over n and the executor keeps the buffers alive until it runs.
    unsafe {
        ctx.device
            .launch(&k)
            .grid(blocks_for(n, 256).min(4096))
            .block(256)
            .arg(a.ptr)
            .arg(b.ptr)
            .arg(out.ptr)
            .arg(n as i64)
            .enqueue()
            .map_err(dev_err)
    }
}

impl Add {
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        launch_binary(ctx, "add_f32", inputs, outputs)
    }
}
