//! The GGUF v3 container: metadata values, reading over a memory map, streaming writing.
//!
//! Layout (spec §6.1, little-endian): magic `GGUF`, u32 version 3, u64 tensor count, u64 key count,
//! the key/value pairs, the tensor infos, zero padding to the alignment, then the data section.
//! Tensor offsets are relative to the data section and multiples of the alignment
//! (`general.alignment`, u32, default 32).

mod reader;
mod value;
mod writer;

use std::path::PathBuf;

pub use reader::GgufFile;
pub use value::{Metadata, MetadataError, Value, ValueType};
pub use writer::{GgufWriter, TensorSpec};

use crate::GgmlType;
use crate::quant::BlockSizeError;

/// The first four bytes of every GGUF file (0x46554747 as a little-endian u32).
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
pub const GGUF_VERSION: u32 = 3;
pub const DEFAULT_ALIGNMENT: u64 = 32;
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// ggml's `GGML_MAX_DIMS`: llama.cpp refuses tensors with more dimensions.
pub const MAX_DIMS: usize = 4;

/// One tensor's entry in the tensor-info block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions, `ne0` (the contiguous one) first.
    pub ne: Vec<u64>,
    pub ty: GgmlType,
    /// Relative to the start of the data section.
    pub offset: u64,
    pub n_bytes: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.ne.iter().product()
    }

    /// Outer-first (row-major) shape: `ne` reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.ne.iter().rev().map(|&n| n as usize).collect()
    }
}

/// Bytes of a tensor of type `ty` with dimensions `ne`, or `None` when `ne0` is not a whole
/// number of blocks or the size overflows. No dimensions means a scalar (one element).
pub fn tensor_n_bytes(ty: GgmlType, ne: &[u64]) -> Option<u64> {
    let ne0 = ne.first().copied().unwrap_or(1);
    let block = ty.block_size() as u64;
    if ne0 % block != 0 {
        return None;
    }
    // ggml keeps element counts in int64; anything larger cannot be a real tensor.
    let n_elements = ne.iter().try_fold(1u64, |acc, &n| acc.checked_mul(n))?;
    if n_elements > i64::MAX as u64 {
        return None;
    }
    ne.iter().skip(1).try_fold(
        (ne0 / block).checked_mul(ty.block_bytes() as u64)?,
        |acc, &n| acc.checked_mul(n),
    )
}

pub(crate) fn align_up(x: u64, alignment: u64) -> Option<u64> {
    x.checked_next_multiple_of(alignment)
}

/// Everything that can be wrong with reading or writing a GGUF file. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: {action}: {source}", path = path.display())]
    Io {
        path: PathBuf,
        action: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a GGUF file: magic is {found:02x?}, expected \"GGUF\" (47 47 55 46)", path = path.display())]
    BadMagic { path: PathBuf, found: Vec<u8> },
    #[error("{path}: unsupported GGUF version {version} (only version 3 is read)", path = path.display())]
    UnsupportedVersion { path: PathBuf, version: u32 },
    #[error(
        "{path}: truncated in {section}: needs {expected} bytes at offset {offset}, only {available} remain",
        path = path.display()
    )]
    Truncated {
        path: PathBuf,
        section: String,
        offset: u64,
        expected: u64,
        available: u64,
    },
    #[error(
        "{path}: {what} declares a length of {length}, more than the {remaining} bytes left in the file",
        path = path.display()
    )]
    LengthTooLarge {
        path: PathBuf,
        what: String,
        length: u64,
        remaining: u64,
    },
    #[error("{path}: metadata key `{key}` has unknown value type id {id}", path = path.display())]
    UnknownValueType { path: PathBuf, key: String, id: u32 },
    #[error("{path}: tensor `{tensor}` has unknown or unsupported ggml type id {id}", path = path.display())]
    UnknownGgmlType {
        path: PathBuf,
        tensor: String,
        id: u32,
    },
    #[error("{path}: {what} is not valid UTF-8", path = path.display())]
    InvalidUtf8 { path: PathBuf, what: String },
    #[error(
        "{path}: tensor `{tensor}` ({ty}) has ne0 = {ne0}, not a multiple of the block size {block_size}",
        path = path.display()
    )]
    NotWholeBlocks {
        path: PathBuf,
        tensor: String,
        ty: GgmlType,
        ne0: u64,
        block_size: usize,
    },
    #[error(
        "{path}: tensor `{tensor}` has offset {offset}, not a multiple of the alignment {alignment}",
        path = path.display()
    )]
    MisalignedOffset {
        path: PathBuf,
        tensor: String,
        offset: u64,
        alignment: u64,
    },
    #[error(
        "{path}: file is truncated or tensor `{tensor}` lies past its end: its data spans bytes {start}..{end} of a {file_size}-byte file",
        path = path.display()
    )]
    DataPastEnd {
        path: PathBuf,
        tensor: String,
        start: u64,
        end: u64,
        file_size: u64,
    },
    #[error(
        "{path}: tensors `{first}` (data offsets {first_start}..{first_end}) and `{second}` (from {second_start}) overlap",
        path = path.display()
    )]
    OverlappingTensors {
        path: PathBuf,
        first: String,
        first_start: u64,
        first_end: u64,
        second: String,
        second_start: u64,
    },
    #[error("{path}: no tensor named `{tensor}`", path = path.display())]
    MissingTensor { path: PathBuf, tensor: String },
    /// Structural problems that are rarer than the above (duplicate names, bad alignment value,
    /// too many dimensions, size overflow, nesting depth, an invalid bool byte).
    #[error("{path}: {what}: {problem}", path = path.display())]
    Malformed {
        path: PathBuf,
        what: String,
        problem: String,
    },
    #[error("{path}: tensor `{tensor}`: {source}", path = path.display())]
    Dequantize {
        path: PathBuf,
        tensor: String,
        #[source]
        source: BlockSizeError,
    },
    #[error(
        "{path}: tensor `{tensor}` must be {expected} bytes, {found} were written",
        path = path.display()
    )]
    WrongDataSize {
        path: PathBuf,
        tensor: String,
        expected: u64,
        found: u64,
    },
    #[error(
        "{path}: tensors must be written in declared order: expected `{expected}`, got `{found}`",
        path = path.display()
    )]
    OutOfOrder {
        path: PathBuf,
        expected: String,
        found: String,
    },
    #[error(
        "{path}: {} declared tensor(s) were never written, starting with `{}`",
        missing.len(), missing.first().map(String::as_str).unwrap_or(""), path = path.display()
    )]
    MissingTensorData { path: PathBuf, missing: Vec<String> },
}

impl GgufError {
    pub(crate) fn malformed(
        path: &std::path::Path,
        what: impl Into<String>,
        problem: impl Into<String>,
    ) -> GgufError {
        GgufError::Malformed {
            path: path.to_path_buf(),
            what: what.into(),
            problem: problem.into(),
        }
    }
}
