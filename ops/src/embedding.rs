//! Token embedding lookup (spec §3.1): one table row per token, widened to f32.

use rayon::prelude::*;

use crate::elementwise::{arity, want_dtype};
use crate::gpu::{DeviceTensor, GpuCtx, Scratch, dev_err};
use crate::linear::{as_i32, wt_code};
use crate::op::check_device;
use crate::op::check_host;
use crate::tensor::{DType, HostTensor, HostTensorMut, TensorMeta};
use crate::{Op, OpError};

pub(crate) const EMBEDDING_CU: &str = concat!(
    include_str!("../kernels/dequant.cuh"),
    include_str!("../kernels/embedding.cu")
);

const OP: &str = "embedding";

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

/// Inputs: table `[V, D]` of any weight type (BF16 in the release), tokens I32 `[n]`.
/// Output F32 `[n, D]`. An id outside `[0, V)` is `OpError::Data`.
#[derive(Debug, Clone, PartialEq)]
pub struct Embedding;

impl Op for Embedding {
    fn name(&self) -> &'static str {
        OP
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        arity(OP, inputs, 2)?;
        let (table, tokens) = (inputs[0], inputs[1]);
        if table.shape.len() != 2 || table.dtype.ggml().is_none() {
            return Err(OpError::shape(
                OP,
                format!("table must be a stored [V, D] matrix, found {table}"),
            ));
        }
        if table.bytes().is_none() {
            return Err(OpError::shape(
                OP,
                format!(
                    "table {table}: rows of {} are not whole {} blocks",
                    table.shape[1], table.dtype
                ),
            ));
        }
        want_dtype(OP, "tokens", tokens, DType::I32)?;
        if tokens.shape.len() != 1 {
            return Err(OpError::shape(
                OP,
                format!("tokens must be [n], found {tokens}"),
            ));
        }
        Ok(vec![TensorMeta::f32([tokens.shape[0], table.shape[1]])])
    }

    fn cpu(
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

    fn describe(&self) -> String {
        OP.to_string()
    }

    /// Bit-identical to the CPU reference for in-range ids. A kernel cannot report an
    /// id outside `[0, V)`: that token's row is written as NaN and nothing is read for
    /// it (the engine checks ids on the host before they are uploaded).
    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        check_device(self, inputs, outputs)?;
        let (table, tokens, out) = (&inputs[0], &inputs[1], &outputs[0]);
        let (v, d, n) = (
            table.meta.shape[0],
            table.meta.shape[1],
            tokens.meta.shape[0],
        );
        if n == 0 || d == 0 {
            return Ok(());
        }
        if n > 65535 {
            return Err(OpError::shape(
                OP,
                format!("{n} tokens in one launch; at most 65535"),
            ));
        }
        if !table.ptr.is_multiple_of(4) {
            return Err(OpError::Type(format!(
                "embedding table at {:#x} is not 4-byte aligned",
                table.ptr
            )));
        }
        let dtype = table.meta.dtype;
        let (code, row) = wt_code(dtype).zip(dtype.row_bytes(d)).ok_or_else(|| {
            OpError::shape(OP, format!("table {} is not a stored matrix", table.meta))
        })?;
        let k = ctx.kernel("embedding.cu", EMBEDDING_CU, "embedding_rows")?;
        // SAFETY: the arguments follow embedding_rows' signature; check_device checked the
        // table holds V rows of `row` bytes, tokens n ids and out n×D f32; ids outside
        // [0, V) are never dereferenced.
        unsafe {
            ctx.device
                .launch(&k)
                .grid((d.div_ceil(256).min(64) as u32, n as u32))
                .block(256)
                .arg(table.ptr)
                .arg(tokens.ptr)
                .arg(out.ptr)
                .arg(as_i32(OP, "V", v)?)
                .arg(as_i32(OP, "D", d)?)
                .arg(row as i64)
                .arg(code)
                .enqueue()
                .map_err(dev_err)
        }
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;
    use crate::elementwise::testkit::*;

    fn bf16_table(v: usize, d: usize) -> (Vec<f32>, Owned) {
        let vals: Vec<f32> = (0..v * d)
            .map(|i| bf16::from_f32((i as f32 * 0.73).sin() * 3.0).to_f32())
            .collect();
        let bytes: Vec<u8> = vals
            .iter()
            .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
            .collect();
        (
            vals,
            Owned::from_bytes(TensorMeta::new([v, d], DType::BF16), &bytes),
        )
    }

    #[test]
    fn embedding_copies_the_bf16_rows_exactly() {
        let (v, d) = (11, 6);
        let (vals, table) = bf16_table(v, d);
        let ids = [3, 0, 10, 3];
        let out = run(&Embedding, &[&table, &Owned::i32([4], &ids)]).unwrap()[0].to_f32();
        for (t, &id) in ids.iter().enumerate() {
            let id = id as usize;
            assert_eq!(out[t * d..(t + 1) * d], vals[id * d..(id + 1) * d]);
        }
    }

    #[test]
    fn a_token_id_outside_the_vocabulary_is_a_data_error_naming_the_id_and_v() {
        let (_, table) = bf16_table(11, 4);
        for bad in [11, -1, i32::MAX] {
            let e = run(&Embedding, &[&table, &Owned::i32([2], &[1, bad])]).unwrap_err();
            let msg = e.to_string();
            assert!(
                matches!(
                    e,
                    OpError::Data {
                        op: "embedding",
                        ..
                    }
                ),
                "{e}"
            );
            assert!(
                msg.contains(&bad.to_string()) && msg.contains("11"),
                "{msg}"
            );
        }
    }

    #[test]
    fn embedding_refuses_float_token_ids_and_a_table_of_partial_blocks() {
        let e = infer(
            &Embedding,
            &[TensorMeta::new([8, 4], DType::BF16), TensorMeta::f32([2])],
        )
        .unwrap_err();
        assert!(matches!(e, OpError::Shape { .. }), "{e}");
        let e = infer(
            &Embedding,
            &[TensorMeta::new([8, 40], DType::Q8_0), TensorMeta::i32([2])],
        )
        .unwrap_err();
        assert!(matches!(e, OpError::Shape { .. }), "{e}");
        let e = infer(
            &Embedding,
            &[
                TensorMeta::new([8, 4], DType::BF16),
                TensorMeta::i32([2, 1]),
            ],
        )
        .unwrap_err();
        assert!(matches!(e, OpError::Shape { .. }), "{e}");
    }
}
