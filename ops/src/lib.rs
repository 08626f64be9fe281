//! Typed operators: each one's parameters, shape rule, CPU reference (and, on
//! the GPU path, its CUDA kernel) and parity tests live side by side, one op a module.

mod op;
pub mod tensor;

pub use op::{Op, OpError};
pub use tensor::{DType, HostTensor, HostTensorMut, TensorMeta};
