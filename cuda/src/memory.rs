use std::marker::PhantomData;
use std::mem::{align_of, size_of};
use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits, result};

use crate::error::CudaError;

/// A typed window onto device memory: a raw device address and an element count.
///
/// A view does not keep its allocation alive and carries no lifetime, so that planned arenas and
/// captured graphs can store views freely. The safe copy methods live on the owners
/// ([`DeviceBuffer`], [`DeviceArena`]), which check that a view lies inside them; passing a view
/// to a kernel or GEMM is `unsafe` and requires the owner to outlive the work.
pub struct DeviceView<T> {
    ptr: u64,
    len: usize,
    _elem: PhantomData<fn() -> T>,
}

impl<T> Clone for DeviceView<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for DeviceView<T> {}

impl<T> PartialEq for DeviceView<T> {
    fn eq(&self, other: &Self) -> bool {
        self.ptr == other.ptr && self.len == other.len
    }
}
impl<T> Eq for DeviceView<T> {}

impl<T> std::fmt::Debug for DeviceView<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceView<{}>(0x{:x}, len {})",
            std::any::type_name::<T>(),
            self.ptr,
            self.len
        )
    }
}

impl<T> DeviceView<T> {
    pub(crate) fn new(ptr: u64, len: usize) -> Self {
        DeviceView {
            ptr,
            len,
            _elem: PhantomData,
        }
    }

    /// The device address of the first element (what a kernel's `T*` parameter receives).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    pub(crate) fn ptr_ref(&self) -> &u64 {
        &self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn num_bytes(&self) -> usize {
        self.len * size_of::<T>()
    }

    /// Elements `range` of this view.
    pub fn slice(&self, range: Range<usize>) -> Result<DeviceView<T>, CudaError> {
        if range.start > range.end || range.end > self.len {
            return Err(CudaError::OutOfBounds {
                what: "DeviceView::slice",
                start: range.start.saturating_mul(size_of::<T>()),
                end: range.end.saturating_mul(size_of::<T>()),
                size: self.num_bytes(),
            });
        }
        Ok(DeviceView::new(
            self.ptr + (range.start * size_of::<T>()) as u64,
            range.end - range.start,
        ))
    }
}

/// Byte range `offset..offset + len * size_of::<T>()` if it fits in `size` bytes and `offset`
/// is aligned for `T`.
pub(crate) fn checked_byte_range<T>(
    what: &'static str,
    offset: usize,
    len: usize,
    size: usize,
) -> Result<Range<usize>, CudaError> {
    let align = align_of::<T>();
    if !offset.is_multiple_of(align) {
        return Err(CudaError::Misaligned {
            what,
            offset,
            align,
        });
    }
    let end = len
        .checked_mul(size_of::<T>())
        .and_then(|bytes| bytes.checked_add(offset));
    match end {
        Some(end) if end <= size => Ok(offset..end),
        _ => Err(CudaError::OutOfBounds {
            what,
            start: offset,
            end: end.unwrap_or(usize::MAX),
            size,
        }),
    }
}

/// Copies `src` to device address `dst` on `stream` and waits, so `src` may be dropped at once.
///
/// # Safety
/// `dst` must address at least `src.len()` writable elements on this stream's device.
pub(crate) unsafe fn copy_htod<T: DeviceRepr>(
    stream: &CudaStream,
    dst: u64,
    src: &[T],
) -> Result<(), CudaError> {
    if src.is_empty() {
        return Ok(());
    }
    stream
        .context()
        .bind_to_thread()
        .map_err(CudaError::driver("cuCtxSetCurrent"))?;
    unsafe { result::memcpy_htod_async(dst, src, stream.cu_stream()) }
        .map_err(CudaError::driver("cuMemcpyHtoDAsync"))?;
    stream
        .synchronize()
        .map_err(CudaError::driver("cuStreamSynchronize"))
}

/// Copies from device address `src` into `dst` on `stream` and waits for the data.
///
/// # Safety
/// `src` must address at least `dst.len()` readable elements on this stream's device.
pub(crate) unsafe fn copy_dtoh<T: DeviceRepr>(
    stream: &CudaStream,
    dst: &mut [T],
    src: u64,
) -> Result<(), CudaError> {
    if dst.is_empty() {
        return Ok(());
    }
    stream
        .context()
        .bind_to_thread()
        .map_err(CudaError::driver("cuCtxSetCurrent"))?;
    unsafe { result::memcpy_dtoh_async(dst, src, stream.cu_stream()) }
        .map_err(CudaError::driver("cuMemcpyDtoHAsync"))?;
    stream
        .synchronize()
        .map_err(CudaError::driver("cuStreamSynchronize"))
}

/// Owned device memory holding `len` elements of `T`, freed (stream-ordered) on drop.
pub struct DeviceBuffer<T> {
    slice: CudaSlice<T>,
    ptr: u64,
}

impl<T> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceBuffer<{}>(0x{:x}, len {})",
            std::any::type_name::<T>(),
            self.ptr,
            self.len()
        )
    }
}

impl<T> DeviceBuffer<T> {
    pub(crate) fn from_slice(slice: CudaSlice<T>) -> Self {
        // Event tracking is off for this crate's contexts, so the guard returned with the
        // pointer does nothing when dropped.
        let ptr = slice.device_ptr(slice.stream()).0;
        DeviceBuffer { slice, ptr }
    }

    pub fn len(&self) -> usize {
        self.slice.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slice.is_empty()
    }

    pub fn num_bytes(&self) -> usize {
        self.slice.num_bytes()
    }

    /// The device address of the first element.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    pub(crate) fn ptr_ref(&self) -> &u64 {
        &self.ptr
    }

    /// A view of the whole buffer.
    pub fn view(&self) -> DeviceView<T> {
        DeviceView::new(self.ptr, self.len())
    }

    /// A view of elements `range`.
    pub fn slice(&self, range: Range<usize>) -> Result<DeviceView<T>, CudaError> {
        self.view().slice(range)
    }

    /// The cudarc slice, for cudarc APIs this crate does not wrap.
    pub fn as_cudarc(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

impl<T: DeviceRepr> DeviceBuffer<T> {
    /// Overwrites the whole buffer with `src` (lengths must match).
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<(), CudaError> {
        if src.len() != self.len() {
            return Err(CudaError::LengthMismatch {
                what: "DeviceBuffer::copy_from_host",
                expected: self.len(),
                got: src.len(),
            });
        }
        // SAFETY: the buffer holds exactly src.len() elements.
        unsafe { copy_htod(self.slice.stream(), self.ptr, src) }
    }

    /// Copies the whole buffer into `dst` (lengths must match), waiting for the data.
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<(), CudaError> {
        if dst.len() != self.len() {
            return Err(CudaError::LengthMismatch {
                what: "DeviceBuffer::copy_to_host",
                expected: self.len(),
                got: dst.len(),
            });
        }
        // SAFETY: the buffer holds exactly dst.len() elements.
        unsafe { copy_dtoh(self.slice.stream(), dst, self.ptr) }
    }

    /// The buffer's contents, after all work enqueued before this call has finished.
    pub fn to_vec(&self) -> Result<Vec<T>, CudaError>
    where
        T: Default + Clone,
    {
        let mut out = vec![T::default(); self.len()];
        self.copy_to_host(&mut out)?;
        Ok(out)
    }

    /// Elements `range` of the buffer, after all work enqueued before this call has finished.
    pub fn download_range(&self, range: Range<usize>) -> Result<Vec<T>, CudaError>
    where
        T: Default + Clone,
    {
        let view = self.slice(range)?;
        let mut out = vec![T::default(); view.len()];
        // SAFETY: the view was bounds-checked against this live buffer.
        unsafe { copy_dtoh(self.slice.stream(), &mut out, view.device_ptr()) }?;
        Ok(out)
    }

    /// Enqueues a device-to-device copy of `src` into this buffer (lengths must match); no host
    /// sync.
    pub fn copy_from_device(&mut self, src: &DeviceBuffer<T>) -> Result<(), CudaError> {
        if src.len() != self.len() {
            return Err(CudaError::LengthMismatch {
                what: "DeviceBuffer::copy_from_device",
                expected: self.len(),
                got: src.len(),
            });
        }
        let stream = self.slice.stream();
        stream
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        // SAFETY: both buffers hold num_bytes bytes and are alive for this call; the copy is
        // stream-ordered before any later free of either.
        unsafe {
            result::memcpy_dtod_async(self.ptr, src.ptr, self.num_bytes(), stream.cu_stream())
        }
        .map_err(CudaError::driver("cuMemcpyDtoDAsync"))
    }
}

impl<T: DeviceRepr + ValidAsZeroBits> DeviceBuffer<T> {
    /// Enqueues a fill of the buffer with zero bytes; no host sync.
    pub fn zero(&mut self) -> Result<(), CudaError> {
        let stream = self.slice.stream().clone();
        stream
            .memset_zeros(&mut self.slice)
            .map_err(CudaError::driver("cuMemsetD8Async"))
    }
}

/// One large device allocation carved into typed views at byte offsets chosen by the caller
/// (a memory planner): activations of a planned graph, a KV cache, weights.
#[derive(Debug)]
pub struct DeviceArena {
    buf: DeviceBuffer<u8>,
}

impl DeviceArena {
    pub(crate) fn from_buffer(buf: DeviceBuffer<u8>) -> Self {
        DeviceArena { buf }
    }

    pub fn num_bytes(&self) -> usize {
        self.buf.len()
    }

    /// The device address of byte 0 (cudarc allocations are at least 256-byte aligned).
    pub fn base_ptr(&self) -> u64 {
        self.buf.device_ptr()
    }

    /// `len` elements of `T` starting `byte_offset` bytes into the arena. Errors when the range
    /// leaves the arena or the offset is not aligned for `T`.
    pub fn view<T>(&self, byte_offset: usize, len: usize) -> Result<DeviceView<T>, CudaError> {
        let range =
            checked_byte_range::<T>("DeviceArena::view", byte_offset, len, self.num_bytes())?;
        Ok(DeviceView::new(self.base_ptr() + range.start as u64, len))
    }

    /// Checks that `view` lies inside this arena.
    fn check_contains<T>(&self, what: &'static str, view: &DeviceView<T>) -> Result<(), CudaError> {
        let base = self.base_ptr();
        let start = view.ptr.checked_sub(base).map(|o| o as usize);
        match start {
            Some(start) => {
                checked_byte_range::<T>(what, start, view.len, self.num_bytes()).map(|_| ())
            }
            None => Err(CudaError::OutOfBounds {
                what,
                start: 0,
                end: view.num_bytes(),
                size: self.num_bytes(),
            }),
        }
    }

    /// Copies `src` into `view` (which must lie in this arena and have `src.len()` elements).
    pub fn upload<T: DeviceRepr>(
        &mut self,
        view: DeviceView<T>,
        src: &[T],
    ) -> Result<(), CudaError> {
        self.check_contains("DeviceArena::upload", &view)?;
        if src.len() != view.len {
            return Err(CudaError::LengthMismatch {
                what: "DeviceArena::upload",
                expected: view.len,
                got: src.len(),
            });
        }
        // SAFETY: the view was checked to lie inside this live allocation.
        unsafe { copy_htod(self.buf.slice.stream(), view.ptr, src) }
    }

    /// The contents of `view` (which must lie in this arena), after all enqueued work.
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        view: DeviceView<T>,
    ) -> Result<Vec<T>, CudaError> {
        self.check_contains("DeviceArena::download", &view)?;
        let mut out = vec![T::default(); view.len];
        // SAFETY: the view was checked to lie inside this live allocation.
        unsafe { copy_dtoh(self.buf.slice.stream(), &mut out, view.ptr) }?;
        Ok(out)
    }

    /// The arena's stream, its context bound to this thread for a raw driver call.
    fn bound_stream(&self) -> Result<&Arc<CudaStream>, CudaError> {
        let stream = self.buf.slice.stream();
        stream
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        Ok(stream)
    }

    /// Enqueues a device-to-device copy of `view` (which must lie in this arena) into `dst`
    /// starting `at` elements in; no host sync.
    pub fn copy_into<T: DeviceRepr>(
        &self,
        view: DeviceView<T>,
        dst: &mut DeviceBuffer<T>,
        at: usize,
    ) -> Result<(), CudaError> {
        self.check_contains("DeviceArena::copy_into", &view)?;
        if at.checked_add(view.len).is_none_or(|end| end > dst.len()) {
            return Err(CudaError::OutOfBounds {
                what: "DeviceArena::copy_into",
                start: at,
                end: at.saturating_add(view.len),
                size: dst.len(),
            });
        }
        if view.is_empty() {
            return Ok(());
        }
        let stream = self.bound_stream()?;
        let to = dst.device_ptr() + (at * std::mem::size_of::<T>()) as u64;
        // SAFETY: the source lies inside this live allocation and the destination range inside
        // `dst` (both checked above); the copy is stream-ordered before any later free.
        unsafe { result::memcpy_dtod_async(to, view.ptr, view.num_bytes(), stream.cu_stream()) }
            .map_err(CudaError::driver("cuMemcpyDtoDAsync"))
    }

    /// Enqueues a fill of `view` (which must lie in this arena) with zero bytes; no host sync.
    pub fn zero<T>(&mut self, view: DeviceView<T>) -> Result<(), CudaError> {
        self.check_contains("DeviceArena::zero", &view)?;
        if view.is_empty() {
            return Ok(());
        }
        let stream = self.bound_stream()?;
        // SAFETY: the view was checked to lie inside this live allocation.
        unsafe { result::memset_d8_async(view.ptr, 0, view.num_bytes(), stream.cu_stream()) }
            .map_err(CudaError::driver("cuMemsetD8Async"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_in_bounds_aligned_range_is_accepted_with_its_byte_extent() {
        let r = checked_byte_range::<f32>("t", 8, 4, 24).unwrap();
        assert_eq!(r, 8..24);
        assert_eq!(checked_byte_range::<u8>("t", 0, 0, 0).unwrap(), 0..0);
    }

    #[test]
    fn a_range_past_the_end_is_out_of_bounds_with_the_numbers() {
        let err = checked_byte_range::<f32>("arena view", 8, 5, 24).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(
            err,
            CudaError::OutOfBounds {
                start: 8,
                end: 28,
                size: 24,
                ..
            }
        ));
        assert!(
            msg.contains("arena view") && msg.contains("8..28") && msg.contains("0..24"),
            "{msg}"
        );
    }

    #[test]
    fn an_overflowing_length_is_out_of_bounds_not_a_panic() {
        let err = checked_byte_range::<u64>("t", 0, usize::MAX / 4, 1 << 20).unwrap_err();
        assert!(matches!(err, CudaError::OutOfBounds { .. }));
    }

    #[test]
    fn an_offset_not_aligned_for_the_element_is_misaligned() {
        let err = checked_byte_range::<u32>("t", 6, 1, 64).unwrap_err();
        assert!(matches!(
            err,
            CudaError::Misaligned {
                offset: 6,
                align: 4,
                ..
            }
        ));
        assert!(checked_byte_range::<u16>("t", 6, 1, 64).is_ok());
    }

    #[test]
    fn a_view_slice_moves_the_address_by_whole_elements_and_checks_bounds() {
        let v = DeviceView::<f32>::new(0x1000, 10);
        let s = v.slice(2..5).unwrap();
        assert_eq!(s.device_ptr(), 0x1008);
        assert_eq!(s.len(), 3);
        assert!(v.slice(4..11).is_err());
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = v.slice(5..4);
        assert!(reversed.is_err());
    }
}
