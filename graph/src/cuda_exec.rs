//! The CUDA executor: weights uploaded once in their stored format, persistent
//! state (KV caches) on the card, one device arena shared by every plan, and each
//! plan either walked eagerly (one `Op::cuda` a node) or captured once into a CUDA
//! graph and replayed. A step copies its tiny inputs (token ids, positions) into
//! their arena slots, enqueues, and reads back only what the caller asks for.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Instant;

use cuda::{CudaError, DeviceArena, EventTrail, Timer};
use ops::TensorMeta;
use ops::gpu::{DeviceTensor, GpuCtx, Scratch};

use crate::GraphError;
use crate::builder::{ValueId, ValueKind};
use crate::exec::HostWeights;
use crate::plan::{Bucket, Plan, SLOT_ALIGN};

#[derive(Debug, thiserror::Error)]
pub enum CudaExecError {
    #[error(transparent)]
    Graph(#[from] GraphError),
    #[error("{what}: {source}")]
    Device {
        what: String,
        #[source]
        source: CudaError,
    },
    #[error(
        "weight `{name}`: the checkpoint holds {found} bytes, its metadata {meta} needs {expected}"
    )]
    WeightSize {
        name: String,
        meta: String,
        expected: usize,
        found: usize,
    },
    #[error(
        "plan {plan} has not run eagerly yet: capture needs one eager run first, so that every kernel is compiled and loaded outside the capture"
    )]
    NotWarm { plan: u64 },
    #[error("plan {plan} was not captured (or its capture was dropped when the arena grew)")]
    NotCaptured { plan: u64 },
    #[error("the device arena is missing (an earlier allocation failed)")]
    NoArena,
    #[error("output `{name}` is {meta}, not {want}")]
    OutputType {
        name: String,
        meta: String,
        want: &'static str,
    },
}

fn dev(what: impl Into<String>) -> impl FnOnce(CudaError) -> CudaExecError {
    let what = what.into();
    move |source| CudaExecError::Device { what, source }
}

fn align(n: usize) -> usize {
    n.div_ceil(SLOT_ALIGN) * SLOT_ALIGN
}

/// Where a value's bytes live on the card, as the executor resolves it.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Loc {
    /// `offset` bytes into the weight buffer.
    Weight { name: String, offset: usize },
    /// The first `bytes` of a state buffer (the bucket's rows).
    State { name: String },
    /// `offset` bytes into the arena.
    Arena { offset: usize },
}

/// Byte offsets of the plan's weights in one buffer, in declaration order.
pub fn weight_layout(plan: &Plan) -> Result<Vec<(String, usize, usize)>, GraphError> {
    let mut out = Vec::new();
    let mut at = 0;
    for (_, v) in plan.graph.of_kind(ValueKind::Weight) {
        if v.alias_of.is_some() {
            continue;
        }
        let bytes = v
            .meta
            .bytes()
            .ok_or_else(|| GraphError::Unsized(v.name.clone()))?;
        out.push((v.name.clone(), at, bytes));
        at += align(bytes);
    }
    Ok(out)
}

/// The storage of value `id` (aliases followed) and the bytes its view spans.
fn locate(
    plan: &Plan,
    weights: &HashMap<String, usize>,
    id: ValueId,
) -> Result<(Loc, usize), GraphError> {
    let st = plan.storage_of(id);
    let v = plan.graph.value(st);
    let bytes = v
        .meta
        .bytes()
        .ok_or_else(|| GraphError::Unsized(v.name.clone()))?;
    let loc = match v.kind {
        ValueKind::Weight => Loc::Weight {
            name: v.name.clone(),
            offset: *weights
                .get(&v.name)
                .ok_or_else(|| GraphError::MissingWeight(v.name.clone()))?,
        },
        ValueKind::State => Loc::State {
            name: v.name.clone(),
        },
        ValueKind::Input | ValueKind::Intermediate => Loc::Arena {
            offset: plan
                .slot(st)
                .ok_or_else(|| GraphError::Unsized(v.name.clone()))?
                .offset,
        },
    };
    Ok((loc, bytes))
}

/// The launch list a plan lowers to, without a GPU: per scheduled node its
/// `describe()`, where each input/output view points (weight buffer offset, state
/// buffer, arena offset; aliased inputs show the output's storage) and its scratch.
/// Weight offsets are the ones `CudaExecutor` uses when it uploads this plan's weights.
pub fn lowered_launches(plan: &Plan) -> Result<String, GraphError> {
    let layout = weight_layout(plan)?;
    let weights: HashMap<String, usize> = layout.iter().map(|(n, o, _)| (n.clone(), *o)).collect();
    let weight_bytes = layout.last().map(|(_, o, b)| o + align(*b)).unwrap_or(0);
    let g = &plan.graph;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "lowered {:?} logits={:?}: {} launches, device arena {} bytes ({} values + scratch), weights {} tensors in {} bytes",
        plan.shape.bucket,
        plan.shape.logits,
        plan.schedule.len(),
        plan.device_arena_bytes,
        plan.arena_bytes,
        layout.len(),
        weight_bytes
    );
    if let Some((target, opts)) = &plan.lowering {
        let _ = writeln!(s, "lowered for {target}: {opts}");
    }
    let show = |id: ValueId, meta: &TensorMeta| -> Result<String, GraphError> {
        let (loc, bytes) = locate(plan, &weights, id)?;
        Ok(match loc {
            Loc::Weight { offset, .. } => format!("{meta} w+{offset}"),
            Loc::State { name } => format!("{meta} state:{name}[..{bytes}]"),
            Loc::Arena { offset } => format!("{meta} a+{offset}"),
        })
    };
    for (_, v) in g.of_kind(ValueKind::Input) {
        if let Some(id) = g.find(&v.name) {
            let _ = writeln!(s, "input {} {}", v.name, show(id, &v.meta)?);
        }
    }
    for (step, &n) in plan.schedule.iter().enumerate() {
        let node = &g.nodes[n];
        let aliased: Vec<(usize, usize)> = node.op.aliases().to_vec();
        let mut ins = Vec::new();
        for (k, &i) in node.inputs.iter().enumerate() {
            let meta = &g.value(i).meta;
            match aliased.iter().find(|&&(_, inp)| inp == k) {
                Some(&(o, _)) => ins.push(format!("{meta} =out{o}")),
                None => ins.push(show(i, meta)?),
            }
        }
        let mut outs = Vec::new();
        for &o in &node.outputs {
            outs.push(show(o, &g.value(o).meta)?);
        }
        let scratch = match plan.scratch.get(n).copied().flatten() {
            Some(sl) => format!(" scratch a+{}..+{}", sl.offset, sl.bytes),
            None => String::new(),
        };
        let _ = writeln!(
            s,
            "{step:4} {} {}: ({}) -> ({}){scratch}",
            node.name,
            node.op.describe(),
            ins.join(", "),
            outs.join(", ")
        );
    }
    for (name, v) in &g.outputs {
        let (loc, bytes) = locate(plan, &weights, *v)?;
        let _ = writeln!(s, "output {name} {:?} {bytes} bytes", loc);
    }
    Ok(s)
}

/// One node's device time in a profiled step.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeTime {
    pub node: String,
    pub op: String,
    pub ms: f64,
    /// What the node must move at the least ([`crate::Graph::node_bytes`]; a routed expert
    /// product's stacks for the experts the step touched, [`crate::Graph::node_bytes_touched`];
    /// an attention's cache rows, [`crate::Graph::node_cache_bytes`]).
    pub bytes: u64,
}

/// Host time spent enqueueing one step, and the stream time between events
/// recorded around it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTiming {
    pub host_submit_s: f64,
    pub device_s: f64,
}

/// A captured step. `cuda::Graph` holds raw driver handles and so is not `Send`;
/// the executor owning it is moved between threads whole (a session's worker).
struct SendGraph(cuda::Graph);

// SAFETY: the graph is used only through `&mut CudaExecutor` (never concurrently), and
// launching it binds its context to the calling thread first, so which thread owns it
// does not matter.
unsafe impl Send for SendGraph {}

/// One state buffer: its offset in the state allocation and its bytes per row.
#[derive(Clone, Copy, Debug)]
struct StateBuf {
    offset: usize,
    row_bytes: usize,
}

/// Runs plans on one GPU. Owns the device copies of the weights, the persistent
/// state and the arena; the plans stay with the caller.
pub struct CudaExecutor {
    ctx: Arc<GpuCtx>,
    /// Weight buffers (one per upload batch) and where each tensor lies.
    weight_bufs: Vec<DeviceArena>,
    weights: HashMap<String, (usize, usize, usize)>,
    state: DeviceArena,
    states: HashMap<String, StateBuf>,
    rows: usize,
    arena: Option<DeviceArena>,
    graphs: HashMap<u64, SendGraph>,
    warm: HashSet<u64>,
    /// Plans whose weights are all on the card (skips the per-step name walk).
    covered: HashSet<u64>,
    timer: Option<Timer>,
    last_timing: Option<StepTiming>,
    /// Whether the device allowed programmatic launches when the executor was made: decode
    /// plans then use them (measured +9% tg128 on the H200); prefill plans do not (their
    /// large multi-wave kernels ran 17% slower with them).
    programmatic: bool,
}

impl std::fmt::Debug for CudaExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaExecutor")
            .field("device", &self.ctx.device.name())
            .field("weights", &self.weights.len())
            .field("rows", &self.rows)
            .field("graphs", &self.graphs.len())
            .finish()
    }
}

impl CudaExecutor {
    /// Uploads the weights `plan` binds (once, in their stored format), and allocates
    /// every state the plan declares with `rows` rows (zeroed) and an arena for the plan.
    pub fn new(
        ctx: Arc<GpuCtx>,
        plan: &Plan,
        weights: &dyn HostWeights,
        rows: usize,
    ) -> Result<CudaExecutor, CudaExecError> {
        let mut exec = Self::without_weights(ctx, plan, rows)?;
        exec.upload_weights(plan, weights)?;
        Ok(exec)
    }

    /// [`Self::new`] without the weights: they go to the card at the first step, or when the
    /// caller uploads them (with a progress report, see [`Self::upload_weights_with`]).
    pub fn without_weights(
        ctx: Arc<GpuCtx>,
        plan: &Plan,
        rows: usize,
    ) -> Result<CudaExecutor, CudaExecError> {
        let mut states = HashMap::new();
        let mut at = 0;
        for (_, v) in plan.graph.of_kind(ValueKind::State) {
            if v.alias_of.is_some() {
                continue;
            }
            let row_bytes =
                row_bytes(&v.meta).ok_or_else(|| GraphError::Unsized(v.name.clone()))?;
            states.insert(
                v.name.clone(),
                StateBuf {
                    offset: at,
                    row_bytes,
                },
            );
            at += align(row_bytes * rows);
        }
        let state = ctx
            .device
            .arena(at.max(SLOT_ALIGN))
            .map_err(dev(format!("allocating {at} bytes of state ({rows} rows)")))?;
        let programmatic = ctx.device.programmatic_launch();
        let mut exec = CudaExecutor {
            programmatic,
            ctx,
            weight_bufs: Vec::new(),
            weights: HashMap::new(),
            state,
            states,
            rows,
            arena: None,
            graphs: HashMap::new(),
            warm: HashSet::new(),
            covered: HashSet::new(),
            timer: None,
            last_timing: None,
        };
        exec.reserve_arena(plan.device_arena_bytes)?;
        Ok(exec)
    }

    pub fn ctx(&self) -> &Arc<GpuCtx> {
        &self.ctx
    }

    /// Uploads the weights of `plan` that are not on the card yet, in one buffer;
    /// returns the bytes uploaded.
    pub fn upload_weights(
        &mut self,
        plan: &Plan,
        weights: &dyn HostWeights,
    ) -> Result<usize, CudaExecError> {
        self.upload_weights_with(plan, weights, &mut |_, _| {})
    }

    /// [`Self::upload_weights`], calling `progress(bytes uploaded, bytes to upload)` after
    /// each tensor (for a progress bar while a checkpoint of many GB goes to the card).
    pub fn upload_weights_with(
        &mut self,
        plan: &Plan,
        weights: &dyn HostWeights,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<usize, CudaExecError> {
        if self.covered.contains(&plan.id) {
            return Ok(0);
        }
        let missing: Vec<(String, usize, usize)> = weight_layout(plan)?
            .into_iter()
            .filter(|(n, _, _)| !self.weights.contains_key(n))
            .collect();
        if missing.is_empty() {
            self.covered.insert(plan.id);
            return Ok(0);
        }
        // Offsets restart at 0 in the new buffer, in the plan's declaration order.
        let mut placed = Vec::with_capacity(missing.len());
        let mut at = 0;
        for (name, _, bytes) in missing {
            placed.push((name, at, bytes));
            at += align(bytes);
        }
        let mut buf = self
            .ctx
            .device
            .arena(at)
            .map_err(dev(format!("allocating {at} bytes of weights")))?;
        let total: u64 = placed.iter().map(|(_, _, b)| *b as u64).sum();
        let mut done = 0u64;
        for (name, offset, bytes) in &placed {
            let data = weights
                .weight_bytes(name)
                .ok_or_else(|| GraphError::MissingWeight(name.clone()))?;
            if data.len() != *bytes {
                let meta = plan
                    .graph
                    .find(name)
                    .map(|id| plan.graph.value(id).meta.to_string())
                    .unwrap_or_default();
                return Err(CudaExecError::WeightSize {
                    name: name.clone(),
                    meta,
                    expected: *bytes,
                    found: data.len(),
                });
            }
            let view = buf
                .view::<u8>(*offset, *bytes)
                .map_err(dev(format!("weight `{name}`")))?;
            buf.upload(view, data)
                .map_err(dev(format!("uploading weight `{name}`")))?;
            done += *bytes as u64;
            progress(done, total);
        }
        let batch = self.weight_bufs.len();
        self.weight_bufs.push(buf);
        for (name, offset, bytes) in placed {
            self.weights.insert(name, (batch, offset, bytes));
        }
        self.covered.insert(plan.id);
        Ok(at)
    }

    /// Makes the arena at least `bytes` long. Growing it moves every slot, so the
    /// graphs captured so far are dropped (they are recaptured on demand).
    pub fn reserve_arena(&mut self, bytes: usize) -> Result<(), CudaExecError> {
        if self.arena.as_ref().is_some_and(|a| a.num_bytes() >= bytes) {
            return Ok(());
        }
        self.graphs.clear();
        self.arena = None;
        let arena = self
            .ctx
            .device
            .arena(bytes.max(SLOT_ALIGN))
            .map_err(dev(format!("allocating a {bytes}-byte arena")))?;
        self.arena = Some(arena);
        Ok(())
    }

    /// Bytes of weights on the card.
    pub fn weight_bytes(&self) -> usize {
        self.weight_bufs.iter().map(|b| b.num_bytes()).sum()
    }

    /// Bytes of persistent state on the card.
    pub fn state_bytes(&self) -> usize {
        self.state.num_bytes()
    }

    pub fn arena_bytes(&self) -> usize {
        self.arena.as_ref().map_or(0, |a| a.num_bytes())
    }

    /// Rows of every state buffer.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// State buffer names, sorted.
    pub fn state_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.states.keys().cloned().collect();
        v.sort_unstable();
        v
    }

    fn state_buf(&self, name: &str) -> Result<StateBuf, GraphError> {
        self.states
            .get(name)
            .copied()
            .ok_or_else(|| GraphError::MissingState(name.to_string()))
    }

    /// Bytes of one row of state `name`.
    pub fn state_row_bytes(&self, name: &str) -> Result<usize, GraphError> {
        Ok(self.state_buf(name)?.row_bytes)
    }

    /// The first `rows` rows of state `name`, copied to the host.
    pub fn read_state_rows(&self, name: &str, rows: usize) -> Result<Vec<u8>, CudaExecError> {
        let b = self.state_buf(name)?;
        let rows = rows.min(self.rows);
        let view = self
            .state
            .view::<u8>(b.offset, b.row_bytes * rows)
            .map_err(dev(format!("state `{name}`")))?;
        self.state
            .download(view)
            .map_err(dev(format!("reading state `{name}`")))
    }

    /// Overwrites the first rows of state `name` with `bytes` (whole rows).
    pub fn write_state_rows(&mut self, name: &str, bytes: &[u8]) -> Result<(), CudaExecError> {
        let b = self.state_buf(name)?;
        if b.row_bytes == 0
            || !bytes.len().is_multiple_of(b.row_bytes)
            || bytes.len() > b.row_bytes * self.rows
        {
            return Err(GraphError::InputSize {
                name: name.to_string(),
                expected: b.row_bytes * self.rows,
                found: bytes.len(),
            }
            .into());
        }
        let view = self
            .state
            .view::<u8>(b.offset, bytes.len())
            .map_err(dev(format!("state `{name}`")))?;
        self.state
            .upload(view, bytes)
            .map_err(dev(format!("writing state `{name}`")))
    }

    /// Records events around every following step (`last_timing`), or stops doing so.
    pub fn set_timing(&mut self, on: bool) -> Result<(), CudaExecError> {
        self.timer = if on {
            Some(Timer::new(&self.ctx.device).map_err(dev("creating step timer events"))?)
        } else {
            None
        };
        self.last_timing = None;
        Ok(())
    }

    /// Host submission and stream time of the last step (when timing is on).
    pub fn last_timing(&self) -> Option<StepTiming> {
        self.last_timing
    }

    /// Copies every Input value of `plan` from `inputs` into its arena slot.
    fn upload_inputs(
        &mut self,
        plan: &Plan,
        inputs: &[(&str, &[u8])],
    ) -> Result<(), CudaExecError> {
        self.reserve_arena(plan.device_arena_bytes)?;
        let arena = self.arena.as_mut().ok_or(CudaExecError::NoArena)?;
        for (id, v) in plan.graph.of_kind(ValueKind::Input) {
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
                }
                .into());
            }
            let slot = plan
                .slot(id)
                .ok_or_else(|| GraphError::Unsized(v.name.clone()))?;
            let view = arena
                .view::<u8>(slot.offset, need)
                .map_err(dev(format!("input `{}`", v.name)))?;
            arena
                .upload(view, data)
                .map_err(dev(format!("uploading input `{}`", v.name)))?;
        }
        Ok(())
    }

    /// Enqueues every node of `plan` (no host sync): the launch list a capture records.
    fn enqueue(&self, plan: &Plan) -> Result<(), CudaExecError> {
        self.enqueue_with(plan, |_| Ok(()))
    }

    /// [`Self::enqueue`], calling `after(k)` once the k-th scheduled node is enqueued.
    fn enqueue_with(
        &self,
        plan: &Plan,
        mut after: impl FnMut(usize) -> Result<(), CudaExecError>,
    ) -> Result<(), CudaExecError> {
        let decode = matches!(plan.shape.bucket, Bucket::Decode { .. });
        self.ctx
            .device
            .set_programmatic_launch(self.programmatic && decode);
        let arena = self.arena.as_ref().ok_or(CudaExecError::NoArena)?;
        if arena.num_bytes() < plan.device_arena_bytes {
            return Err(CudaExecError::Device {
                what: format!("plan {}", plan.id),
                source: CudaError::OutOfBounds {
                    what: "device arena",
                    start: 0,
                    end: plan.device_arena_bytes,
                    size: arena.num_bytes(),
                },
            });
        }
        let g = &plan.graph;
        let resolve = |id: ValueId| -> Result<(u64, usize), CudaExecError> {
            let st = plan.storage_of(id);
            let v = g.value(st);
            let bytes = v
                .meta
                .bytes()
                .ok_or_else(|| GraphError::Unsized(v.name.clone()))?;
            let ptr = match v.kind {
                ValueKind::Weight => {
                    let &(batch, offset, len) = self
                        .weights
                        .get(&v.name)
                        .ok_or_else(|| GraphError::MissingWeight(v.name.clone()))?;
                    debug_assert_eq!(len, bytes);
                    self.weight_bufs[batch].base_ptr() + offset as u64
                }
                ValueKind::State => {
                    let b = self.state_buf(&v.name)?;
                    if bytes > b.row_bytes * self.rows {
                        return Err(GraphError::InputSize {
                            name: v.name.clone(),
                            expected: bytes,
                            found: b.row_bytes * self.rows,
                        }
                        .into());
                    }
                    self.state.base_ptr() + b.offset as u64
                }
                ValueKind::Input | ValueKind::Intermediate => {
                    let s = plan
                        .slot(st)
                        .ok_or_else(|| GraphError::Unsized(v.name.clone()))?;
                    arena.base_ptr() + s.offset as u64
                }
            };
            Ok((ptr, bytes))
        };
        for (k, &n) in plan.schedule.iter().enumerate() {
            let node = &g.nodes[n];
            let aliases = node.op.aliases();
            let mut outs = Vec::with_capacity(node.outputs.len());
            for &o in &node.outputs {
                let (ptr, bytes) = resolve(o)?;
                outs.push(DeviceTensor {
                    meta: &g.value(o).meta,
                    ptr,
                    bytes,
                });
            }
            let mut ins = Vec::with_capacity(node.inputs.len());
            for (k, &i) in node.inputs.iter().enumerate() {
                let meta = &g.value(i).meta;
                // An aliased input is handed the output's storage (the op reads it there).
                let t = match aliases.iter().find(|&&(_, inp)| inp == k) {
                    Some(&(o, _)) => DeviceTensor {
                        meta,
                        ptr: outs[o].ptr,
                        bytes: outs[o].bytes,
                    },
                    None => {
                        let (ptr, bytes) = resolve(i)?;
                        DeviceTensor { meta, ptr, bytes }
                    }
                };
                ins.push(t);
            }
            let scratch = match plan.scratch.get(n).copied().flatten() {
                Some(s) => Scratch {
                    ptr: arena.base_ptr() + s.offset as u64,
                    bytes: s.bytes,
                },
                None => Scratch::default(),
            };
            node.op
                .cuda(&self.ctx, &ins, &outs, scratch)
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
            after(k)?;
        }
        Ok(())
    }

    /// Runs one step of `plan` eagerly with an event after every node, behind a stall long
    /// enough for the host to enqueue the whole step first, so nodes run back to back as in a
    /// replayed graph. Returns each node's name, op and device milliseconds in schedule order,
    /// and its bytes: a routed expert product's for the experts the step touched, read from
    /// its route table (copied aside after the node that writes it, inside that node's
    /// interval: a few hundred bytes, ~2 µs on the route plan's time).
    pub fn profile_eager(
        &mut self,
        plan: &Plan,
        inputs: &[(&str, &[u8])],
    ) -> Result<Vec<NodeTime>, CudaExecError> {
        self.upload_inputs(plan, inputs)?;
        let g = &plan.graph;
        // (schedule position to copy after, arena offset, elements, offset in `aside`) of each
        // route table a routed product reads, once a table.
        let mut tables: Vec<(usize, usize, usize, usize)> = Vec::new();
        let mut table_of: Vec<Option<usize>> = vec![None; g.nodes.len()];
        let mut aside_len = 0usize;
        for (pos, &n) in plan.schedule.iter().enumerate() {
            let node = &g.nodes[n];
            let Some(rw) = node.op.routed_weights() else {
                continue;
            };
            let Some(&vid) = node.inputs.get(rw.offsets) else {
                continue;
            };
            let meta = &g.value(vid).meta;
            let Some(slot) = plan.slot(plan.storage_of(vid)) else {
                continue;
            };
            let after = plan
                .schedule
                .iter()
                .position(|&m| g.nodes[m].outputs.contains(&vid))
                .unwrap_or(pos);
            let t = match tables
                .iter()
                .position(|t| t.1 == slot.offset && t.0 == after)
            {
                Some(t) => t,
                None => {
                    tables.push((after, slot.offset, meta.numel(), aside_len));
                    aside_len += meta.numel();
                    tables.len() - 1
                }
            };
            table_of[n] = Some(t);
        }
        let mut aside = self
            .ctx
            .device
            .alloc_zeros::<i32>(aside_len.max(1))
            .map_err(dev("allocating the route tables' copies"))?;
        let trail = EventTrail::new(&self.ctx.device, plan.schedule.len() + 1)
            .map_err(dev("creating profile events"))?;
        // Host enqueue runs at a few microseconds a launch; a stall of 20 µs a node covers it.
        let stall_us = 2_000 + 20 * plan.schedule.len() as u64;
        self.ctx
            .device
            .stall(&self.ctx.kernels, stall_us)
            .map_err(dev("stalling the stream"))?;
        trail.mark(0).map_err(dev("recording a profile event"))?;
        let arena = self.arena.as_ref().ok_or(CudaExecError::NoArena)?;
        self.enqueue_with(plan, |k| {
            for &(after, offset, len, at) in &tables {
                if after == k {
                    let view = arena
                        .view::<i32>(offset, len)
                        .map_err(dev("a route table"))?;
                    arena
                        .copy_into(view, &mut aside, at)
                        .map_err(dev("copying a route table aside"))?;
                }
            }
            trail.mark(k + 1).map_err(dev("recording a profile event"))
        })?;
        let ms = trail
            .intervals_ms()
            .map_err(dev("reading profile events"))?;
        let routes = if tables.is_empty() {
            Vec::new()
        } else {
            aside
                .download_range(0..aside_len)
                .map_err(dev("reading the route tables"))?
        };
        self.warm.insert(plan.id);
        Ok(plan
            .schedule
            .iter()
            .zip(ms)
            .map(|(&n, ms)| {
                let node = &plan.graph.nodes[n];
                let bytes = match table_of[n] {
                    Some(t) => {
                        let (_, _, len, at) = tables[t];
                        let offsets = &routes[at..at + len];
                        plan.graph.node_bytes_touched(
                            node,
                            touched_experts(offsets),
                            len.saturating_sub(1),
                        )
                    }
                    None => plan.graph.node_bytes(node),
                } + plan.graph.node_cache_bytes(node, inputs);
                NodeTime {
                    node: node.name.clone(),
                    op: node.op.name().to_string(),
                    ms: f64::from(ms),
                    bytes,
                }
            })
            .collect())
    }

    /// Times `submit` when timing is on: host time to return, stream time between events.
    fn timed(
        &mut self,
        submit: impl FnOnce(&Self) -> Result<(), CudaExecError>,
    ) -> Result<(), CudaExecError> {
        let Some(timer) = self.timer.as_ref() else {
            return submit(self);
        };
        timer
            .start()
            .map_err(dev("recording the step start event"))?;
        let t0 = Instant::now();
        submit(self)?;
        let host = t0.elapsed().as_secs_f64();
        let ms = self
            .timer
            .as_ref()
            .map(|t| t.stop())
            .transpose()
            .map_err(dev("recording the step stop event"))?
            .unwrap_or(0.0);
        self.last_timing = Some(StepTiming {
            host_submit_s: host,
            device_s: ms as f64 / 1e3,
        });
        Ok(())
    }

    /// One step of `plan`, one kernel sequence a node, enqueued without host sync.
    /// `inputs` gives the bytes of every Input value by name.
    pub fn run_eager(
        &mut self,
        plan: &Plan,
        inputs: &[(&str, &[u8])],
    ) -> Result<(), CudaExecError> {
        self.upload_inputs(plan, inputs)?;
        self.timed(|me| me.enqueue(plan))?;
        self.warm.insert(plan.id);
        Ok(())
    }

    /// Records `plan`'s launches into a CUDA graph (nothing runs). The plan must have
    /// run eagerly once. Inputs are read from their arena slots at replay.
    pub fn capture(&mut self, plan: &Plan) -> Result<(), CudaExecError> {
        if !self.warm.contains(&plan.id) {
            return Err(CudaExecError::NotWarm { plan: plan.id });
        }
        self.reserve_arena(plan.device_arena_bytes)?;
        let mut failure = None;
        let captured = self.ctx.device.capture(|_| match self.enqueue(plan) {
            Ok(()) => Ok(()),
            Err(e) => {
                failure = Some(e);
                Err(CudaError::InvalidArgument {
                    what: "graph capture",
                    detail: "an op failed while its launches were recorded".into(),
                })
            }
        });
        if let Some(e) = failure {
            return Err(e);
        }
        let graph = captured.map_err(dev(format!("capturing plan {:?}", plan.shape.bucket)))?;
        graph.upload().map_err(dev(format!(
            "uploading the graph of {:?}",
            plan.shape.bucket
        )))?;
        self.graphs.insert(plan.id, SendGraph(graph));
        Ok(())
    }

    pub fn is_captured(&self, plan: &Plan) -> bool {
        self.graphs.contains_key(&plan.id)
    }

    /// Uploads `inputs` into `plan`'s slots and launches its captured graph.
    pub fn replay(&mut self, plan: &Plan, inputs: &[(&str, &[u8])]) -> Result<(), CudaExecError> {
        self.upload_inputs(plan, inputs)?;
        if !self.graphs.contains_key(&plan.id) {
            return Err(CudaExecError::NotCaptured { plan: plan.id });
        }
        self.timed(|me| {
            let graph = me
                .graphs
                .get(&plan.id)
                .ok_or(CudaExecError::NotCaptured { plan: plan.id })?;
            graph.0.launch().map_err(dev("launching a captured step"))
        })
    }

    /// Waits for every enqueued step.
    pub fn synchronize(&self) -> Result<(), CudaExecError> {
        self.ctx.device.synchronize().map_err(dev("synchronizing"))
    }

    fn output_view(
        &self,
        plan: &Plan,
        name: &str,
        want: ops::DType,
    ) -> Result<(usize, usize), CudaExecError> {
        let id = plan
            .graph
            .output(name)
            .ok_or_else(|| GraphError::MissingOutput(name.to_string()))?;
        let meta = &plan.graph.value(id).meta;
        if meta.dtype != want {
            return Err(CudaExecError::OutputType {
                name: name.to_string(),
                meta: meta.to_string(),
                want: want.name(),
            });
        }
        let st = plan.storage_of(id);
        let slot = plan
            .slot(st)
            .ok_or_else(|| GraphError::Unsized(name.to_string()))?;
        Ok((slot.offset, meta.numel()))
    }

    /// The f32 contents of a named output after a step (waits for it).
    pub fn output_f32(&self, plan: &Plan, name: &str) -> Result<Vec<f32>, CudaExecError> {
        let (offset, n) = self.output_view(plan, name, ops::DType::F32)?;
        let arena = self.arena.as_ref().ok_or(CudaExecError::NoArena)?;
        let view = arena
            .view::<f32>(offset, n)
            .map_err(dev(format!("output `{name}`")))?;
        arena
            .download(view)
            .map_err(dev(format!("reading output `{name}`")))
    }

    /// Elements `start..start + len` of a named f32 output after a step (waits for it): the
    /// rows of it the host needs, not the whole output.
    pub fn output_f32_range(
        &self,
        plan: &Plan,
        name: &str,
        start: usize,
        len: usize,
    ) -> Result<Vec<f32>, CudaExecError> {
        let (offset, n) = self.output_view(plan, name, ops::DType::F32)?;
        if start.checked_add(len).is_none_or(|end| end > n) {
            return Err(GraphError::InputSize {
                name: format!("elements {start}..+{len} of output `{name}`"),
                expected: n,
                found: start.saturating_add(len),
            }
            .into());
        }
        let arena = self.arena.as_ref().ok_or(CudaExecError::NoArena)?;
        let view = arena
            .view::<f32>(offset + start * 4, len)
            .map_err(dev(format!("output `{name}`")))?;
        arena
            .download(view)
            .map_err(dev(format!("reading output `{name}`")))
    }

    /// The i32 contents of a named output after a step (waits for it).
    pub fn output_i32(&self, plan: &Plan, name: &str) -> Result<Vec<i32>, CudaExecError> {
        let (offset, n) = self.output_view(plan, name, ops::DType::I32)?;
        let arena = self.arena.as_ref().ok_or(CudaExecError::NoArena)?;
        let view = arena
            .view::<i32>(offset, n)
            .map_err(dev(format!("output `{name}`")))?;
        arena
            .download(view)
            .map_err(dev(format!("reading output `{name}`")))
    }
}

const _: () = {
    const fn send<T: Send>() {}
    send::<CudaExecutor>();
};

/// Experts with at least one route in a route table (`offsets`, `n_expert + 1` entries).
pub fn touched_experts(offsets: &[i32]) -> usize {
    offsets.windows(2).filter(|w| w[1] > w[0]).count()
}

fn row_bytes(meta: &TensorMeta) -> Option<usize> {
    let rows = *meta.shape.first()?;
    meta.bytes().map(|b| b / rows.max(1))
}
