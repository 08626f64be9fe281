//! The head's plumbing: greedy token choice and the row slice that keeps only
//! the rows needing logits (spec §3.8).

use rayon::prelude::*;

use crate::elementwise::{arity, want_dtype};
use crate::gpu::{DeviceTensor, GpuCtx, Scratch, blocks_for, dev_err};
use crate::linear::as_i32;
use crate::op::check_device;
use crate::op::check_host;
use crate::tensor::{DType, HostTensor, HostTensorMut, TensorMeta};
use crate::{Op, OpError};

pub(crate) const HEAD_CU: &str = include_str!("../kernels/head.cu");

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

/// F32 `[n, V]` → I32 `[n]`: per row the index of the first maximum. A row
/// holding a NaN is `OpError::Data` (a broken forward pass, not a choice).
#[derive(Debug, Clone, PartialEq)]
pub struct Argmax;

impl Op for Argmax {
    fn name(&self) -> &'static str {
        "argmax"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        arity(op, inputs, 1)?;
        let x = inputs[0];
        want_dtype(op, "logits", x, DType::F32)?;
        if x.shape.len() != 2 || x.shape[1] == 0 {
            return Err(OpError::shape(
                op,
                format!("logits must be [n, V] with V > 0, found {x}"),
            ));
        }
        if i32::try_from(x.shape[1]).is_err() {
            return Err(OpError::shape(
                op,
                format!("V = {} does not fit an I32 index", x.shape[1]),
            ));
        }
        Ok(vec![TensorMeta::i32([x.shape[0]])])
    }

    fn cpu(
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

    fn describe(&self) -> String {
        "argmax".to_string()
    }

    /// One block a row. A kernel cannot raise the reference's data error: a row
    /// holding NaN is written as -1 (never a token id), for the caller to check.
    fn cuda(
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

/// F32 `[n, ..]` → F32 `[len, ..]`: rows `start..start+len` (copied).
#[derive(Debug, Clone, PartialEq)]
pub struct SliceRows {
    pub start: usize,
    pub len: usize,
}

impl Op for SliceRows {
    fn name(&self) -> &'static str {
        "slice_rows"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        arity(op, inputs, 1)?;
        let x = inputs[0];
        want_dtype(op, "x", x, DType::F32)?;
        let Some(&n) = x.shape.first() else {
            return Err(OpError::shape(op, "x must have a row dimension"));
        };
        if self.len == 0 || self.start.checked_add(self.len).is_none_or(|end| end > n) {
            return Err(OpError::shape(
                op,
                format!(
                    "rows {}..{}+{} are not a non-empty range inside the {n} rows of {x}",
                    self.start, self.start, self.len
                ),
            ));
        }
        let mut shape = x.shape.clone();
        shape[0] = self.len;
        Ok(vec![TensorMeta::f32(shape)])
    }

    fn cpu(
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

    fn describe(&self) -> String {
        format!("slice_rows(start={}, len={})", self.start, self.len)
    }

    fn cuda(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::elementwise::testkit::*;

    #[test]
    fn argmax_takes_the_first_of_tied_maxima() {
        let x = [1.0, 5.0, 5.0, -1.0, /* row 2 */ -3.0, -2.0, -7.0, -2.0];
        let out = run(&Argmax, &[&Owned::f32([2, 4], &x)]).unwrap();
        assert_eq!(out[0].to_i32(), vec![1, 1]);
    }

    #[test]
    fn argmax_handles_infinities() {
        let x = [
            f32::NEG_INFINITY,
            f32::NEG_INFINITY,
            -1e30,
            f32::INFINITY,
            1.0,
            f32::INFINITY,
        ];
        let out = run(&Argmax, &[&Owned::f32([2, 3], &x)]).unwrap();
        assert_eq!(out[0].to_i32(), vec![2, 0]);
    }

    #[test]
    fn a_row_holding_nan_is_a_data_error_naming_the_row() {
        let x = [1.0, 2.0, 3.0, 4.0, f32::NAN, 9.0];
        let e = run(&Argmax, &[&Owned::f32([2, 3], &x)]).unwrap_err();
        assert!(matches!(e, OpError::Data { op: "argmax", .. }), "{e}");
        assert!(e.to_string().contains("row 1"), "{e}");
    }

    #[test]
    fn argmax_refuses_non_f32_and_non_matrix_input() {
        let e = infer(&Argmax, &[TensorMeta::new([2, 3], DType::BF16)]).unwrap_err();
        assert!(matches!(e, OpError::Shape { .. }), "{e}");
        let e = infer(&Argmax, &[TensorMeta::f32([6])]).unwrap_err();
        assert!(matches!(e, OpError::Shape { .. }), "{e}");
    }

    #[test]
    fn slice_rows_copies_the_requested_rows() {
        let x: Vec<f32> = (0..24).map(|i| i as f32).collect();
        let op = SliceRows { start: 1, len: 2 };
        let out = run(&op, &[&Owned::f32([4, 2, 3], &x)]).unwrap();
        assert_eq!(out[0].meta, TensorMeta::f32([2, 2, 3]));
        assert_eq!(out[0].to_f32(), x[6..18].to_vec());
        assert_eq!(op.describe(), "slice_rows(start=1, len=2)");
    }

    #[test]
    fn slice_rows_refuses_a_range_past_the_end_or_empty() {
        for (start, len) in [(3, 2), (5, 1), (0, 0), (usize::MAX, 2)] {
            let e = infer(&SliceRows { start, len }, &[TensorMeta::f32([4, 8])]).unwrap_err();
            assert!(
                matches!(
                    e,
                    OpError::Shape {
                        op: "slice_rows",
                        ..
                    }
                ),
                "{start},{len}: {e}"
            );
        }
        assert!(infer(&SliceRows { start: 3, len: 1 }, &[TensorMeta::f32([4, 8])]).is_ok());
    }
}
