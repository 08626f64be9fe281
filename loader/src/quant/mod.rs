//! Block formats: dequantization of every supported storage type (spec §6.2)
//! and the quantizers the checkpoint writer uses.

mod dequant;

pub use dequant::{IQ4NL_CODEBOOK, dequantize, dequantize_block_bf16, dequantize_row};

use crate::GgmlType;

/// A buffer whose length is not what its type and value count require.
#[derive(Debug, thiserror::Error)]
#[error("{ty} data for {n_values} values must be {expected} bytes, found {found}")]
pub struct BlockSizeError {
    pub ty: GgmlType,
    pub n_values: usize,
    pub expected: usize,
    pub found: usize,
}
