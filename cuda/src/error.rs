use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;

use cudarc::cublas::result::CublasError;
use cudarc::driver::DriverError;
use cudarc::nvrtc::result::NvrtcError;

/// Everything that can go wrong in this crate. Messages name the library, kernel, source, file
/// or buffer at fault and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// `libcuda` (the NVIDIA driver's user-space library) is not installed or not on the
    /// loader's search path.
    #[error(
        "the CUDA driver library could not be loaded (tried: {tried}); install the NVIDIA driver \
         or add the directory holding libcuda.so.1 to LD_LIBRARY_PATH"
    )]
    DriverNotLoaded { tried: String },

    /// The driver loaded but reports no usable GPU.
    #[error("no CUDA GPU is visible: {detail}")]
    NoDevice { detail: String },

    #[error(
        "CUDA device ordinal {ordinal} is out of range: {count} device(s) visible \
         (valid ordinals are 0..{count})"
    )]
    OrdinalOutOfRange { ordinal: usize, count: usize },

    /// cudarc panicked (it does so for missing libraries or symbols); the panic was caught.
    #[error("cudarc panicked while {during}: {message}")]
    Panicked {
        during: &'static str,
        message: String,
    },

    /// A tensor map asked for a shape the tensor memory accelerator does not take.
    #[error("tensor map: {detail}")]
    TensorMap { detail: String },

    #[error("CUDA driver call {call} failed: {source}")]
    Driver {
        call: &'static str,
        #[source]
        source: DriverError,
    },

    #[error(
        "launching kernel `{kernel}` (grid {grid:?}, block {block:?}, {shared_mem} B dynamic \
         shared memory) failed: {source}"
    )]
    Launch {
        kernel: String,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_mem: u32,
        #[source]
        source: DriverError,
    },

    #[error(
        "the NVRTC library could not be loaded (tried: {tried}); install the CUDA toolkit's \
         NVRTC (libnvrtc.so) and add its directory to LD_LIBRARY_PATH"
    )]
    NvrtcNotLoaded { tried: String },

    #[error("NVRTC call {call} failed for kernel source `{source_name}`: {error}")]
    Nvrtc {
        call: &'static str,
        source_name: String,
        error: NvrtcError,
    },

    /// The source did not compile; `log` is NVRTC's full diagnostic output.
    #[error(
        "NVRTC could not compile kernel source `{source_name}` for {arch} (options: {options}):\n{log}"
    )]
    Compile {
        source_name: String,
        arch: String,
        options: String,
        log: String,
    },

    #[error("kernel source `{source_name}` is not valid input: {reason}")]
    InvalidSource { source_name: String, reason: String },

    #[error("kernel `{kernel}` could not be found in module `{source_name}`: {source}")]
    MissingKernel {
        source_name: String,
        kernel: String,
        #[source]
        source: DriverError,
    },

    #[error("kernel cache file {}: {source}", path.display())]
    CacheIo {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{what}: expected {expected} elements, got {got}")]
    LengthMismatch {
        what: &'static str,
        expected: usize,
        got: usize,
    },

    #[error("{what}: byte range {start}..{end} is outside the allocation's 0..{size}")]
    OutOfBounds {
        what: &'static str,
        start: usize,
        end: usize,
        size: usize,
    },

    #[error("{what}: byte offset {offset} is not a multiple of the element alignment {align}")]
    Misaligned {
        what: &'static str,
        offset: usize,
        align: usize,
    },

    #[error("{what}: {detail}")]
    InvalidArgument { what: &'static str, detail: String },

    #[error("stream capture ended without producing a graph")]
    EmptyCapture,

    #[error(
        "the cuBLAS library could not be loaded (tried: {tried}); install the CUDA toolkit's \
         cuBLAS (libcublas.so) and add its directory to LD_LIBRARY_PATH"
    )]
    CublasNotLoaded { tried: String },

    #[error("cuBLAS call {call} failed: {source}")]
    Cublas {
        call: &'static str,
        #[source]
        source: CublasError,
    },
}

impl CudaError {
    pub(crate) fn driver(call: &'static str) -> impl FnOnce(DriverError) -> CudaError {
        move |source| CudaError::Driver { call, source }
    }
}

/// Runs `f`, turning a panic inside cudarc (missing library or symbol) into an error.
pub(crate) fn guarded<T>(during: &'static str, f: impl FnOnce() -> T) -> Result<T, CudaError> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| CudaError::Panicked {
        during,
        message: panic_message(payload.as_ref()),
    })
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// The file names cudarc's loader tries for `lib` (e.g. "cuda" → libcuda.so, libcuda.so.1, …).
pub(crate) fn lib_candidates(lib: &str) -> String {
    let mut names: Vec<String> = Vec::new();
    for name in cudarc::get_lib_name_candidates(lib) {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    names.join(", ")
}
