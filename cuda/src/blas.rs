use std::ffi::c_void;

use cudarc::cublas::result as cublas_result;
use cudarc::cublas::sys as cublas_sys;
use cudarc::cublas::{CudaBlas, sys::cudaDataType_t};
use half::bf16;

use crate::device::Device;
use crate::error::{CudaError, guarded, lib_candidates};
use crate::memory::DeviceView;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
}

/// Output element types of [`Blas::gemm_bf16`]: `f32` (widened) or `bf16`.
pub trait GemmOutput: sealed::Sealed {
    #[doc(hidden)]
    const DATA_TYPE: cudaDataType_t;
}

impl GemmOutput for f32 {
    const DATA_TYPE: cudaDataType_t = cudaDataType_t::CUDA_R_32F;
}

impl GemmOutput for bf16 {
    const DATA_TYPE: cudaDataType_t = cudaDataType_t::CUDA_R_16BF;
}

/// A cuBLAS handle bound to the device's stream.
pub struct Blas {
    blas: CudaBlas,
    device: Device,
}

impl std::fmt::Debug for Blas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Blas")
    }
}

fn dim(what: &'static str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::InvalidArgument {
        what: "gemm_bf16",
        detail: format!("{what} = {v} exceeds cuBLAS's i32 limit"),
    })
}

fn need(what: &'static str, rows: usize, cols: usize, got: usize) -> Result<(), CudaError> {
    let expected = rows.checked_mul(cols).ok_or(CudaError::InvalidArgument {
        what: "gemm_bf16",
        detail: format!("{what} of {rows}x{cols} elements overflows usize"),
    })?;
    if got < expected {
        return Err(CudaError::LengthMismatch {
            what,
            expected,
            got,
        });
    }
    Ok(())
}

impl Blas {
    pub fn new(device: &Device) -> Result<Blas, CudaError> {
        let present = guarded("looking for the cuBLAS library", || unsafe {
            cublas_sys::is_culib_present()
        })?;
        if !present {
            return Err(CudaError::CublasNotLoaded {
                tried: lib_candidates("cublas"),
            });
        }
        let blas = guarded("creating a cuBLAS handle", || {
            CudaBlas::new(device.stream().clone())
        })?
        .map_err(|source| CudaError::Cublas {
            call: "cublasCreate",
            source,
        })?;
        Ok(Blas {
            blas,
            device: device.clone(),
        })
    }

    /// Enqueues row-major `C[m×n] = alpha · A[m×k] · B[n×k]ᵀ + beta · C` with bf16 inputs and
    /// f32 accumulation (the layout of a weight matrix stored out×in). No host sync.
    ///
    /// # Safety
    /// The views must address live allocations of this device that stay allocated until the
    /// GEMM has run, and `c` must not overlap `a` or `b`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_bf16<C: GemmOutput>(
        &self,
        m: usize,
        n: usize,
        k: usize,
        a: DeviceView<bf16>,
        b: DeviceView<bf16>,
        c: DeviceView<C>,
        alpha: f32,
        beta: f32,
    ) -> Result<(), CudaError> {
        need("gemm_bf16 A (m×k)", m, k, a.len())?;
        need("gemm_bf16 B (n×k)", n, k, b.len())?;
        need("gemm_bf16 C (m×n)", m, n, c.len())?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        // SAFETY: the lengths were checked above; the rest is the caller's contract.
        unsafe {
            self.gemm_ex(
                (m, n, k),
                (a.device_ptr(), b.device_ptr(), c.device_ptr()),
                C::DATA_TYPE,
                alpha,
                beta,
            )
        }
    }

    /// Enqueues row-major `C[m×n] = A[m×k] · B[n×k]ᵀ` (bf16 inputs, f32 accumulation and
    /// output) on operands known only by device address (planned arena slots), with
    /// `workspace` (`workspace_bytes` long, 256-byte aligned) as cuBLAS's workspace for this
    /// call: nothing is allocated, so the call can be captured into a graph, and the memory is
    /// the caller's (an op's scratch), never shared between graphs. The handle's default
    /// workspace is restored before returning. No host sync.
    ///
    /// # Safety
    /// `a`, `b` and `c` must address at least m·k bf16, n·k bf16 and m·n f32 of live memory
    /// of this device, and `workspace` `workspace_bytes` bytes, all staying allocated until the
    /// GEMM has run; `c` and `workspace` must not overlap each other or `a` and `b`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_bf16_f32_at(
        &self,
        m: usize,
        n: usize,
        k: usize,
        a: u64,
        b: u64,
        c: u64,
        workspace: u64,
        workspace_bytes: usize,
    ) -> Result<(), CudaError> {
        if !workspace.is_multiple_of(256) {
            return Err(CudaError::InvalidArgument {
                what: "gemm_bf16_f32_at",
                detail: format!("workspace 0x{workspace:x} is not 256-byte aligned"),
            });
        }
        if m == 0 || n == 0 {
            return Ok(());
        }
        let handle = *self.blas.handle();
        // SAFETY: the handle is alive; the workspace's validity is the caller's contract.
        unsafe {
            cublas_sys::cublasSetWorkspace_v2(handle, workspace as *mut c_void, workspace_bytes)
        }
        .result()
        .map_err(|source| CudaError::Cublas {
            call: "cublasSetWorkspace",
            source,
        })?;
        // SAFETY: the caller's contract.
        let done =
            unsafe { self.gemm_ex((m, n, k), (a, b, c), cudaDataType_t::CUDA_R_32F, 1.0, 0.0) };
        // Setting the stream puts the handle back on its default workspace, so no later GEMM
        // writes into this caller's memory.
        // SAFETY: the handle and the device's stream are alive.
        let restored =
            unsafe { cublas_result::set_stream(handle, self.device.stream().cu_stream() as _) }
                .map_err(|source| CudaError::Cublas {
                    call: "cublasSetStream",
                    source,
                });
        done.and(restored)
    }

    fn bind(&self) -> Result<(), CudaError> {
        self.device
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))
    }

    /// `cublasGemmEx` for row-major `C = alpha · A·Bᵀ + beta · C` at addresses (a, b, c).
    ///
    /// # Safety
    /// As [`Blas::gemm_bf16`], for the addresses.
    unsafe fn gemm_ex(
        &self,
        (m, n, k): (usize, usize, usize),
        (a, b, c): (u64, u64, u64),
        c_type: cudaDataType_t,
        alpha: f32,
        beta: f32,
    ) -> Result<(), CudaError> {
        let (mi, ni, ki) = (dim("m", m)?, dim("n", n)?, dim("k", k)?);
        let lda_b = ki.max(1);
        self.bind()?;
        // Row-major C = A·Bᵀ is column-major Cᵀ (n×m) = op(B)·op(A) with B read transposed: each
        // row-major matrix is its column-major transpose with the same leading dimension.
        // SAFETY: the handle is alive; pointer validity is the caller's contract.
        unsafe {
            cublas_result::gemm_ex(
                *self.blas.handle(),
                cublas_sys::cublasOperation_t::CUBLAS_OP_T,
                cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                ni,
                mi,
                ki,
                (&alpha as *const f32).cast::<c_void>(),
                b as *const c_void,
                cudaDataType_t::CUDA_R_16BF,
                lda_b,
                a as *const c_void,
                cudaDataType_t::CUDA_R_16BF,
                lda_b,
                (&beta as *const f32).cast::<c_void>(),
                c as *mut c_void,
                c_type,
                ni,
                cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|source| CudaError::Cublas {
            call: "cublasGemmEx",
            source,
        })
    }
}
