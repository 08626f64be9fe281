//! Typed operators, one folder per family (`hc/`, `mla/`, `moe/`, `linear/`, `norm/`, `head/`,
//! `elementwise/`, `embedding/`, `rope/`): in each, the ops' parameters and shape rules
//! (`mod.rs` or a file per op), the CPU reference (`cpu.rs`), the CUDA launches (`cuda.rs`),
//! the CUDA sources (`*.cu`) and the family's unit tests (`tests.rs`). Shared validation is in
//! `check`, the dequantizing device header every weight-reading kernel includes in `dequant/`.

mod check;
pub mod cpu;
mod dequant;
pub mod elementwise;
pub mod embedding;
pub mod gpu;
pub mod hc;
pub mod head;
pub mod linear;
pub mod mla;

pub mod moe;

pub mod norm;
mod op;
pub mod parity;
pub mod rope;
pub mod tensor;
#[cfg(test)]
mod testkit;

pub use op::{CacheReads, Op, OpError, RoutedWeights};
pub use tensor::{AlignedBuf, DType, HostTensor, HostTensorMut, TensorMeta};

/// Every CUDA source the ops compile, under the name each is compiled with, so a machine with
/// NVRTC but no card can check that all of them build (`tests/kernels_compile.rs`).
pub fn kernel_sources() -> [(&'static str, &'static str); 10] {
    [
        ("elementwise.cu", elementwise::ELEMENTWISE_CU),
        ("embedding.cu", embedding::EMBEDDING_CU),
        ("hc.cu", hc::HC_CU),
        ("head.cu", head::HEAD_CU),
        ("linear.cu", linear::LINEAR_CU),
        ("mla.cu", mla::MLA_CU),
        ("mla_prefill.cu", mla_prefill::MLA_PREFILL_CU),
        ("moe.cu", moe::MOE_CU),
        ("moe_prefill.cu", moe_prefill::MOE_PREFILL_CU),
        ("norm.cu", norm::NORM_CU),
    ]
}

/// The tensor-core MLA attention for prefill chunks (`mla/prefill.rs`), at its former path.
pub use mla::prefill as mla_prefill;
/// The tensor-core expert GEMMs for prefill (`moe/prefill.rs`), at their former path.
pub use moe::prefill as moe_prefill;
