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
pub trait Op: fmt::Debug + Send + Sync {
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
}
