//! Typed access to one CUDA GPU through `cudarc` (driver loaded at run time, kernels compiled at
//! run time by NVRTC), so the workspace builds and tests on machines without CUDA.
//!
//! - [`Device`]: a context plus the single non-default stream that all work of this crate is
//!   enqueued on (graph capture needs a non-default stream), with the card's facts.
//! - [`DeviceBuffer`], [`DeviceArena`], [`DeviceView`]: typed device memory; an arena is one
//!   allocation handing out typed views at byte offsets chosen by a memory planner.
//! - [`KernelCache`]: NVRTC compilation to a CUBIN for the device's exact architecture, cached in
//!   memory and on disk; [`Module`] and [`Kernel`] are what it hands out.
//! - [`Launch`]: enqueue a kernel with grid, block, dynamic shared memory and arguments.
//! - [`Graph`]: capture work enqueued by a closure once, replay it many times.
//! - [`Timer`]: GPU-side elapsed time between two points of the stream.
//! - [`TensorMap`]: a TMA descriptor for a row-major f16 tensor, passed to kernels by value.
//! - [`Blas`]: cuBLAS bf16 GEMM (row-major `C = A·Bᵀ`, f32 accumulation) for prefill.
//!
//! Every fallible call returns [`CudaError`]; a missing driver, NVRTC or cuBLAS library is an
//! error, never a panic.

mod blas;
mod device;
mod error;
mod graph;
mod kernels;
mod launch;
mod memory;
mod tma;

pub use blas::{Blas, GemmOutput};
pub use device::{Device, DeviceInfo};
pub use error::CudaError;
pub use graph::{EventTrail, Graph, STALL_CU, Timer};
pub use kernels::{
    CacheStats, Kernel, KernelCache, KernelCacheConfig, Module, OfflineBuild, arch_for, cache_key,
    compile_offline, default_cache_dir, fnv1a64,
};
pub use launch::{Dim3, KernelArg, Launch};
pub use memory::{DeviceArena, DeviceBuffer, DeviceView};
pub use tma::{TensorMap, tensor_map_f16_2d_swizzle128};

/// The underlying cudarc crate, for anything this layer does not wrap.
pub use cudarc;
/// Element types that may live in device memory (plain old data, no pointers or padding rules
/// beyond C's). Implement it (unsafely) for `#[repr(C)]` block structs passed to kernels.
pub use cudarc::driver::DeviceRepr;
/// Element types for which all-zero bytes are a valid value (needed for zeroed allocation).
pub use cudarc::driver::ValidAsZeroBits;
