//! Tensor metadata and the host views the CPU backend hands to operators.

use std::fmt;

use loader::GgmlType;

use crate::OpError;

/// Element or block type of a tensor, as the graph and the kernels see it.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    I32,
    Q8_0,
    Q6_K,
    IQ4_NL,
}

impl DType {
    pub fn from_ggml(t: GgmlType) -> DType {
        match t {
            GgmlType::F32 => DType::F32,
            GgmlType::F16 => DType::F16,
            GgmlType::BF16 => DType::BF16,
            GgmlType::Q8_0 => DType::Q8_0,
            GgmlType::Q6_K => DType::Q6_K,
            GgmlType::IQ4_NL => DType::IQ4_NL,
        }
    }

    /// The storage type of a weight, `None` for I32 (never stored in a checkpoint here).
    pub fn ggml(self) -> Option<GgmlType> {
        Some(match self {
            DType::F32 => GgmlType::F32,
            DType::F16 => GgmlType::F16,
            DType::BF16 => GgmlType::BF16,
            DType::Q8_0 => GgmlType::Q8_0,
            DType::Q6_K => GgmlType::Q6_K,
            DType::IQ4_NL => GgmlType::IQ4_NL,
            DType::I32 => return None,
        })
    }

    /// Bytes of a row of `n` innermost values, `None` when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        match self {
            DType::I32 => Some(n * 4),
            other => other.ggml().and_then(|g| g.row_bytes(n)),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::I32 => "I32",
            other => other.ggml().map(|g| g.name()).unwrap_or("?"),
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Shape (outermost dimension first, innermost contiguous: `[tokens, hidden]`,
/// a weight is `[out, in]`) and type of a tensor.
///
/// GGUF writes `ne` innermost first; a GGUF tensor with `ne = [in, out]` is
/// `TensorMeta { shape: [out, in] }` here.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorMeta {
    pub shape: Vec<usize>,
    pub dtype: DType,
}

impl TensorMeta {
    pub fn new(shape: impl Into<Vec<usize>>, dtype: DType) -> Self {
        TensorMeta {
            shape: shape.into(),
            dtype,
        }
    }

    pub fn f32(shape: impl Into<Vec<usize>>) -> Self {
        Self::new(shape, DType::F32)
    }

    pub fn i32(shape: impl Into<Vec<usize>>) -> Self {
        Self::new(shape, DType::I32)
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Innermost dimension (1 for a scalar).
    pub fn inner(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    /// Product of all dimensions but the innermost.
    pub fn rows(&self) -> usize {
        if self.shape.is_empty() {
            1
        } else {
            self.shape[..self.shape.len() - 1].iter().product()
        }
    }

    /// Bytes the tensor occupies, `None` when the innermost dimension is not whole blocks.
    pub fn bytes(&self) -> Option<usize> {
        self.dtype.row_bytes(self.inner()).map(|r| r * self.rows())
    }
}

impl fmt::Display for TensorMeta {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[", self.dtype)?;
        for (i, d) in self.shape.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// A read-only tensor in host memory: weights (zero-copy from the memory map)
/// or activations (in the executor's arena).
#[derive(Clone, Copy, Debug)]
pub struct HostTensor<'a> {
    pub meta: &'a TensorMeta,
    pub data: &'a [u8],
}

/// A writable tensor in host memory.
#[derive(Debug)]
pub struct HostTensorMut<'a> {
    pub meta: &'a TensorMeta,
    pub data: &'a mut [u8],
}

fn cast_check<T>(
    meta: &TensorMeta,
    len: usize,
    ptr: *const u8,
    want: DType,
) -> Result<usize, OpError> {
    if meta.dtype != want {
        return Err(OpError::Type(format!("expected {want}, found {meta}")));
    }
    if ptr.align_offset(std::mem::align_of::<T>()) != 0 {
        return Err(OpError::Type(format!(
            "{meta} data is not aligned for {want}"
        )));
    }
    let n = meta.numel();
    if len < n * std::mem::size_of::<T>() {
        return Err(OpError::Type(format!(
            "{meta} needs {} bytes, buffer has {len}",
            n * std::mem::size_of::<T>()
        )));
    }
    Ok(n)
}

impl<'a> HostTensor<'a> {
    pub fn new(meta: &'a TensorMeta, data: &'a [u8]) -> Self {
        HostTensor { meta, data }
    }

    pub fn f32(&self) -> Result<&'a [f32], OpError> {
        let n = cast_check::<f32>(self.meta, self.data.len(), self.data.as_ptr(), DType::F32)?;
        // SAFETY: length, alignment and type were checked above; f32 has no invalid bit patterns.
        Ok(unsafe { std::slice::from_raw_parts(self.data.as_ptr() as *const f32, n) })
    }

    pub fn i32(&self) -> Result<&'a [i32], OpError> {
        let n = cast_check::<i32>(self.meta, self.data.len(), self.data.as_ptr(), DType::I32)?;
        // SAFETY: as above.
        Ok(unsafe { std::slice::from_raw_parts(self.data.as_ptr() as *const i32, n) })
    }
}

impl<'a> HostTensorMut<'a> {
    pub fn new(meta: &'a TensorMeta, data: &'a mut [u8]) -> Self {
        HostTensorMut { meta, data }
    }

    pub fn f32_mut(&mut self) -> Result<&mut [f32], OpError> {
        let n = cast_check::<f32>(self.meta, self.data.len(), self.data.as_ptr(), DType::F32)?;
        // SAFETY: length, alignment and type were checked above.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.data.as_mut_ptr() as *mut f32, n) })
    }

    pub fn i32_mut(&mut self) -> Result<&mut [i32], OpError> {
        let n = cast_check::<i32>(self.meta, self.data.len(), self.data.as_ptr(), DType::I32)?;
        // SAFETY: as above.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.data.as_mut_ptr() as *mut i32, n) })
    }

    pub fn as_ref(&self) -> HostTensor<'_> {
        HostTensor {
            meta: self.meta,
            data: self.data,
        }
    }
}

/// A zeroed byte buffer aligned for any element type the ops read.
#[derive(Clone, Debug, Default)]
pub struct AlignedBuf {
    words: Vec<u128>,
    len: usize,
}

impl AlignedBuf {
    pub fn zeroed(len: usize) -> Self {
        AlignedBuf {
            words: vec![0u128; len.div_ceil(16)],
            len,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the words own at least `len` initialized bytes; u8 has alignment 1.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr() as *const u8, self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr() as *mut u8, self.len) }
    }

    pub fn f32s(&self) -> &[f32] {
        // SAFETY: 16-byte aligned storage, length rounded down to whole f32s.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr() as *const f32, self.len / 4) }
    }

    pub fn f32s_mut(&mut self) -> &mut [f32] {
        // SAFETY: as above, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr() as *mut f32, self.len / 4) }
    }
}
