//! The CPU reference of the embedding lookup.

use rayon::prelude::*;

use super::{Embedding, OP};
use crate::OpError;
use crate::op::check_host;
use crate::tensor::{DType, HostTensor, HostTensorMut};

/// `out[t] = table[tokens[t]]` for a table of `v` rows of `d` values stored as
/// `dtype`. Every id is checked before anything is written.
pub fn embed_rows(
    table: &[u8],
    dtype: DType,
    v: usize,
    d: usize,
    tokens: &[i32],
    out: &mut [f32],
) -> Result<(), OpError> {
    let ty = dtype
        .ggml()
        .ok_or_else(|| OpError::Type(format!("{dtype} is not a weight type")))?;
    let row = ty
        .row_bytes(d)
        .ok_or_else(|| OpError::Type(format!("{dtype} rows of {d} are not whole blocks")))?;
    if table.len() < v.saturating_mul(row) || out.len() < tokens.len().saturating_mul(d) {
        return Err(OpError::Type(format!(
            "embedding buffers too small: table {} (need {}), out {} (need {})",
            table.len(),
            v * row,
            out.len(),
            tokens.len() * d
        )));
    }
    if let Some((t, &id)) = tokens
        .iter()
        .enumerate()
        .find(|(_, id)| usize::try_from(**id).map_or(true, |i| i >= v))
    {
        return Err(OpError::data(
            OP,
            format!("token {t} has id {id}, outside the vocabulary of {v}"),
        ));
    }
    if d == 0 {
        return Ok(());
    }
    out.par_chunks_mut(d)
        .zip(tokens.par_iter())
        .for_each(|(o, &id)| {
            let id = id as usize;
            loader::quant::dequantize_row(ty, &table[id * row..(id + 1) * row], o);
        });
    Ok(())
}

impl Embedding {
    pub(super) fn cpu_ref(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_host(self, inputs, outputs)?;
        let table = &inputs[0];
        let (v, d) = (table.meta.shape[0], table.meta.shape[1]);
        embed_rows(
            table.data,
            table.meta.dtype,
            v,
            d,
            inputs[1].i32()?,
            outputs[0].f32_mut()?,
        )
    }
}
