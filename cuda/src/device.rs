use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys::{self, CUdevice_attribute, CUresult};
use cudarc::driver::{CudaContext, CudaStream, DeviceRepr, DriverError, ValidAsZeroBits};

use crate::error::{CudaError, guarded, lib_candidates};
use crate::memory::{DeviceArena, DeviceBuffer};

/// Facts about the card, read once when the device is opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// (major, minor), e.g. (9, 0) for Hopper.
    pub compute_capability: (u32, u32),
    pub sm_count: u32,
    pub total_memory: usize,
    pub l2_cache_bytes: usize,
    /// The most dynamic shared memory one block may opt in to.
    pub max_shared_mem_per_block_optin: usize,
    /// The CUDA version the installed driver supports, (major, minor).
    pub driver_version: (u32, u32),
}

/// One GPU: a context and the non-default stream all of this crate's work is enqueued on.
///
/// Clones share the context and the stream. Open each GPU once and clone the `Device`: cross-
/// stream event tracking is off (it breaks graph capture), so buffers must stay on one stream.
#[derive(Clone)]
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    info: Arc<DeviceInfo>,
    programmatic: Arc<AtomicBool>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("info", &self.info).finish()
    }
}

/// Checks the driver library exists before cudarc would panic trying to load it, then runs
/// `cuInit`, mapping its failures to errors that say what is missing.
fn init_driver() -> Result<(), CudaError> {
    let present = guarded("looking for the CUDA driver library", || unsafe {
        sys::is_culib_present()
    })?;
    if !present {
        return Err(CudaError::DriverNotLoaded {
            tried: lib_candidates("cuda"),
        });
    }
    match guarded("initialising the CUDA driver", cudarc::driver::result::init) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(init_error(e)),
        Err(CudaError::Panicked { message, .. }) if message.contains("dynamically load") => {
            Err(CudaError::DriverNotLoaded { tried: message })
        }
        Err(e) => Err(e),
    }
}

fn init_error(e: DriverError) -> CudaError {
    match e.0 {
        CUresult::CUDA_ERROR_NO_DEVICE => CudaError::NoDevice {
            detail: format!("cuInit reported {e}"),
        },
        _ => CudaError::Driver {
            call: "cuInit",
            source: e,
        },
    }
}

fn check_alloc_size<T>(len: usize) -> Result<(), CudaError> {
    match len.checked_mul(std::mem::size_of::<T>()) {
        Some(_) => Ok(()),
        None => Err(CudaError::InvalidArgument {
            what: "device allocation",
            detail: format!(
                "{len} elements of {} overflow the address space",
                std::any::type_name::<T>()
            ),
        }),
    }
}

impl Device {
    /// How many CUDA GPUs the driver sees. Errors (rather than 0) when the driver is missing.
    pub fn available() -> Result<usize, CudaError> {
        match init_driver() {
            Err(CudaError::NoDevice { .. }) => return Ok(0),
            other => other?,
        }
        let count = guarded(
            "counting CUDA devices",
            cudarc::driver::result::device::get_count,
        )?
        .map_err(CudaError::driver("cuDeviceGetCount"))?;
        Ok(usize::try_from(count).unwrap_or(0))
    }

    /// Opens GPU `ordinal`: retains its primary context, creates the work stream and reads the
    /// card's facts.
    pub fn open(ordinal: usize) -> Result<Device, CudaError> {
        let count = Device::available()?;
        if count == 0 {
            return Err(CudaError::NoDevice {
                detail: "the CUDA driver loaded but reports 0 devices".into(),
            });
        }
        if ordinal >= count {
            return Err(CudaError::OrdinalOutOfRange { ordinal, count });
        }
        guarded("opening a CUDA device", || Device::open_checked(ordinal))?
    }

    fn open_checked(ordinal: usize) -> Result<Device, CudaError> {
        let ctx =
            CudaContext::new(ordinal).map_err(CudaError::driver("cuDevicePrimaryCtxRetain"))?;
        // SAFETY: every buffer of this crate is allocated on, and used from, the one stream
        // below, so cudarc's cross-stream events are not needed; they would also be recorded
        // into (and break) stream capture.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(CudaError::driver("cuStreamCreate"))?;
        let attr = |a: CUdevice_attribute, call: &'static str| -> Result<u32, CudaError> {
            let v = ctx.attribute(a).map_err(CudaError::driver(call))?;
            Ok(u32::try_from(v).unwrap_or(0))
        };
        let (major, minor) = ctx.compute_capability().map_err(CudaError::driver(
            "cuDeviceGetAttribute(COMPUTE_CAPABILITY)",
        ))?;
        let mut drv: std::ffi::c_int = 0;
        unsafe { sys::cuDriverGetVersion(&mut drv) }
            .result()
            .map_err(CudaError::driver("cuDriverGetVersion"))?;
        let drv = u32::try_from(drv).unwrap_or(0);
        let info = DeviceInfo {
            ordinal,
            name: ctx.name().map_err(CudaError::driver("cuDeviceGetName"))?,
            compute_capability: (
                u32::try_from(major).unwrap_or(0),
                u32::try_from(minor).unwrap_or(0),
            ),
            sm_count: attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)",
            )?,
            total_memory: ctx
                .total_mem()
                .map_err(CudaError::driver("cuDeviceTotalMem"))?,
            l2_cache_bytes: attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE,
                "cuDeviceGetAttribute(L2_CACHE_SIZE)",
            )? as usize,
            max_shared_mem_per_block_optin: attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                "cuDeviceGetAttribute(MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)",
            )? as usize,
            driver_version: (drv / 1000, (drv % 1000) / 10),
        };
        let programmatic = info.compute_capability.0 >= 9
            && std::env::var("XING4_PROGRAMMATIC_LAUNCH").map_or(true, |v| v != "0");
        Ok(Device {
            ctx,
            stream,
            info: Arc::new(info),
            programmatic: Arc::new(AtomicBool::new(programmatic)),
        })
    }

    /// Whether launches carry the programmatic-stream-serialization attribute: a kernel may
    /// then be scheduled while its predecessor drains, and holds at `griddepcontrol.wait` (the
    /// first statement of every kernel of this project, `PDL_ENTER`) until the predecessor has
    /// finished and its writes are visible. It hides the launch latency between dependent
    /// kernels. On by default from compute capability 9.0; `XING4_PROGRAMMATIC_LAUNCH=0` turns
    /// it off. The flag is shared by every clone of the device: the graph executor turns it on
    /// for decode steps and off for prefill steps (where it measured slower).
    pub fn programmatic_launch(&self) -> bool {
        self.programmatic.load(Ordering::Relaxed)
    }

    /// Turns programmatic launches on or off for every clone of this device (from the next
    /// launch or capture on). Ignored below compute capability 9.0.
    pub fn set_programmatic_launch(&self, on: bool) {
        self.programmatic
            .store(on && self.info.compute_capability.0 >= 9, Ordering::Relaxed);
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    pub fn ordinal(&self) -> usize {
        self.info.ordinal
    }

    pub fn name(&self) -> &str {
        &self.info.name
    }

    pub fn compute_capability(&self) -> (u32, u32) {
        self.info.compute_capability
    }

    pub fn sm_count(&self) -> u32 {
        self.info.sm_count
    }

    pub fn total_memory(&self) -> usize {
        self.info.total_memory
    }

    /// The NVRTC target for this card, e.g. `sm_90a` on an H100/H200.
    pub fn arch(&self) -> String {
        let (major, minor) = self.info.compute_capability;
        crate::kernels::arch_for(major, minor)
    }

    /// (free, total) device memory in bytes, as the driver reports it now.
    pub fn mem_get_info(&self) -> Result<(usize, usize), CudaError> {
        self.ctx
            .mem_get_info()
            .map_err(CudaError::driver("cuMemGetInfo"))
    }

    /// Waits until everything enqueued on the device's stream has finished.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream
            .synchronize()
            .map_err(CudaError::driver("cuStreamSynchronize"))
    }

    /// A zero-filled buffer of `len` elements.
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<DeviceBuffer<T>, CudaError> {
        check_alloc_size::<T>(len)?;
        let slice = self
            .stream
            .alloc_zeros::<T>(len)
            .map_err(CudaError::driver("cuMemAlloc"))?;
        Ok(DeviceBuffer::from_slice(slice))
    }

    /// A buffer of `len` elements with unspecified contents.
    ///
    /// # Safety
    /// The contents must be written before they are read.
    pub unsafe fn alloc_uninit<T: DeviceRepr>(
        &self,
        len: usize,
    ) -> Result<DeviceBuffer<T>, CudaError> {
        check_alloc_size::<T>(len)?;
        let slice =
            unsafe { self.stream.alloc::<T>(len) }.map_err(CudaError::driver("cuMemAlloc"))?;
        Ok(DeviceBuffer::from_slice(slice))
    }

    /// A new buffer holding a copy of `data`.
    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<DeviceBuffer<T>, CudaError> {
        let slice = self
            .stream
            .clone_htod(data)
            .map_err(CudaError::driver("cuMemcpyHtoD"))?;
        Ok(DeviceBuffer::from_slice(slice))
    }

    /// A zero-filled arena of `bytes` bytes (see [`DeviceArena`]).
    pub fn arena(&self, bytes: usize) -> Result<DeviceArena, CudaError> {
        Ok(DeviceArena::from_buffer(self.alloc_zeros::<u8>(bytes)?))
    }

    /// The cudarc context, for what this crate does not wrap.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream all work of this device is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}
