//! Owned, 4-byte-aligned tensor storage and the generator for this crate's unit tests.

use crate::tensor::{DType, HostTensor, HostTensorMut, TensorMeta};
use crate::{Op, OpError};

#[derive(Debug)]
pub(crate) struct Owned {
    pub meta: TensorMeta,
    words: Vec<u32>,
    len: usize,
}

impl Owned {
    pub fn from_bytes(meta: TensorMeta, bytes: &[u8]) -> Self {
        let mut words = vec![0u32; bytes.len().div_ceil(4)];
        for (w, c) in words.iter_mut().zip(bytes.chunks(4)) {
            let mut b = [0u8; 4];
            b[..c.len()].copy_from_slice(c);
            *w = u32::from_le_bytes(b);
        }
        Owned {
            meta,
            words,
            len: bytes.len(),
        }
    }

    pub fn f32(shape: impl Into<Vec<usize>>, v: &[f32]) -> Self {
        let meta = TensorMeta::f32(shape);
        assert_eq!(meta.numel(), v.len(), "test data does not fill {meta}");
        Owned {
            meta,
            words: v.iter().map(|x| x.to_bits()).collect(),
            len: v.len() * 4,
        }
    }

    pub fn i32(shape: impl Into<Vec<usize>>, v: &[i32]) -> Self {
        let meta = TensorMeta::i32(shape);
        assert_eq!(meta.numel(), v.len(), "test data does not fill {meta}");
        Owned {
            meta,
            words: v.iter().map(|x| *x as u32).collect(),
            len: v.len() * 4,
        }
    }

    /// Output storage poisoned with NaN (f32) or i32::MIN, so an element the
    /// op forgets to write shows.
    pub fn poisoned(meta: TensorMeta) -> Self {
        let bytes = meta.bytes().expect("test output of whole blocks");
        let fill = if meta.dtype == DType::I32 {
            i32::MIN as u32
        } else {
            f32::NAN.to_bits()
        };
        Owned {
            meta,
            words: vec![fill; bytes.div_ceil(4)],
            len: bytes,
        }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: u32 storage viewed as its own bytes; `len` never exceeds them.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr() as *const u8, self.len) }
    }

    pub fn view(&self) -> HostTensor<'_> {
        HostTensor::new(&self.meta, self.bytes())
    }

    pub fn view_mut(&mut self) -> HostTensorMut<'_> {
        // SAFETY: as in `bytes`, through an exclusive borrow of the words.
        let data =
            unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr() as *mut u8, self.len) };
        HostTensorMut::new(&self.meta, data)
    }

    pub fn to_f32(&self) -> Vec<f32> {
        self.view().f32().expect("an F32 tensor").to_vec()
    }

    pub fn to_i32(&self) -> Vec<i32> {
        self.view().i32().expect("an I32 tensor").to_vec()
    }
}

/// Infers the outputs, poisons them and runs the CPU reference.
pub(crate) fn run(op: &dyn Op, inputs: &[&Owned]) -> Result<Vec<Owned>, OpError> {
    let metas: Vec<&TensorMeta> = inputs.iter().map(|t| &t.meta).collect();
    let mut outs: Vec<Owned> = op.infer(&metas)?.into_iter().map(Owned::poisoned).collect();
    let views: Vec<HostTensor<'_>> = inputs.iter().map(|t| t.view()).collect();
    let mut out_views: Vec<HostTensorMut<'_>> = outs.iter_mut().map(|o| o.view_mut()).collect();
    op.cpu(&views, &mut out_views)?;
    drop(out_views);
    Ok(outs)
}

/// Metadata-only shape check, for refusal tests.
pub(crate) fn infer(op: &dyn Op, metas: &[TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
    let refs: Vec<&TensorMeta> = metas.iter().collect();
    op.infer(&refs)
}

/// The crate's one test generator (`parity::Rng`), for the unit tests.
pub(crate) use crate::parity::Rng;
