//! The eager CPU executor: walks a plan's schedule, handing each op views into
//! the arena, the checkpoint's memory map and the engine's persistent state.

use std::collections::HashMap;

pub use ops::AlignedBuf;
use ops::{HostTensor, HostTensorMut, TensorMeta};

use crate::GraphError;
use crate::builder::{ValueId, ValueKind};
use crate::plan::Plan;

/// Read-only checkpoint bytes by tensor name (the GGUF memory map).
pub trait HostWeights {
    fn weight_bytes(&self, name: &str) -> Option<&[u8]>;
}

impl HostWeights for HashMap<String, Vec<u8>> {
    fn weight_bytes(&self, name: &str) -> Option<&[u8]> {
        self.get(name).map(|v| v.as_slice())
    }
}

/// Persistent state buffers by name (the KV cache of each layer), each holding
/// `rows` rows; a plan sees its bucket's first rows.
#[derive(Debug, Default)]
pub struct HostState {
    buffers: HashMap<String, AlignedBuf>,
    rows: usize,
}

impl HostState {
    /// Buffers for every state a plan declares, each with room for `rows` rows.
    pub fn for_plan(plan: &Plan, rows: usize) -> Result<HostState, GraphError> {
        let mut buffers = HashMap::new();
        for (_, v) in plan.graph.of_kind(ValueKind::State) {
            if v.alias_of.is_some() {
                continue;
            }
            let row = row_bytes(&v.meta).ok_or_else(|| GraphError::Unsized(v.name.clone()))?;
            buffers.insert(v.name.clone(), AlignedBuf::zeroed(row * rows));
        }
        Ok(HostState { buffers, rows })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn get(&self, name: &str) -> Option<&AlignedBuf> {
        self.buffers.get(name)
    }

    pub fn get_mut(&mut self, name: &str) -> Option<&mut AlignedBuf> {
        self.buffers.get_mut(name)
    }

    pub fn total_bytes(&self) -> usize {
        self.buffers.values().map(|b| b.len()).sum()
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.buffers.keys().map(|k| k.as_str())
    }
}

fn row_bytes(meta: &TensorMeta) -> Option<usize> {
    let rows = *meta.shape.first()?;
    meta.bytes().map(|b| b / rows.max(1))
}

/// Runs plans on the CPU. Owns the arena; the engine owns weights and state.
#[derive(Debug, Default)]
pub struct CpuExecutor {
    arena: AlignedBuf,
}

impl CpuExecutor {
    pub fn new() -> Self {
        Self::default()
    }

    /// Executes one step of `plan`. `inputs` gives the bytes of every Input value by name.
    pub fn run(
        &mut self,
        plan: &Plan,
        weights: &dyn HostWeights,
        state: &mut HostState,
        inputs: &[(&str, &[u8])],
    ) -> Result<(), GraphError> {
        if self.arena.len() < plan.arena_bytes {
            self.arena = AlignedBuf::zeroed(plan.arena_bytes);
        }
        let g = &plan.graph;
        for (id, v) in g.of_kind(ValueKind::Input) {
            let (_, data) = inputs
                .iter()
                .find(|(n, _)| *n == v.name)
                .ok_or_else(|| GraphError::MissingInput(v.name.clone()))?;
            let need = v.meta.bytes().unwrap_or(0);
            if data.len() != need {
                return Err(GraphError::InputSize {
                    name: v.name.clone(),
                    expected: need,
                    found: data.len(),
                });
            }
            let slot = plan
                .slot(id)
                .ok_or_else(|| GraphError::Unsized(v.name.clone()))?;
            self.arena.bytes_mut()[slot.offset..slot.offset + need].copy_from_slice(data);
        }

        // Raw views: the plan guarantees that values live at the same step never
        // share arena bytes, and an op never reads an input it aliases.
        let arena_ptr = self.arena.bytes_mut().as_mut_ptr();
        let mut state_ptrs: HashMap<&str, (*mut u8, usize)> = HashMap::new();
        for (_, v) in g.of_kind(ValueKind::State) {
            if v.alias_of.is_some() {
                continue;
            }
            let buf = state
                .buffers
                .get_mut(&v.name)
                .ok_or_else(|| GraphError::MissingState(v.name.clone()))?;
            let need = v.meta.bytes().unwrap_or(usize::MAX);
            if buf.len() < need {
                return Err(GraphError::InputSize {
                    name: v.name.clone(),
                    expected: need,
                    found: buf.len(),
                });
            }
            state_ptrs.insert(v.name.as_str(), (buf.bytes_mut().as_mut_ptr(), need));
        }
        let locate = |id: ValueId| -> Result<(*mut u8, usize), GraphError> {
            let st = plan.storage_of(id);
            let v = g.value(st);
            match v.kind {
                ValueKind::Weight => {
                    let b = weights
                        .weight_bytes(&v.name)
                        .ok_or_else(|| GraphError::MissingWeight(v.name.clone()))?;
                    Ok((b.as_ptr() as *mut u8, b.len()))
                }
                ValueKind::State => state_ptrs
                    .get(v.name.as_str())
                    .copied()
                    .ok_or_else(|| GraphError::MissingState(v.name.clone())),
                ValueKind::Input | ValueKind::Intermediate => {
                    let s = plan
                        .slot(st)
                        .ok_or_else(|| GraphError::Unsized(v.name.clone()))?;
                    // SAFETY: slots lie inside the arena (arena_bytes covers every slot).
                    Ok((
                        unsafe { arena_ptr.add(s.offset) },
                        v.meta.bytes().unwrap_or(0),
                    ))
                }
            }
        };

        for &n in &plan.schedule {
            let node = &g.nodes[n];
            let aliased: Vec<usize> = node.op.aliases().iter().map(|&(_, i)| i).collect();
            let mut ins = Vec::with_capacity(node.inputs.len());
            for (k, &i) in node.inputs.iter().enumerate() {
                let meta = &g.value(i).meta;
                if aliased.contains(&k) {
                    ins.push(HostTensor::new(meta, &[]));
                    continue;
                }
                let (p, len) = locate(i)?;
                // SAFETY: see above; weights outlive the call, arena/state are not resized during it.
                ins.push(HostTensor::new(meta, unsafe {
                    std::slice::from_raw_parts(p, len)
                }));
            }
            let mut outs = Vec::with_capacity(node.outputs.len());
            for &o in &node.outputs {
                let meta = &g.value(o).meta;
                let (p, len) = locate(o)?;
                // SAFETY: outputs do not overlap live inputs (plan invariant) nor each other.
                outs.push(HostTensorMut::new(meta, unsafe {
                    std::slice::from_raw_parts_mut(p, len)
                }));
            }
            node.op
                .cpu(&ins, &mut outs)
                .map_err(|source| GraphError::Op {
                    node: node.name.clone(),
                    describe: node.op.describe(),
                    inputs: node
                        .inputs
                        .iter()
                        .map(|&i| g.value(i).meta.to_string())
                        .collect(),
                    source,
                })?;
        }
        Ok(())
    }

    /// The f32 contents of a named output after `run`.
    pub fn output_f32(&self, plan: &Plan, name: &str) -> Result<&[f32], GraphError> {
        let id = plan
            .graph
            .output(name)
            .ok_or_else(|| GraphError::MissingOutput(name.to_string()))?;
        let st = plan.storage_of(id);
        let slot = plan
            .slot(st)
            .ok_or_else(|| GraphError::Unsized(name.to_string()))?;
        let n = plan.graph.value(id).meta.numel();
        Ok(&self.arena.f32s()[slot.offset / 4..slot.offset / 4 + n])
    }
}
