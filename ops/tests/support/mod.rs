//! The host-side harness the CPU op tests share: tensors in 4-byte-aligned storage, ops run
//! through the `Op` trait with NaN-poisoned outputs, and a small deterministic generator.

#![allow(dead_code)]

use ops::{HostTensor, HostTensorMut, Op, OpError, TensorMeta};

#[derive(Clone, Debug)]
pub struct Buf {
    pub meta: TensorMeta,
    pub words: Vec<u32>,
}

impl Buf {
    pub fn f32(shape: &[usize], v: &[f32]) -> Buf {
        assert_eq!(shape.iter().product::<usize>(), v.len());
        Buf {
            meta: TensorMeta::f32(shape),
            words: v.iter().map(|x| x.to_bits()).collect(),
        }
    }

    pub fn i32(shape: &[usize], v: &[i32]) -> Buf {
        Buf {
            meta: TensorMeta::i32(shape),
            words: v.iter().map(|&x| x as u32).collect(),
        }
    }

    pub fn raw(meta: TensorMeta, bytes: &[u8]) -> Buf {
        let words = bytes
            .chunks(4)
            .map(|c| {
                let mut w = [0u8; 4];
                w[..c.len()].copy_from_slice(c);
                u32::from_le_bytes(w)
            })
            .collect();
        Buf { meta, words }
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: u32 storage viewed as its bytes; u8 has no alignment or validity needs.
        unsafe {
            std::slice::from_raw_parts(self.words.as_ptr() as *const u8, self.words.len() * 4)
        }
    }

    pub fn f32s(&self) -> Vec<f32> {
        self.words.iter().map(|&w| f32::from_bits(w)).collect()
    }
}

pub fn bytes_mut(w: &mut [u32]) -> &mut [u8] {
    // SAFETY: as `Buf::bytes`, exclusively borrowed.
    unsafe { std::slice::from_raw_parts_mut(w.as_mut_ptr() as *mut u8, w.len() * 4) }
}

/// Runs `op` into the given output buffers.
pub fn run_into(op: &dyn Op, inputs: &[&Buf], mut outs: Vec<Buf>) -> Result<Vec<Buf>, OpError> {
    let ins: Vec<HostTensor<'_>> = inputs
        .iter()
        .map(|b| HostTensor::new(&b.meta, b.bytes()))
        .collect();
    let mut views: Vec<HostTensorMut<'_>> = outs
        .iter_mut()
        .map(|b| HostTensorMut::new(&b.meta, bytes_mut(&mut b.words)))
        .collect();
    op.cpu(&ins, &mut views)?;
    drop(views);
    Ok(outs)
}

/// Runs `op` into fresh outputs poisoned with NaN, so an unwritten element shows.
pub fn run(op: &dyn Op, inputs: &[&Buf]) -> Result<Vec<Buf>, OpError> {
    let metas: Vec<&TensorMeta> = inputs.iter().map(|b| &b.meta).collect();
    let outs = op
        .infer(&metas)?
        .into_iter()
        .map(|m| Buf {
            words: vec![f32::NAN.to_bits(); m.numel()],
            meta: m,
        })
        .collect();
    run_into(op, inputs, outs)
}

pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.unit()).collect()
    }
}
