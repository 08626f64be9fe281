//! The graph a model file declares: values (per-step inputs, weights, persistent
//! state, intermediates) and the operators that connect them.

use std::collections::HashMap;
use std::sync::Arc;

use ops::{Op, OpError, TensorMeta};

use crate::GraphError;

/// Index of a value in its graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub usize);

/// Where a value's storage comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ValueKind {
    /// Fed by the engine every step (token ids, positions).
    Input,
    /// A checkpoint tensor, bound by name; read-only.
    Weight,
    /// Persistent storage owned by the engine across steps (a layer's KV cache).
    /// `rows` is the physical row count; the plan sees only the bucket's rows.
    State,
    /// Produced by an op inside the step; lives in the arena.
    Intermediate,
}

#[derive(Clone, Debug)]
pub struct ValueInfo {
    /// Fully scoped name: `blk.3.attn.q_a` for an intermediate, the GGUF name for a weight.
    pub name: String,
    pub meta: TensorMeta,
    pub kind: ValueKind,
    /// For an op output that is the storage of one of the op's inputs.
    pub alias_of: Option<ValueId>,
}

#[derive(Clone, Debug)]
pub struct Node {
    pub name: String,
    pub op: Arc<dyn Op>,
    pub inputs: Vec<ValueId>,
    pub outputs: Vec<ValueId>,
}

/// Metadata of the checkpoint tensors a declaration may bind.
pub trait WeightSource {
    fn weight_meta(&self, name: &str) -> Option<TensorMeta>;
}

impl WeightSource for HashMap<String, TensorMeta> {
    fn weight_meta(&self, name: &str) -> Option<TensorMeta> {
        self.get(name).cloned()
    }
}

/// A declared graph with every shape inferred.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    pub values: Vec<ValueInfo>,
    pub nodes: Vec<Node>,
    /// Named results the engine reads after a step (`logits`).
    pub outputs: Vec<(String, ValueId)>,
}

impl Graph {
    pub fn value(&self, id: ValueId) -> &ValueInfo {
        &self.values[id.0]
    }

    /// Bytes a node's kernels must move at the least: each weight it reads (a stacked expert
    /// tensor whole, so an upper bound until a step touches every expert) and each step input
    /// and intermediate it reads or writes, every value once. State (the KV cache) is left out,
    /// read or written in place: how much of it a step touches depends on the positions.
    pub fn node_bytes(&self, node: &Node) -> u64 {
        let mut seen: Vec<ValueId> = Vec::new();
        let mut total = 0u64;
        for &id in node.inputs.iter().chain(&node.outputs) {
            if seen.contains(&id) {
                continue;
            }
            seen.push(id);
            let v = self.value(id);
            let state = |v: &ValueInfo| v.kind == ValueKind::State;
            if state(v) || v.alias_of.is_some_and(|a| state(self.value(a))) {
                continue;
            }
            total += v.meta.bytes().unwrap_or(0) as u64;
        }
        total
    }

    /// [`Self::node_bytes`] with a routed expert product's stacked weights
    /// ([`ops::Op::routed_weights`]) counted for the `touched` experts of `experts` its step
    /// routed to, not whole: the bytes that step needed.
    pub fn node_bytes_touched(&self, node: &Node, touched: usize, experts: usize) -> u64 {
        let total = self.node_bytes(node);
        let Some(rw) = node.op.routed_weights() else {
            return total;
        };
        let mut seen: Vec<ValueId> = Vec::new();
        let mut untouched = 0u64;
        for &i in rw.weights {
            let Some(&id) = node.inputs.get(i) else {
                continue;
            };
            if seen.contains(&id) {
                continue;
            }
            seen.push(id);
            let whole = self.value(id).meta.bytes().unwrap_or(0) as u128;
            let idle = experts.saturating_sub(touched.min(experts)) as u128;
            untouched += (whole * idle / experts.max(1) as u128) as u64;
        }
        total - untouched.min(total)
    }

    /// The cache rows an attention node reads in a step ([`ops::Op::cache_reads`]), from the
    /// step's `inputs` (name, bytes) holding its positions and row map; 0 for other nodes, or
    /// where those are not step inputs.
    pub fn node_cache_bytes(&self, node: &Node, inputs: &[(&str, &[u8])]) -> u64 {
        let Some(cr) = node.op.cache_reads() else {
            return 0;
        };
        let step_input = |i: usize| -> Option<Vec<i32>> {
            let v = self.value(*node.inputs.get(i)?);
            if v.kind != ValueKind::Input {
                return None;
            }
            let (_, data) = inputs.iter().find(|(n, _)| *n == v.name)?;
            Some(
                data.chunks_exact(4)
                    .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            )
        };
        let (Some(positions), Some(row_seq)) = (step_input(cr.positions), step_input(cr.row_seq))
        else {
            return 0;
        };
        let Some(cache) = node.inputs.get(cr.cache).map(|&c| &self.value(c).meta) else {
            return 0;
        };
        let rows = cache.shape.first().copied().unwrap_or(0).max(1);
        let row_bytes = cache.bytes().unwrap_or(0) / rows;
        ops::CacheReads::bytes(&positions, &row_seq, row_bytes)
    }

    pub fn find(&self, name: &str) -> Option<ValueId> {
        self.values.iter().position(|v| v.name == name).map(ValueId)
    }

    pub fn output(&self, name: &str) -> Option<ValueId> {
        self.outputs
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| *v)
    }

    /// Values of one kind, in declaration order.
    pub fn of_kind(&self, kind: ValueKind) -> impl Iterator<Item = (ValueId, &ValueInfo)> {
        self.values
            .iter()
            .enumerate()
            .filter(move |(_, v)| v.kind == kind)
            .map(|(i, v)| (ValueId(i), v))
    }
}

/// The API model files declare an architecture with. Names are scoped
/// (`blk.3` + `attn.q_a` → `blk.3.attn.q_a`); every op's output shapes are inferred
/// when it is added, so a declaration error names the op where it happened.
pub struct GraphBuilder<'w> {
    graph: Graph,
    weights: &'w dyn WeightSource,
    scopes: Vec<String>,
    bound: HashMap<String, ValueId>,
}

impl<'w> GraphBuilder<'w> {
    pub fn new(weights: &'w dyn WeightSource) -> Self {
        GraphBuilder {
            graph: Graph::default(),
            weights,
            scopes: Vec::new(),
            bound: HashMap::new(),
        }
    }

    fn scoped(&self, name: &str) -> String {
        if self.scopes.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.scopes.join("."))
        }
    }

    fn push_value(&mut self, info: ValueInfo) -> ValueId {
        let id = ValueId(self.graph.values.len());
        self.graph.values.push(info);
        id
    }

    /// Runs `f` with `name` appended to the scope.
    pub fn scope<T>(&mut self, name: &str, f: impl FnOnce(&mut Self) -> T) -> T {
        self.scopes.push(name.to_string());
        let out = f(self);
        self.scopes.pop();
        out
    }

    /// A per-step input (not scoped).
    pub fn input(&mut self, name: &str, meta: TensorMeta) -> ValueId {
        self.push_value(ValueInfo {
            name: name.to_string(),
            meta,
            kind: ValueKind::Input,
            alias_of: None,
        })
    }

    /// Persistent state (not scoped): its plan shape is `meta`.
    pub fn state(&mut self, name: &str, meta: TensorMeta) -> ValueId {
        self.push_value(ValueInfo {
            name: name.to_string(),
            meta,
            kind: ValueKind::State,
            alias_of: None,
        })
    }

    /// Binds the checkpoint tensor `name` (a GGUF name, not scoped). Binding the same
    /// tensor twice returns the same value.
    pub fn weight(&mut self, name: &str) -> Result<ValueId, GraphError> {
        if let Some(&id) = self.bound.get(name) {
            return Ok(id);
        }
        let meta = self
            .weights
            .weight_meta(name)
            .ok_or_else(|| GraphError::MissingWeight(name.to_string()))?;
        let id = self.push_value(ValueInfo {
            name: name.to_string(),
            meta,
            kind: ValueKind::Weight,
            alias_of: None,
        });
        self.bound.insert(name.to_string(), id);
        Ok(id)
    }

    /// True when the checkpoint has `name` (for optional tensors).
    pub fn has_weight(&self, name: &str) -> bool {
        self.weights.weight_meta(name).is_some()
    }

    pub fn meta(&self, v: ValueId) -> &TensorMeta {
        &self.graph.values[v.0].meta
    }

    /// Adds `op` over `inputs`; its outputs are named `name` (scoped), suffixed
    /// `.0`, `.1`… when there are several.
    pub fn op(
        &mut self,
        name: &str,
        op: impl Op + 'static,
        inputs: &[ValueId],
    ) -> Result<Vec<ValueId>, GraphError> {
        let full = self.scoped(name);
        let metas: Vec<&TensorMeta> = inputs
            .iter()
            .map(|v| &self.graph.values[v.0].meta)
            .collect();
        let out_metas = op.infer(&metas).map_err(|source| GraphError::Op {
            node: full.clone(),
            describe: op.describe(),
            inputs: metas.iter().map(|m| m.to_string()).collect(),
            source,
        })?;
        let aliases = op.aliases();
        let n_out = out_metas.len();
        let mut outputs = Vec::with_capacity(n_out);
        for (k, meta) in out_metas.into_iter().enumerate() {
            let alias_of = aliases
                .iter()
                .find(|(o, _)| *o == k)
                .map(|(_, i)| inputs[*i]);
            if let Some(src) = alias_of {
                let src_meta = &self.graph.values[src.0].meta;
                if *src_meta != meta {
                    return Err(GraphError::Op {
                        node: full.clone(),
                        describe: op.describe(),
                        inputs: vec![src_meta.to_string()],
                        source: OpError::shape(op.name(), format!("aliased output {k} is {meta}")),
                    });
                }
            }
            let vname = if n_out == 1 {
                full.clone()
            } else {
                format!("{full}.{k}")
            };
            let kind = match alias_of {
                Some(src) => self.graph.values[src.0].kind.clone(),
                None => ValueKind::Intermediate,
            };
            outputs.push(self.push_value(ValueInfo {
                name: vname,
                meta,
                kind,
                alias_of,
            }));
        }
        self.graph.nodes.push(Node {
            name: full,
            op: Arc::new(op),
            inputs: inputs.to_vec(),
            outputs: outputs.clone(),
        });
        Ok(outputs)
    }

    /// `op` for an operator with exactly one output.
    pub fn op1(
        &mut self,
        name: &str,
        op: impl Op + 'static,
        inputs: &[ValueId],
    ) -> Result<ValueId, GraphError> {
        let outs = self.op(name, op, inputs)?;
        match outs.as_slice() {
            [one] => Ok(*one),
            _ => Err(GraphError::Arity {
                node: self.scoped(name),
                expected: 1,
                found: outs.len(),
            }),
        }
    }

    /// `op` for an operator with exactly `N` outputs.
    pub fn opn<const N: usize>(
        &mut self,
        name: &str,
        op: impl Op + 'static,
        inputs: &[ValueId],
    ) -> Result<[ValueId; N], GraphError> {
        let outs = self.op(name, op, inputs)?;
        let found = outs.len();
        outs.try_into().map_err(|_| GraphError::Arity {
            node: self.scoped(name),
            expected: N,
            found,
        })
    }

    /// Marks `v` as a named result of the step.
    pub fn output(&mut self, name: &str, v: ValueId) {
        self.graph.outputs.push((name.to_string(), v));
    }

    pub fn finish(self) -> Graph {
        self.graph
    }
}
