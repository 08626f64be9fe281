//! Tensor maps for the Hopper tensor memory accelerator (TMA): the 128-byte descriptor a
//! `cp.async.bulk.tensor` instruction reads, encoded by the driver and passed to a kernel by
//! value (a `const __grid_constant__` parameter), so a captured graph carries it.

use cudarc::driver::{DeviceRepr, DriverError, sys};

use crate::CudaError;
use crate::error::guarded;

/// An encoded `CUtensorMap`: opaque bytes, 64-byte aligned as the kernel parameter is.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
pub struct TensorMap(pub [u64; 16]);

// SAFETY: plain bytes, passed by value as the kernel's 128-byte parameter.
unsafe impl DeviceRepr for TensorMap {}

/// A row-major 2-D tensor of f16 at `base`: `rows` rows of `cols` values, `row_bytes` apart,
/// read in boxes of `box_rows` rows × `box_cols` values laid out in shared memory with the
/// 128-byte swizzle (a box row is then at most 128 bytes: `box_cols` ≤ 64). Rows and columns
/// past the tensor read as zeros.
pub fn tensor_map_f16_2d_swizzle128(
    base: u64,
    cols: u64,
    rows: u64,
    row_bytes: u64,
    box_cols: u32,
    box_rows: u32,
) -> Result<TensorMap, CudaError> {
    let bad = |what: String| CudaError::TensorMap { detail: what };
    if box_cols == 0 || box_cols * 2 > 128 || box_rows == 0 || box_rows > 256 {
        return Err(bad(format!(
            "a box of {box_rows} rows × {box_cols} f16 (at most 256 rows of 128 bytes)"
        )));
    }
    if !base.is_multiple_of(16) || !row_bytes.is_multiple_of(16) || row_bytes < cols * 2 {
        return Err(bad(format!(
            "base {base:#x} and row stride {row_bytes} must be multiples of 16 and the stride at \
             least {cols} f16"
        )));
    }
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    let dims = [cols, rows];
    let strides = [row_bytes];
    let boxes = [box_cols, box_rows];
    let element_strides = [1u32, 1];
    // SAFETY: the pointers address locals of the sizes the rank (2) asks for; the call only
    // encodes (it does not touch device memory).
    let res = guarded("encoding a tensor map", || unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            2,
            base as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    })?;
    res.result().map_err(|e: DriverError| CudaError::Driver {
        call: "cuTensorMapEncodeTiled",
        source: e,
    })?;
    Ok(TensorMap(map.opaque))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_box_wider_than_the_swizzle_or_a_misaligned_tensor_is_refused_before_the_driver() {
        let wide = tensor_map_f16_2d_swizzle128(0x1000, 576, 256, 1152, 65, 64).unwrap_err();
        assert!(wide.to_string().contains("64 rows × 65 f16"), "{wide}");
        let tall = tensor_map_f16_2d_swizzle128(0x1000, 576, 256, 1152, 64, 257).unwrap_err();
        assert!(tall.to_string().contains("257 rows"), "{tall}");
        let base = tensor_map_f16_2d_swizzle128(0x1008, 576, 256, 1152, 64, 64).unwrap_err();
        assert!(base.to_string().contains("0x1008"), "{base}");
        let stride = tensor_map_f16_2d_swizzle128(0x1000, 576, 256, 1150, 64, 64).unwrap_err();
        assert!(stride.to_string().contains("stride 1150"), "{stride}");
    }
}
