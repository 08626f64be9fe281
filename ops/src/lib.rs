//! Typed operators: each one's parameters, shape rule, CPU reference (and, on
//! the GPU path, its CUDA kernel) and parity tests live side by side, one op a module.

pub mod cpu;
pub mod elementwise;
pub mod embedding;
pub mod gpu;
pub mod hc;
pub mod head;
pub mod linear;
pub mod mla;
pub mod mla_prefill;
pub mod moe;
pub mod moe_prefill;
pub mod norm;
mod op;
pub mod parity;
pub mod rope;
pub mod tensor;

pub use op::{Op, OpError};
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
