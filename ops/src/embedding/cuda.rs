//! The CUDA launch of the embedding lookup.

use super::{Embedding, OP};
use crate::OpError;
use crate::check::as_i32;
use crate::dequant::wt_code;
use crate::gpu::{DeviceTensor, GpuCtx, Scratch, dev_err};
use crate::op::check_device;

pub(crate) const EMBEDDING_CU: &str = concat!(
    include_str!("../dequant/dequant.cuh"),
    include_str!("embedding.cu")
);

impl Embedding {
    /// Bit-identical to the CPU reference for in-range ids. A kernel cannot report an
    /// id outside `[0, V)`: that token's row is written as NaN and nothing is read for
    /// it (the engine checks ids on the host before they are uploaded).
    pub(super) fn cuda_launch(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let (table, tokens, out) = (&inputs[0], &inputs[1], &outputs[0]);
        let (v, d, n) = (
            table.meta.shape[0],
            table.meta.shape[1],
            tokens.meta.shape[0],
        );
        if n == 0 || d == 0 {
            return Ok(());
        }
        if n > 65535 {
            return Err(OpError::shape(
                OP,
                format!("{n} tokens in one launch; at most 65535"),
            ));
        }
        if !table.ptr.is_multiple_of(4) {
            return Err(OpError::Type(format!(
                "embedding table at {:#x} is not 4-byte aligned",
                table.ptr
            )));
        }
        let dtype = table.meta.dtype;
        let (code, row) = wt_code(dtype).zip(dtype.row_bytes(d)).ok_or_else(|| {
            OpError::shape(OP, format!("table {} is not a stored matrix", table.meta))
        })?;
        let k = ctx.kernel("embedding.cu", EMBEDDING_CU, "embedding_rows")?;
        // SAFETY: the arguments follow embedding_rows' signature; check_device checked the
        // table holds V rows of `row` bytes, tokens n ids and out n×D f32; ids outside
        // [0, V) are never dereferenced.
        unsafe {
            ctx.device
                .launch(&k)
                .grid((d.div_ceil(256).min(64) as u32, n as u32))
                .block(256)
                .arg(table.ptr)
                .arg(tokens.ptr)
                .arg(out.ptr)
                .arg(as_i32(OP, "V", v)?)
                .arg(as_i32(OP, "D", d)?)
                .arg(row as i64)
                .arg(code)
                .enqueue()
                .map_err(dev_err)
        }
    }
}
