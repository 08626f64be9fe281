//! CPU references of the element-wise ops.

use rayon::prelude::*;

use super::{Add, SwiGlu};
use crate::OpError;
use crate::op::check_host;
use crate::tensor::{HostTensor, HostTensorMut};

/// Chunk of elements handed to one rayon task by the element-wise ops.
pub(super) const ELEMS_PER_TASK: usize = 1 << 14;

/// `out = silu(gate) · up` with `silu(z) = z / (1 + e^{−z})` (ggml's form; a
/// very negative gate gives −0, never NaN).
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    out.par_chunks_mut(ELEMS_PER_TASK)
        .zip(gate.par_chunks(ELEMS_PER_TASK))
        .zip(up.par_chunks(ELEMS_PER_TASK))
        .for_each(|((o, g), u)| {
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = g / (1.0 + (-g).exp()) * u;
            }
        });
}

/// `out = a + b`.
pub fn add(a: &[f32], b: &[f32], out: &mut [f32]) {
    out.par_chunks_mut(ELEMS_PER_TASK)
        .zip(a.par_chunks(ELEMS_PER_TASK))
        .zip(b.par_chunks(ELEMS_PER_TASK))
        .for_each(|((o, a), b)| {
            for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
                *o = a + b;
            }
        });
}

impl SwiGlu {
    pub(super) fn cpu_ref(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let (g, u) = (inputs[0].f32()?, inputs[1].f32()?);
        swiglu(g, u, outputs[0].f32_mut()?);
        Ok(())
    }
}

impl Add {
    pub(super) fn cpu_ref(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let (a, b) = (inputs[0].f32()?, inputs[1].f32()?);
        add(a, b, outputs[0].f32_mut()?);
        Ok(())
    }
}
