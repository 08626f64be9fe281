//! The head's plumbing: greedy and sampled token choice and the row slice that keeps only
//! the rows needing logits (spec §3.8). The ops and their shape rules are here, the CPU
//! references in `cpu.rs`, the CUDA launches in `cuda.rs` (kernels in `head.cu`).

pub mod cases;
mod cpu;
mod cuda;
#[cfg(test)]
mod tests;

use crate::check::{arity, want_dtype};
use crate::gpu::{DeviceTensor, GpuCtx, Scratch};
use crate::tensor::{DType, HostTensor, HostTensorMut, TensorMeta};
use crate::{Op, OpError};

pub use cpu::{RowSampling, SAMPLE_FIELDS, argmax_row, penalize, sample_row};
pub(crate) use cuda::HEAD_CU;

/// F32 `[n, V]` → I32 `[n]`: per row the index of the first maximum. A row
/// holding a NaN is `OpError::Data` (a broken forward pass, not a choice).
#[derive(Debug, Clone, PartialEq)]
pub struct Argmax;

impl Op for Argmax {
    fn name(&self) -> &'static str {
        "argmax"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        arity(op, inputs, 1)?;
        let x = inputs[0];
        want_dtype(op, "logits", x, DType::F32)?;
        if x.shape.len() != 2 || x.shape[1] == 0 {
            return Err(OpError::shape(
                op,
                format!("logits must be [n, V] with V > 0, found {x}"),
            ));
        }
        if i32::try_from(x.shape[1]).is_err() {
            return Err(OpError::shape(
                op,
                format!("V = {} does not fit an I32 index", x.shape[1]),
            ));
        }
        Ok(vec![TensorMeta::i32([x.shape[0]])])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        "argmax".to_string()
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

/// F32 `[n, V]` logits and F32 `[n, SAMPLE_FIELDS]` parameters (a [`RowSampling`] a row)
/// → I32 `[n]`: per row the token [`sample_row`] chooses, the argmax where the temperature is
/// not positive. A greedy row holding NaN, or a sampled row without one finite candidate, is
/// `OpError::Data` on the CPU and -1 (never a token) on the GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleRows;

impl Op for SampleRows {
    fn name(&self) -> &'static str {
        "sample_rows"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        arity(op, inputs, 2)?;
        let out = Argmax.infer(&inputs[..1]).map_err(|e| match e {
            OpError::Shape { msg, .. } => OpError::shape(op, msg),
            e => e,
        })?;
        let (x, p) = (inputs[0], inputs[1]);
        want_dtype(op, "params", p, DType::F32)?;
        if p.shape != [x.shape[0], SAMPLE_FIELDS] {
            return Err(OpError::shape(
                op,
                format!(
                    "params must be [{}, {SAMPLE_FIELDS}] (1 / temperature, top_k, top_p, min_p, u \
                     for each logits row), found {p}",
                    x.shape[0]
                ),
            ));
        }
        Ok(out)
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        "sample_rows".to_string()
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

/// F32 `[n, V]` logits, I32 `[n, W]` token ids and F32 `[n]` penalties → F32 `[n, V]`: the
/// logits with each listed id's value of row r divided by `penalty[r]` where positive and
/// multiplied by it where not (the repetition penalty of llama.cpp and Hugging Face, over
/// the ids a sequence has seen). Ids outside `0..V` (the -1 padding) are skipped; an id
/// listed twice is penalised once (each write reads the input).
#[derive(Debug, Clone, PartialEq)]
pub struct PenalizeRows;

impl Op for PenalizeRows {
    fn name(&self) -> &'static str {
        "penalize_rows"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        arity(op, inputs, 3)?;
        let (x, ids, pen) = (inputs[0], inputs[1], inputs[2]);
        want_dtype(op, "logits", x, DType::F32)?;
        want_dtype(op, "ids", ids, DType::I32)?;
        want_dtype(op, "penalty", pen, DType::F32)?;
        if x.shape.len() != 2 || x.shape[1] == 0 || i32::try_from(x.shape[1]).is_err() {
            return Err(OpError::shape(
                op,
                format!("logits must be [n, V] with 0 < V < 2^31, found {x}"),
            ));
        }
        let n = x.shape[0];
        if ids.shape.len() != 2 || ids.shape[0] != n || pen.shape != [n] {
            return Err(OpError::shape(
                op,
                format!("ids must be [{n}, W] and penalty [{n}], found {ids} and {pen}"),
            ));
        }
        Ok(vec![x.clone()])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        "penalize_rows".to_string()
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

/// F32 `[n, ..]` → F32 `[len, ..]`: rows `start..start+len` (copied).
#[derive(Debug, Clone, PartialEq)]
pub struct SliceRows {
    pub start: usize,
    pub len: usize,
}

impl Op for SliceRows {
    fn name(&self) -> &'static str {
        "slice_rows"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        arity(op, inputs, 1)?;
        let x = inputs[0];
        want_dtype(op, "x", x, DType::F32)?;
        let Some(&n) = x.shape.first() else {
            return Err(OpError::shape(op, "x must have a row dimension"));
        };
        if self.len == 0 || self.start.checked_add(self.len).is_none_or(|end| end > n) {
            return Err(OpError::shape(
                op,
                format!(
                    "rows {}..{}+{} are not a non-empty range inside the {n} rows of {x}",
                    self.start, self.start, self.len
                ),
            ));
        }
        let mut shape = x.shape.clone();
        shape[0] = self.len;
        Ok(vec![TensorMeta::f32(shape)])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        format!("slice_rows(start={}, len={})", self.start, self.len)
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
