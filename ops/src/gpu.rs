//! The CUDA side of the operator contract: device views of tensors, the context
//! kernels are launched with, and the parity harness every kernel is tested by.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use cuda::{Blas, Device, Kernel, KernelCache};

use crate::OpError;
use crate::tensor::TensorMeta;

/// A tensor in device memory: its metadata and its address. Views carry no
/// lifetime on the device side; the executor keeps the storage alive.
#[derive(Clone, Copy, Debug)]
pub struct DeviceTensor<'a> {
    pub meta: &'a TensorMeta,
    /// Device address of the first byte.
    pub ptr: u64,
    /// Bytes available at `ptr`.
    pub bytes: usize,
}

/// Scratch memory an op asked for (`Op::cuda_scratch_bytes`), valid for one launch sequence.
#[derive(Clone, Copy, Debug, Default)]
pub struct Scratch {
    pub ptr: u64,
    pub bytes: usize,
}

impl Scratch {
    /// `Ok` when this scratch holds at least `need` bytes; otherwise the typed error naming the
    /// op, what it got and what it needed (its `cuda_scratch_bytes` promised that much).
    pub fn require(&self, op: &str, need: usize) -> Result<(), OpError> {
        if self.bytes < need {
            return Err(OpError::Type(format!(
                "{op}: scratch of {} bytes, {need} needed",
                self.bytes
            )));
        }
        Ok(())
    }
}

/// What a kernel launch needs: the device (and its stream), the NVRTC kernel cache
/// and a cuBLAS handle.
pub struct GpuCtx {
    pub device: Device,
    pub kernels: KernelCache,
    pub blas: Arc<Blas>,
    /// Kernels already looked up, by (source name, function): an eager step looks
    /// up every kernel it launches, and hashing whole sources each time cost ~44 µs a launch.
    loaded: Mutex<HashMap<(String, String), Kernel>>,
}

impl std::fmt::Debug for GpuCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuCtx({})", self.device.name())
    }
}

impl GpuCtx {
    pub fn new(device: Device) -> Result<GpuCtx, OpError> {
        let kernels = KernelCache::new(&device).map_err(dev_err)?;
        let blas = Arc::new(Blas::new(&device).map_err(dev_err)?);
        Ok(GpuCtx {
            device,
            kernels,
            blas,
            loaded: Mutex::new(HashMap::new()),
        })
    }

    /// Opens GPU `ordinal`, or says why not.
    pub fn open(ordinal: usize) -> Result<GpuCtx, OpError> {
        GpuCtx::new(Device::open(ordinal).map_err(dev_err)?)
    }

    /// The kernel `name` from a CUDA C source (compiled once per process, cached on disk).
    /// Sources are identified by name within a process: each `.cu` file has one.
    pub fn kernel(&self, source_name: &str, source: &str, name: &str) -> Result<Kernel, OpError> {
        let key = (source_name.to_string(), name.to_string());
        let mut loaded = self.loaded.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(k) = loaded.get(&key) {
            return Ok(k.clone());
        }
        let k = self
            .kernels
            .get(source_name, source, &[name])
            .and_then(|m| m.kernel(name))
            .map_err(dev_err)?;
        loaded.insert(key, k.clone());
        Ok(k)
    }
}

/// Converts a device-layer error into an op error.
pub fn dev_err(e: cuda::CudaError) -> OpError {
    OpError::Device(e.to_string())
}

/// Grid size for `n` items at `per_block` items a block.
pub fn blocks_for(n: usize, per_block: usize) -> u32 {
    n.div_ceil(per_block.max(1)).max(1) as u32
}
