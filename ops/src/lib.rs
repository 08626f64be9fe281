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
pub mod moe;
pub mod norm;
mod op;
pub mod parity;
pub mod rope;
pub mod tensor;

pub use op::{Op, OpError};
pub use tensor::{AlignedBuf, DType, HostTensor, HostTensorMut, TensorMeta};
