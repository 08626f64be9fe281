//! Token embedding lookup (spec §3.1): one table row per token, widened to f32. The op and
//! its shape rule are here, the CPU reference in `cpu.rs`, the CUDA launch in `cuda.rs`
//! (`embedding.cu`, compiled after `dequant/dequant.cuh`).

pub mod cases;
mod cpu;
mod cuda;
#[cfg(test)]
mod tests;

use crate::check::{arity, want_dtype};
use crate::gpu::{DeviceTensor, GpuCtx, Scratch};
use crate::tensor::{DType, HostTensor, HostTensorMut, TensorMeta};
use crate::{Op, OpError};

pub use cpu::embed_rows;
pub(crate) use cuda::EMBEDDING_CU;

const OP: &str = "embedding";

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
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        OP.to_string()
    }

    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        self.cuda_launch(ctx, inputs, outputs, scratch)
    }
}
