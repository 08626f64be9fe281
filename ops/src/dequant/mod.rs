//! The block-quantized weight formats as the kernels read them: `dequant.cuh` (included, by
//! `concat!`, ahead of every family's source that dequantizes weights: linear, embedding,
//! moe) and the weight-type code its `switch`es take.

use crate::tensor::DType;

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
