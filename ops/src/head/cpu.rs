//! CPU references of the head ops.

use rayon::prelude::*;

use super::{Argmax, SliceRows};
use crate::op::check_host;
use crate::tensor::{HostTensor, HostTensorMut};
use crate::{Op, OpError};

/// Index of the first largest value, or the index of the first NaN as `Err`.
pub fn argmax_row(x: &[f32]) -> Result<usize, usize> {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v.is_nan() {
            return Err(i);
        }
        // Strictly greater: ties keep the first index.
        if v > x[best] {
            best = i;
        }
    }
    Ok(best)
}

impl Argmax {
    pub(super) fn cpu_ref(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let v = inputs[0].meta.shape[1];
        let x = inputs[0].f32()?;
        let out = outputs[0].i32_mut()?;
        let picks: Vec<Result<usize, usize>> = x.par_chunks(v).map(argmax_row).collect();
        for (t, (o, p)) in out.iter_mut().zip(picks).enumerate() {
            match p {
                // V fits i32 (shape rule), so the index does.
                Ok(i) => *o = i as i32,
                Err(i) => {
                    return Err(OpError::data(
                        self.name(),
                        format!("row {t} holds NaN (first at column {i})"),
                    ));
                }
            }
        }
        Ok(())
    }
}

impl SliceRows {
    pub(super) fn cpu_ref(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let row: usize = inputs[0].meta.shape[1..].iter().product();
        let x = inputs[0].f32()?;
        outputs[0]
            .f32_mut()?
            .copy_from_slice(&x[self.start * row..(self.start + self.len) * row]);
        Ok(())
    }
}
