//! The operator trait every backend executes.

use std::fmt;

use crate::gpu::{DeviceTensor, GpuCtx, Scratch};
use crate::tensor::{HostTensor, HostTensorMut, TensorMeta};

/// Why an operator refused its inputs or could not run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OpError {
    /// Input shapes or types that the operator's shape rule rejects.
    #[error("{op}: {msg}")]
    Shape { op: &'static str, msg: String },
    /// A host view of the wrong type, size or alignment.
    #[error("tensor type: {0}")]
    Type(String),
    /// Data that a shape rule cannot see: a token id past the vocabulary, a position past the cache.
    #[error("{op}: {msg}")]
    Data { op: &'static str, msg: String },
    /// The device layer failed (driver, compile, launch).
    #[error("device: {0}")]
    Device(String),
    /// The backend has no implementation of this operator.
    #[error("{op} has no {backend} implementation")]
    Unsupported {
        op: &'static str,
        backend: &'static str,
    },
}

impl OpError {
    pub fn shape(op: &'static str, msg: impl Into<String>) -> Self {
        OpError::Shape {
            op,
            msg: msg.into(),
        }
    }

    pub fn data(op: &'static str, msg: impl Into<String>) -> Self {
        OpError::Data {
            op,
            msg: msg.into(),
        }
    }
}

/// One typed operator. Its parameters are the implementing struct's fields, so a
/// graph of ops describes itself.
///
/// Contract shared by every backend:
/// * `infer` is the whole shape/type rule: given input metadata it returns the
///   output metadata or an `OpError::Shape` naming what is wrong. The graph calls it
///   once when a plan is built; the kernels may rely on it.
/// * an implementation writes every element of every output (outputs are not zeroed
///   in advance; the GPU parity harness poisons them);
/// * an implementation never allocates output storage and never reads back to the
///   host inside a step (the CUDA variant is enqueued on a stream and captured);
/// * `aliases` lists outputs that are the same storage as an input (an in-place
///   update of persistent state such as the KV cache); the executor gives them one buffer.
pub trait Op: fmt::Debug + Send + Sync + std::any::Any {
    /// Short stable name, e.g. `hc_pre`.
    fn name(&self) -> &'static str;

    /// Output metadata for these inputs, or why they are refused.
    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError>;

    /// The CPU reference: f32 math, weights dequantized per block on the fly.
    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError>;

    /// One stable line for snapshots: the name and every parameter.
    fn describe(&self) -> String;

    /// The CUDA kernel(s): enqueued on `ctx.device`'s stream with no host
    /// synchronization and no allocation (a captured graph replays exactly these
    /// launches). `scratch` has `cuda_scratch_bytes` bytes. Inputs and outputs follow
    /// the same rules as `cpu` (an aliased input's view is the output's storage; read
    /// it only through the output).
    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        let _ = (ctx, inputs, outputs, scratch);
        Err(OpError::Unsupported {
            op: self.name(),
            backend: "cuda",
        })
    }

    /// Device scratch the CUDA implementation needs for these inputs (split-K
    /// partials, route tables), planned by the graph like any other value.
    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        let _ = inputs;
        0
    }

    /// `(output, input)` pairs that share storage. Empty for most ops.
    fn aliases(&self) -> &'static [(usize, usize)] {
        &[]
    }

    /// For a product over stacked expert weights, which inputs are those stacks and which is
    /// the route table (`offsets`, i32 `[n_expert + 1]`) that says the experts a step touches:
    /// a profile counts the touched experts' bytes, not the whole stacks. None for most ops.
    fn routed_weights(&self) -> Option<RoutedWeights> {
        None
    }

    /// For an attention over cache rows, which inputs are the cache state, the tokens'
    /// positions and their sequences: a profile counts the rows the step reads (each
    /// sequence's positions up to its furthest token's, once). None for most ops.
    fn cache_reads(&self) -> Option<CacheReads> {
        None
    }
}

/// Inputs of an attention over cache rows ([`Op::cache_reads`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheReads {
    /// The cache state, `[rows, width]`.
    pub cache: usize,
    /// i32 `[n]`: each token's position.
    pub positions: usize,
    /// i32 `[n]`: each token's sequence.
    pub row_seq: usize,
}

impl CacheReads {
    /// Bytes of the cache rows tokens at `positions` of sequences `row_seq` attend, each
    /// sequence's rows once (its furthest token reads them all), at `row_bytes` a row.
    /// Negative positions (padding rows) read nothing.
    pub fn bytes(positions: &[i32], row_seq: &[i32], row_bytes: usize) -> u64 {
        let mut furthest: Vec<(i32, i32)> = Vec::new();
        for (&p, &s) in positions.iter().zip(row_seq) {
            if p < 0 {
                continue;
            }
            match furthest.iter_mut().find(|f| f.0 == s) {
                Some(f) => f.1 = f.1.max(p),
                None => furthest.push((s, p)),
            }
        }
        furthest
            .iter()
            .map(|&(_, p)| (p as u64 + 1) * row_bytes as u64)
            .sum()
    }
}

/// Inputs of a routed expert product ([`Op::routed_weights`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoutedWeights {
    /// The route table: offsets[e]..offsets[e+1] are expert e's routes.
    pub offsets: usize,
    /// The stacked expert weights, `[n_expert, ...]`.
    pub weights: &'static [usize],
}

/// Runs `op`'s shape rule on the inputs' metadata and checks that the outputs carry
/// exactly the metadata it yields. Kernels and CPU references index by the inferred
/// dimensions, so this is what keeps a directly-called op inside its buffers.
fn infer_matching(
    op: &dyn Op,
    inputs: &[&TensorMeta],
    outputs: &[&TensorMeta],
) -> Result<Vec<TensorMeta>, OpError> {
    let want = op.infer(inputs)?;
    if outputs.len() != want.len() {
        return Err(OpError::shape(
            op.name(),
            format!("has {} outputs, {} were given", want.len(), outputs.len()),
        ));
    }
    for (i, (o, w)) in outputs.iter().zip(&want).enumerate() {
        if *o != w {
            return Err(OpError::shape(
                op.name(),
                format!("output {i} must be {w}, found {o}"),
            ));
        }
    }
    Ok(want)
}

/// [`infer_matching`] over host views.
pub(crate) fn check_host(
    op: &dyn Op,
    inputs: &[HostTensor<'_>],
    outputs: &[HostTensorMut<'_>],
) -> Result<Vec<TensorMeta>, OpError> {
    let ins: Vec<&TensorMeta> = inputs.iter().map(|t| t.meta).collect();
    let outs: Vec<&TensorMeta> = outputs.iter().map(|t| t.meta).collect();
    infer_matching(op, &ins, &outs)
}

/// [`infer_matching`] over device views, plus enough bytes behind every view.
pub(crate) fn check_device(
    op: &dyn Op,
    inputs: &[DeviceTensor<'_>],
    outputs: &[DeviceTensor<'_>],
) -> Result<Vec<TensorMeta>, OpError> {
    let ins: Vec<&TensorMeta> = inputs.iter().map(|t| t.meta).collect();
    let outs: Vec<&TensorMeta> = outputs.iter().map(|t| t.meta).collect();
    let want = infer_matching(op, &ins, &outs)?;
    for t in inputs.iter().chain(outputs) {
        let need = t
            .meta
            .bytes()
            .ok_or_else(|| OpError::Type(format!("{} is not whole blocks", t.meta)))?;
        if t.bytes < need {
            return Err(OpError::Type(format!(
                "{}: device view of {} needs {need} bytes, has {}",
                op.name(),
                t.meta,
                t.bytes
            )));
        }
    }
    Ok(want)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::elementwise::Add;

    fn view(meta: &TensorMeta, bytes: usize) -> DeviceTensor<'_> {
        DeviceTensor {
            meta,
            ptr: 0x1000,
            bytes,
        }
    }

    #[test]
    fn a_device_view_too_small_or_of_the_wrong_shape_is_refused_before_any_launch() {
        let x = TensorMeta::f32([2, 8]);
        let wrong = TensorMeta::f32([2, 7]);
        let full = x.bytes().unwrap();
        let ok = check_device(&Add, &[view(&x, full), view(&x, full)], &[view(&x, full)]);
        assert_eq!(ok.unwrap(), vec![x.clone()]);
        let short = check_device(
            &Add,
            &[view(&x, full - 4), view(&x, full)],
            &[view(&x, full)],
        );
        assert!(
            short
                .unwrap_err()
                .to_string()
                .contains("needs 64 bytes, has 60")
        );
        let mismatch = check_device(
            &Add,
            &[view(&x, full), view(&x, full)],
            &[view(&wrong, full)],
        );
        assert!(
            mismatch
                .unwrap_err()
                .to_string()
                .contains("output 0 must be F32[2,8]")
        );
    }
}
