//! The op DAG that model files declare, plans bound to a step shape (topological
//! schedule + arena layout), and executors that run them.

mod builder;
mod cuda_exec;
mod exec;
mod lower;
mod plan;

pub use builder::{Graph, GraphBuilder, Node, ValueId, ValueInfo, ValueKind, WeightSource};
pub use cuda_exec::{
    CudaExecError, CudaExecutor, NodeTime, StepTiming, lowered_launches, touched_experts,
    weight_layout,
};
pub use exec::{AlignedBuf, CpuExecutor, HostState, HostWeights};
pub use lower::{LoweringOptions, Target, lower};
pub use plan::{Bucket, DEFAULT_BLOCK_SIZE, KvPool, LogitRows, Plan, SLOT_ALIGN, Slot, StepShape};

use ops::OpError;

#[derive(Debug, thiserror::Error)]
pub enum GraphError {
    #[error("the checkpoint has no tensor `{0}`")]
    MissingWeight(String),
    #[error("{node}: {describe} over ({}): {source}", inputs.join(", "))]
    Op {
        node: String,
        describe: String,
        inputs: Vec<String>,
        source: OpError,
    },
    #[error("{node}: expected {expected} outputs, the op has {found}")]
    Arity {
        node: String,
        expected: usize,
        found: usize,
    },
    #[error("the graph has a cycle through `{0}`")]
    Cycle(String),
    #[error("value `{0}` has no byte size (its inner dimension is not whole blocks)")]
    Unsized(String),
    #[error("step input `{0}` was not provided")]
    MissingInput(String),
    #[error("step input `{name}`: expected {expected} bytes, found {found}")]
    InputSize {
        name: String,
        expected: usize,
        found: usize,
    },
    #[error("state buffer `{0}` does not exist")]
    MissingState(String),
    #[error("the plan has no output `{0}`")]
    MissingOutput(String),
    #[error("lowering options: {0}")]
    Lowering(String),
}

/// An architecture's declaration: everything a model file provides.
pub trait ModelDecl: Send + Sync {
    /// Short name for logs (`xing4_0`).
    fn arch(&self) -> &str;
    /// Declares one step of `shape`: inputs `tokens`, `positions` and `kv_slots` (I32 `[n]`),
    /// `block_table` (I32 `[seqs, table_width]`) and `row_seq` (I32 `[n]`), per-layer states
    /// (the cache pool), and the output `logits` (F32 `[logit rows, vocab]`).
    fn declare(&self, b: &mut GraphBuilder<'_>, shape: &StepShape) -> Result<(), GraphError>;
    /// Vocabulary size (columns of `logits`).
    fn n_vocab(&self) -> usize;
    /// Bytes of persistent state per token position (all layers), for memory checks.
    fn state_bytes_per_position(&self) -> usize;
}
