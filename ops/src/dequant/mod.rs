//! The block-quantized weight formats as the kernels read them: `dequant.cuh` (included, by
//! `concat!`, ahead of every family's source that dequantizes weights: linear, embedding,
//! moe) and the weight-type code its `switch`es take.

use crate::OpError;
use crate::tensor::{DType, TensorMeta};

/// The weight-type code of `dequant/dequant.cuh`.
pub(crate) fn wt_code(dtype: DType) -> Option<i32> {
    Some(match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::Q8_0 => 3,
        DType::Q6_K => 4,
        DType::IQ4_NL => 5,
        DType::I32 => return None,
    })
}

/// The `dequant.cuh` code of weight `w` and the bytes of its rows of `n_in` values, for the
/// kernels that read any stored type value by value; Err names `what` and the rule when `n_in`
/// is not whole storage blocks (or 0).
pub(crate) fn weight_rows(
    op: &'static str,
    what: &str,
    w: &TensorMeta,
    n_in: usize,
) -> Result<(i32, usize), OpError> {
    match (wt_code(w.dtype), w.dtype.row_bytes(n_in)) {
        (Some(wt), Some(row_bytes)) if n_in > 0 => Ok((wt, row_bytes)),
        _ => Err(OpError::shape(
            op,
            format!("{what} {w} with input width {n_in} is not whole storage blocks"),
        )),
    }
}
