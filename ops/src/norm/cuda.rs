//! The CUDA launch of RMSNorm.

use super::RmsNorm;
use crate::OpError;
use crate::check::as_i32;
use crate::gpu::{DeviceTensor, GpuCtx, Scratch, dev_err};
use crate::op::check_device;

pub(crate) const NORM_CU: &str = include_str!("norm.cu");

impl RmsNorm {
    /// One block a row; the sum of squares is f32 in a fixed order (deterministic),
    /// within `Tolerance::F32` of the reference's f64 sum.
    pub(super) fn cuda_launch(
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
