//! CUDA launches of the head ops.

use super::{Argmax, PenalizeRows, SampleRows, SliceRows};
use crate::check::as_i32;
use crate::gpu::{DeviceTensor, GpuCtx, Scratch, blocks_for, dev_err};
use crate::op::check_device;
use crate::{Op, OpError};

pub(crate) const HEAD_CU: &str = include_str!("head.cu");

impl Argmax {
    /// One block a row. A kernel cannot raise the reference's data error: a row
    /// holding NaN is written as -1 (never a token id), for the caller to check.
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let (n, v) = (inputs[0].meta.shape[0], inputs[0].meta.shape[1]);
        if n == 0 {
            return Ok(());
        }
        let n =
            u32::try_from(n).map_err(|_| OpError::shape(op, format!("{n} rows in one launch")))?;
        let vec = v.is_multiple_of(4) && inputs[0].ptr.is_multiple_of(16);
        let name = if vec {
            "argmax_rows_vec"
        } else {
            "argmax_rows"
        };
        let k = ctx.kernel("head.cu", HEAD_CU, name)?;
        // SAFETY: argmax_rows(x, out, V); check_device checked x holds n×V f32 and out n i32.
        unsafe {
            ctx.device
                .launch(&k)
                .grid(n)
                .block(1024)
                .arg(inputs[0].ptr)
                .arg(outputs[0].ptr)
                .arg(as_i32(op, "V", v)?)
                .enqueue()
                .map_err(dev_err)
        }
    }
}

impl SampleRows {
    /// One block of 512 threads a row (greedy rows take the argmax kernel's body).
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let (n, v) = (inputs[0].meta.shape[0], inputs[0].meta.shape[1]);
        if n == 0 {
            return Ok(());
        }
        let n =
            u32::try_from(n).map_err(|_| OpError::shape(op, format!("{n} rows in one launch")))?;
        let k = ctx.kernel("head.cu", HEAD_CU, "sample_rows")?;
        // SAFETY: sample_rows(x, params, out, V); check_device checked x holds n×V f32,
        // params n×SAMPLE_FIELDS f32 and out n i32.
        unsafe {
            ctx.device
                .launch(&k)
                .grid(n)
                .block(512)
                .arg(inputs[0].ptr)
                .arg(inputs[1].ptr)
                .arg(outputs[0].ptr)
                .arg(as_i32(op, "V", v)?)
                .enqueue()
                .map_err(dev_err)
        }
    }
}

impl PenalizeRows {
    /// Two launches: the rows copied, then one thread a listed id.
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let op = self.name();
        let (n, v) = (inputs[0].meta.shape[0], inputs[0].meta.shape[1]);
        let w = inputs[1].meta.shape[1];
        let total = n * v;
        if total == 0 {
            return Ok(());
        }
        let copy = ctx.kernel("head.cu", HEAD_CU, "slice_rows")?;
        // SAFETY: slice_rows(x, out, 0, total): x and out both hold total f32 (shape rule).
        unsafe {
            ctx.device
                .launch(&copy)
                .grid(blocks_for(total, 256).min(32768))
                .block(256)
                .arg(inputs[0].ptr)
                .arg(outputs[0].ptr)
                .arg(0i64)
                .arg(total as i64)
                .enqueue()
                .map_err(dev_err)?;
        }
        if n * w == 0 {
            return Ok(());
        }
        let k = ctx.kernel("head.cu", HEAD_CU, "penalize_rows")?;
        // SAFETY: penalize_rows(x, ids, penalty, out, V, W, n*W): ids holds n×W i32, penalty
        // n f32, x and out n×V f32; ids outside 0..V are skipped in the kernel.
        unsafe {
            ctx.device
                .launch(&k)
                .grid(blocks_for(n * w, 256))
                .block(256)
                .arg(inputs[0].ptr)
                .arg(inputs[1].ptr)
                .arg(inputs[2].ptr)
                .arg(outputs[0].ptr)
                .arg(as_i32(op, "V", v)?)
                .arg(as_i32(op, "W", w)?)
                .arg(as_i32(op, "n*W", n * w)?)
                .enqueue()
                .map_err(dev_err)
        }
    }
}

impl SliceRows {
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let row: usize = inputs[0].meta.shape[1..].iter().product();
        let total = self.len * row;
        if total == 0 {
            return Ok(());
        }
        let k = ctx.kernel("head.cu", HEAD_CU, "slice_rows")?;
        // SAFETY: slice_rows(x, out, offset, total); the shape rule keeps
        // start+len ≤ n, so offset+total elements lie inside x, and out holds total.
        unsafe {
            ctx.device
                .launch(&k)
                .grid(blocks_for(total, 256).min(32768))
                .block(256)
                .arg(inputs[0].ptr)
                .arg(outputs[0].ptr)
                .arg((self.start * row) as i64)
                .arg(total as i64)
                .enqueue()
                .map_err(dev_err)
        }
    }
}
