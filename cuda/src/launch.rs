use std::ffi::c_void;
use std::mem::size_of;

use cudarc::driver::{DeviceRepr, result, sys};

use crate::device::Device;
use crate::error::CudaError;
use crate::kernels::Kernel;
use crate::memory::{DeviceBuffer, DeviceView};

/// Grid or block dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dim3 {
    pub x: u32,
    pub y: u32,
    pub z: u32,
}

impl From<u32> for Dim3 {
    fn from(x: u32) -> Self {
        Dim3 { x, y: 1, z: 1 }
    }
}

impl From<(u32, u32)> for Dim3 {
    fn from((x, y): (u32, u32)) -> Self {
        Dim3 { x, y, z: 1 }
    }
}

impl From<(u32, u32, u32)> for Dim3 {
    fn from((x, y, z): (u32, u32, u32)) -> Self {
        Dim3 { x, y, z }
    }
}

impl Dim3 {
    fn tuple(self) -> (u32, u32, u32) {
        (self.x, self.y, self.z)
    }
}

/// A value a kernel parameter receives: scalars and `#[repr(C)]` structs ([`DeviceRepr`]) by
/// value, [`DeviceView`] and `&DeviceBuffer` as their device address.
///
/// # Safety
/// `arg_bytes` must return a pointer to `len` readable bytes that live as long as `self`.
pub unsafe trait KernelArg {
    /// The address and size of the bytes to pass.
    fn arg_bytes(&self) -> (*const u8, usize);
}

// SAFETY: points at self, which is size_of::<T>() bytes.
unsafe impl<T: DeviceRepr + Copy> KernelArg for T {
    fn arg_bytes(&self) -> (*const u8, usize) {
        ((self as *const T).cast(), size_of::<T>())
    }
}

// SAFETY: the returned pointer addresses the view's own u64 field.
unsafe impl<T> KernelArg for DeviceView<T> {
    fn arg_bytes(&self) -> (*const u8, usize) {
        let ptr: &u64 = self.ptr_ref();
        ((ptr as *const u64).cast(), size_of::<u64>())
    }
}

// SAFETY: the returned pointer addresses the buffer's own u64 field.
unsafe impl<T> KernelArg for &DeviceBuffer<T> {
    fn arg_bytes(&self) -> (*const u8, usize) {
        let ptr: &u64 = self.ptr_ref();
        ((ptr as *const u64).cast(), size_of::<u64>())
    }
}

/// Kernel arguments are copied into 16-byte aligned storage, enough for any CUDA parameter type.
#[derive(Clone, Copy)]
#[repr(C, align(16))]
struct ArgChunk([u8; 16]);

/// A kernel launch being assembled: `device.launch(&kernel).grid(g).block(b).arg(x)…`, then
/// [`Launch::enqueue`]. It owns copies of its arguments, so temporaries may be passed.
#[must_use = "a launch does nothing until enqueued"]
pub struct Launch<'a> {
    device: &'a Device,
    kernel: &'a Kernel,
    grid: Dim3,
    block: Dim3,
    shared_mem: u32,
    args: Vec<Box<[ArgChunk]>>,
}

impl Device {
    /// Starts a launch of `kernel` on this device's stream (grid 1, block 1, no shared memory).
    pub fn launch<'a>(&'a self, kernel: &'a Kernel) -> Launch<'a> {
        Launch {
            device: self,
            kernel,
            grid: Dim3::from(1),
            block: Dim3::from(1),
            shared_mem: 0,
            args: Vec::new(),
        }
    }
}

impl Launch<'_> {
    pub fn grid(mut self, grid: impl Into<Dim3>) -> Self {
        self.grid = grid.into();
        self
    }

    pub fn block(mut self, block: impl Into<Dim3>) -> Self {
        self.block = block.into();
        self
    }

    /// Dynamic shared memory per block, in bytes. Above 48 KiB the kernel's opt-in limit is
    /// raised automatically at enqueue.
    pub fn shared_mem(mut self, bytes: u32) -> Self {
        self.shared_mem = bytes;
        self
    }

    /// Appends the next kernel parameter.
    pub fn arg(mut self, value: impl KernelArg) -> Self {
        let (ptr, len) = value.arg_bytes();
        let mut store = vec![ArgChunk([0; 16]); len.div_ceil(16).max(1)].into_boxed_slice();
        // SAFETY: arg_bytes promises len readable bytes at ptr; store holds at least len bytes.
        unsafe { std::ptr::copy_nonoverlapping(ptr, store.as_mut_ptr().cast::<u8>(), len) };
        self.args.push(store);
        self
    }

    /// Enqueues the kernel on the device's stream; returns without waiting for it.
    ///
    /// # Safety
    /// The arguments must match the kernel's parameter list in number, order and type, every
    /// device address passed must stay allocated until the kernel has run, and the kernel must
    /// stay within the memory it is given.
    pub unsafe fn enqueue(self) -> Result<(), CudaError> {
        let (grid, block) = (self.grid.tuple(), self.block.tuple());
        if [grid.0, grid.1, grid.2, block.0, block.1, block.2].contains(&0) {
            return Err(CudaError::InvalidArgument {
                what: "kernel launch",
                detail: format!(
                    "kernel `{}` has a zero grid {grid:?} or block {block:?} dimension",
                    self.kernel.name()
                ),
            });
        }
        self.kernel.ensure_dynamic_shared_mem(self.shared_mem)?;
        let launch_error = |source| CudaError::Launch {
            kernel: self.kernel.name().to_string(),
            grid,
            block,
            shared_mem: self.shared_mem,
            source,
        };
        let stream = self.device.stream();
        stream.context().bind_to_thread().map_err(launch_error)?;
        let mut params: Vec<*mut c_void> = self
            .args
            .iter()
            .map(|a| a.as_ptr().cast::<c_void>().cast_mut())
            .collect();
        // SAFETY: params point into self.args, alive until this call returns (the driver copies
        // parameters at launch); argument correctness is the caller's contract.
        if !self.device.programmatic_launch() {
            return unsafe {
                result::launch_kernel(
                    self.kernel.function().cu_function(),
                    grid,
                    block,
                    self.shared_mem,
                    stream.cu_stream(),
                    &mut params,
                )
            }
            .map_err(launch_error);
        }
        // SAFETY: a zeroed attribute is a valid bit pattern; id and value are set below.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: self.shared_mem,
            hStream: stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: config, attr and params outlive the call (the driver copies them at launch).
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.kernel.function().cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(launch_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_of(arg: impl KernelArg) -> Vec<u8> {
        let (ptr, len) = arg.arg_bytes();
        unsafe { std::slice::from_raw_parts(ptr, len) }.to_vec()
    }

    #[test]
    fn scalars_pass_their_little_endian_bytes() {
        assert_eq!(bytes_of(0x0102_0304u32), vec![4, 3, 2, 1]);
        assert_eq!(bytes_of(1.0f32), 1.0f32.to_le_bytes().to_vec());
        assert_eq!(bytes_of(half::bf16::from_f32(1.0)), vec![0x80, 0x3f]);
        assert_eq!(bytes_of([7u8; 20]).len(), 20);
    }

    #[test]
    fn a_view_passes_its_device_address() {
        let v = DeviceView::<f32>::new(0xdead_beef_0000, 3);
        assert_eq!(bytes_of(v), 0xdead_beef_0000u64.to_le_bytes().to_vec());
    }

    #[test]
    fn dims_default_missing_axes_to_one() {
        assert_eq!(Dim3::from(5), Dim3 { x: 5, y: 1, z: 1 });
        assert_eq!(Dim3::from((5, 6)), Dim3 { x: 5, y: 6, z: 1 });
    }
}
