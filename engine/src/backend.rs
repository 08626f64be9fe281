//! Where a session's steps run: the CPU executor over host state, or the CUDA
//! executor with the weights and the cache on the card. Decode steps on the GPU
//! replay one captured graph per KV bucket; prefill chunks run eagerly (a chunk's
//! kernels are long enough that launch cost is a small share of it, and every
//! distinct chunk length would need its own capture).

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use graph::{
    Bucket, CpuExecutor, CudaExecutor, GraphBuilder, HostState, KvPool, LogitRows, LoweringOptions,
    NodeTime, Plan, StepShape, StepTiming, Target, ValueKind,
};
use ops::TensorMeta;
use ops::gpu::GpuCtx;
use ops::head::{PenalizeRows, SAMPLE_FIELDS, SampleRows};

use crate::{CPU_POOL_BYTES, EngineConfig, EngineError, GPU_POOL_FRACTION, Model};

/// Name of the extra output a plan that chooses tokens ends with: each logits row's token,
/// I32 `[rows]`.
pub const NEXT_TOKEN: &str = "next_token";

/// Name of the extra input such a plan reads: each logits row's [`ops::head::RowSampling`],
/// F32 `[rows, SAMPLE_FIELDS]`.
pub const SAMPLING: &str = "sampling";

/// Inputs of a plan whose choice applies a repetition penalty: each logits row's penalty, F32
/// `[rows]`, and the ids it applies to, I32 `[rows, width]` (-1 padded).
pub const PENALTY: &str = "penalty";
pub const PENALTY_IDS: &str = "penalty_ids";

/// Device memory kept free beyond weights, cache and arena: cuBLAS workspace, kernel
/// modules, instantiated graphs.
pub const DEVICE_RESERVE_BYTES: usize = 512 << 20;

/// Which processor a session runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Device {
    #[default]
    Cpu,
    /// A CUDA GPU by ordinal.
    Cuda(usize),
}

impl Device {
    /// GPU 0 when the CUDA driver sees one, else the CPU.
    pub fn auto() -> Device {
        match cuda::Device::available() {
            Ok(n) if n > 0 => Device::Cuda(0),
            _ => Device::Cpu,
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl FromStr for Device {
    type Err = String;

    /// `cpu`, `cuda`, `cuda:N`, or `auto` (see [`Device::auto`]).
    fn from_str(s: &str) -> Result<Device, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            "auto" => Ok(Device::auto()),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Device::Cuda(n)),
                _ => Err(format!(
                    "device {s:?}: expected cpu, cuda, cuda:N (N a GPU ordinal) or auto"
                )),
            },
        }
    }
}

/// What a session needs on the card, against what it has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceBudget {
    pub max_model_len: usize,
    /// Positions of the cache pool (blocks × block size).
    pub rows: usize,
    pub weights: usize,
    pub cache: usize,
    /// The largest step arena (a decode step at the full bucket or a prefill chunk).
    pub arena: usize,
    pub reserve: usize,
}

impl DeviceBudget {
    pub fn need(&self) -> usize {
        self.weights + self.cache + self.arena + self.reserve
    }

    /// Refuses a budget that does not fit in `free` bytes, with every number (seed §5):
    /// a load-time error instead of an out-of-memory inside a request.
    pub fn check(&self, device: Device, free: usize, total: usize) -> Result<(), EngineError> {
        if self.need() <= free {
            return Ok(());
        }
        Err(EngineError::DeviceMemory {
            device: device.to_string(),
            budget: *self,
            free,
            total,
        })
    }
}

pub(crate) fn mib(b: usize) -> String {
    format!("{:.0} MiB", b as f64 / 1048576.0)
}

/// The plan for `shape`, lowered for `target` with `lowering`; with `choose`, the
/// declaration's `logits` and the input [`SAMPLING`] feed a `SampleRows` whose I32 result is
/// the output [`NEXT_TOKEN`], so a step reads back 4 bytes a row instead of a vocabulary of
/// floats (greedy rows take the argmax, sampled ones their draw); a `choose` width above 0
/// puts a `PenalizeRows` over the inputs [`PENALTY`] and [`PENALTY_IDS`] (that many ids a
/// row) before it.
pub fn build_plan(
    model: &Model,
    shape: StepShape,
    choose: Option<usize>,
    target: Target,
    lowering: &LoweringOptions,
) -> Result<Plan, EngineError> {
    let mut b = GraphBuilder::new(model);
    model.decl.declare(&mut b, &shape)?;
    let mut g = b.finish();
    if let Some(width) = choose {
        let raw = g
            .output("logits")
            .ok_or_else(|| graph::GraphError::MissingOutput("logits".into()))?;
        let rows = g.value(raw).meta.shape.first().copied().unwrap_or(0);
        let logits = match width {
            0 => raw,
            w => {
                let ids = push_input(&mut g, PENALTY_IDS, TensorMeta::i32([rows, w]));
                let pen = push_input(&mut g, PENALTY, TensorMeta::f32([rows]));
                push_node(
                    &mut g,
                    "penalize_rows",
                    PenalizeRows,
                    vec![raw, ids, pen],
                    "penalized",
                )?
            }
        };
        let params = push_input(&mut g, SAMPLING, TensorMeta::f32([rows, SAMPLE_FIELDS]));
        let id = push_node(
            &mut g,
            "sample_rows",
            SampleRows,
            vec![logits, params],
            NEXT_TOKEN,
        )?;
        g.outputs.push((NEXT_TOKEN.into(), id));
    }
    Ok(Plan::lowered(g, shape, target, lowering)?)
}

fn push_input(g: &mut graph::Graph, name: &str, meta: TensorMeta) -> graph::ValueId {
    let id = graph::ValueId(g.values.len());
    g.values.push(graph::ValueInfo {
        name: name.into(),
        meta,
        kind: ValueKind::Input,
        alias_of: None,
    });
    id
}

/// Appends node `name` running `op` over `inputs`, its one output named `out`.
fn push_node(
    g: &mut graph::Graph,
    name: &str,
    op: impl ops::Op + 'static,
    inputs: Vec<graph::ValueId>,
    out: &str,
) -> Result<graph::ValueId, EngineError> {
    let metas: Vec<&TensorMeta> = inputs.iter().map(|&i| &g.value(i).meta).collect();
    let meta = op
        .infer(&metas)
        .map_err(|source| graph::GraphError::Op {
            node: name.into(),
            describe: op.describe(),
            inputs: metas.iter().map(|m| m.to_string()).collect(),
            source,
        })?
        .pop()
        .ok_or_else(|| graph::GraphError::MissingOutput(out.into()))?;
    let id = graph::ValueId(g.values.len());
    g.values.push(graph::ValueInfo {
        name: out.into(),
        meta,
        kind: ValueKind::Intermediate,
        alias_of: None,
    });
    g.nodes.push(graph::Node {
        name: name.into(),
        op: Arc::new(op),
        inputs,
        outputs: vec![id],
    });
    Ok(id)
}

/// The GPU a session runs on, opened before its plans are lowered (they depend on the card).
pub(crate) fn open_device(device: Device) -> Result<Option<Arc<GpuCtx>>, EngineError> {
    match device {
        Device::Cpu => Ok(None),
        Device::Cuda(ordinal) => {
            let unavailable = |reason: String| EngineError::DeviceUnavailable {
                device: device.to_string(),
                reason,
            };
            let ctx = GpuCtx::open(ordinal).map_err(|e| unavailable(e.to_string()))?;
            // Every kernel source now, in parallel, rather than each at its first launch
            // (inside a request's step on a host whose disk cache is cold).
            ctx.kernels
                .preload(&ops::kernel_sources())
                .map_err(|e| unavailable(format!("compiling the kernels: {e}")))?;
            Ok(Some(Arc::new(ctx)))
        }
    }
}

/// The lowering target of a session's device.
pub(crate) fn target_of(ctx: Option<&GpuCtx>) -> Target {
    match ctx {
        None => Target::Cpu,
        Some(ctx) => Target::Cuda {
            compute_capability: ctx.device.compute_capability(),
        },
    }
}

/// The executor of a session and the state it owns.
pub(crate) enum Backend {
    Cpu {
        exec: CpuExecutor,
        state: HostState,
    },
    Cuda {
        exec: Box<CudaExecutor>,
        /// Replay captured decode steps (false: every step eager, for A/B runs).
        graphs: bool,
        budget: DeviceBudget,
        /// Run the next step eagerly with an event after every node (then cleared).
        profile_next: bool,
        /// The per-node times of the last profiled step.
        profile: Vec<NodeTime>,
    },
}

impl Backend {
    /// The backend for `device` with the cache pool `pool`, sized from `probe` (the widest
    /// decode plan at the full bucket) and `prefill` (the widest prefill chunk).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        device: Device,
        ctx: Option<Arc<GpuCtx>>,
        cuda_graphs: bool,
        max_model_len: usize,
        pool: KvPool,
        probe: &Plan,
        prefill: Option<&Plan>,
    ) -> Result<Backend, EngineError> {
        let rows = pool.rows();
        let Some(ctx) = ctx else {
            return Ok(Backend::Cpu {
                exec: CpuExecutor::new(),
                state: HostState::for_plan(probe, rows)?,
            });
        };
        let unavailable = |reason: String| EngineError::DeviceUnavailable {
            device: device.to_string(),
            reason,
        };
        let weights: usize = graph::weight_layout(probe)?
            .iter()
            .map(|(_, _, b)| b.next_multiple_of(graph::SLOT_ALIGN))
            .sum();
        let cache: usize = probe
            .graph
            .of_kind(ValueKind::State)
            .filter(|(_, v)| v.alias_of.is_none())
            .filter_map(|(_, v)| v.meta.bytes())
            .map(|b| b.next_multiple_of(graph::SLOT_ALIGN))
            .sum();
        let arena = probe
            .device_arena_bytes
            .max(prefill.map_or(0, |p| p.device_arena_bytes));
        let budget = DeviceBudget {
            max_model_len,
            rows,
            weights,
            cache,
            arena,
            reserve: DEVICE_RESERVE_BYTES,
        };
        let (free, total) = ctx
            .device
            .mem_get_info()
            .map_err(|e| unavailable(e.to_string()))?;
        budget.check(device, free, total)?;
        let mut exec = CudaExecutor::without_weights(ctx, probe, rows)?;
        exec.reserve_arena(arena)?;
        Ok(Backend::Cuda {
            exec: Box::new(exec),
            graphs: cuda_graphs,
            budget,
            profile_next: false,
            profile: Vec::new(),
        })
    }

    pub(crate) fn is_cuda(&self) -> bool {
        matches!(self, Backend::Cuda { .. })
    }

    /// Runs one step of `plan` over `inputs`.
    pub(crate) fn run(
        &mut self,
        model: &Model,
        plan: &Plan,
        inputs: &[(&str, &[u8])],
    ) -> Result<(), EngineError> {
        match self {
            Backend::Cpu { exec, state } => Ok(exec.run(plan, model, state, inputs)?),
            Backend::Cuda {
                exec,
                graphs,
                profile_next,
                profile,
                ..
            } => {
                exec.upload_weights(plan, model)?;
                // The sizing plans bound every step the engine makes; a caller's own shape
                // (a wider chunk through `Engine::plan`) grows the arena instead of failing.
                exec.reserve_arena(plan.device_arena_bytes)?;
                let decode = matches!(plan.shape.bucket, Bucket::Decode { .. });
                if std::mem::take(profile_next) {
                    *profile = exec.profile_eager(plan, inputs)?;
                } else if *graphs && decode && exec.is_captured(plan) {
                    exec.replay(plan, inputs)?;
                } else {
                    exec.run_eager(plan, inputs)?;
                    if *graphs && decode {
                        // Recorded now, replayed from the next step of this bucket on.
                        exec.capture(plan)?;
                    }
                }
                Ok(())
            }
        }
    }

    /// The f32 output `name` of the last step.
    pub(crate) fn output_f32(&self, plan: &Plan, name: &str) -> Result<Vec<f32>, EngineError> {
        match self {
            Backend::Cpu { exec, .. } => Ok(exec.output_f32(plan, name)?.to_vec()),
            Backend::Cuda { exec, .. } => Ok(exec.output_f32(plan, name)?),
        }
    }

    /// Rows `rows` of the f32 output `name` of the last step, `width` floats a row.
    pub(crate) fn output_f32_rows(
        &self,
        plan: &Plan,
        name: &str,
        rows: std::ops::Range<usize>,
        width: usize,
    ) -> Result<Vec<f32>, EngineError> {
        let (start, len) = (rows.start * width, rows.len() * width);
        match self {
            Backend::Cpu { exec, .. } => {
                let all = exec.output_f32(plan, name)?;
                all.get(start..start + len)
                    .map(<[f32]>::to_vec)
                    .ok_or_else(|| {
                        EngineError::from(graph::GraphError::InputSize {
                            name: format!("rows {rows:?} of output `{name}`"),
                            expected: all.len(),
                            found: start + len,
                        })
                    })
            }
            Backend::Cuda { exec, .. } => Ok(exec.output_f32_range(plan, name, start, len)?),
        }
    }

    /// The i32 output `name` of the last step.
    pub(crate) fn output_i32(&self, plan: &Plan, name: &str) -> Result<Vec<i32>, EngineError> {
        match self {
            // The CPU arena is read as f32; an I32 output's elements are its bits.
            Backend::Cpu { exec, .. } => Ok(exec
                .output_f32(plan, name)?
                .iter()
                .map(|x| x.to_bits() as i32)
                .collect()),
            Backend::Cuda { exec, .. } => Ok(exec.output_i32(plan, name)?),
        }
    }

    pub(crate) fn cache_bytes(&self) -> usize {
        match self {
            Backend::Cpu { state, .. } => state.total_bytes(),
            Backend::Cuda { exec, .. } => exec.state_bytes(),
        }
    }

    /// `(name, first len rows)` of every state buffer, sorted by name.
    pub(crate) fn read_rows(&self, len: usize) -> Result<Vec<(String, Vec<u8>)>, EngineError> {
        match self {
            Backend::Cpu { state, .. } => {
                let rows = state.rows().max(1);
                let mut names: Vec<&str> = state.names().collect();
                names.sort_unstable();
                Ok(names
                    .iter()
                    .filter_map(|n| state.get(n).map(|b| (n.to_string(), b)))
                    .map(|(n, b)| {
                        let row = b.len() / rows;
                        (n, b.bytes()[..row * len].to_vec())
                    })
                    .collect())
            }
            Backend::Cuda { exec, .. } => exec
                .state_names()
                .into_iter()
                .map(|n| {
                    let b = exec.read_state_rows(&n, len)?;
                    Ok((n, b))
                })
                .collect(),
        }
    }

    /// Overwrites the first `len` rows of state `name` with the start of `bytes`.
    pub(crate) fn write_rows(
        &mut self,
        name: &str,
        bytes: &[u8],
        len: usize,
    ) -> Result<(), EngineError> {
        match self {
            Backend::Cpu { state, .. } => {
                let rows = state.rows().max(1);
                let buf = state
                    .get_mut(name)
                    .ok_or_else(|| graph::GraphError::MissingState(name.to_string()))?;
                let row = buf.len() / rows;
                let n = row * len;
                let src = bytes.get(..n).ok_or_else(|| graph::GraphError::InputSize {
                    name: name.to_string(),
                    expected: n,
                    found: bytes.len(),
                })?;
                buf.bytes_mut()[..n].copy_from_slice(src);
                Ok(())
            }
            Backend::Cuda { exec, .. } => {
                let n = exec.state_row_bytes(name)? * len;
                let src = bytes.get(..n).ok_or_else(|| graph::GraphError::InputSize {
                    name: name.to_string(),
                    expected: n,
                    found: bytes.len(),
                })?;
                Ok(exec.write_state_rows(name, src)?)
            }
        }
    }
}

/// Timing and memory facts of a GPU session, for benchmarks.
impl crate::Engine {
    /// Uploads the weights every decode step needs now (on the CPU: nothing to do), calling
    /// `progress(bytes uploaded, bytes to upload)` as tensors land; otherwise the first step
    /// uploads them.
    pub fn upload_weights(
        &mut self,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<(), EngineError> {
        let Backend::Cuda { exec, .. } = &mut self.backend else {
            return Ok(());
        };
        if let Some(plan) = self
            .plans
            .iter()
            .find(|((s, _), _)| matches!(s.bucket, Bucket::Decode { .. }))
            .map(|(_, p)| p)
        {
            exec.upload_weights_with(plan, &*self.model, progress)?;
        }
        Ok(())
    }

    /// Replay captured decode steps (true, the default) or run every step eagerly.
    pub fn set_cuda_graphs(&mut self, on: bool) {
        if let Backend::Cuda { graphs, .. } = &mut self.backend {
            *graphs = on;
        }
    }

    /// Records host submission and stream time of every following step (GPU only).
    pub fn set_step_timing(&mut self, on: bool) -> Result<(), EngineError> {
        if let Backend::Cuda { exec, .. } = &mut self.backend {
            exec.set_timing(on)?;
        }
        Ok(())
    }

    /// Runs the next step eagerly with an event after every node, stream held until the whole
    /// step is enqueued (GPU only); [`Self::take_profile`] then returns each node's device time.
    pub fn profile_next_step(&mut self) {
        if let Backend::Cuda { profile_next, .. } = &mut self.backend {
            *profile_next = true;
        }
    }

    /// The per-node device times of the last profiled step (empty when none was profiled).
    pub fn take_profile(&mut self) -> Vec<NodeTime> {
        match &mut self.backend {
            Backend::Cuda { profile, .. } => std::mem::take(profile),
            Backend::Cpu { .. } => Vec::new(),
        }
    }

    /// Timing of the last step, when [`Self::set_step_timing`] is on (GPU only).
    pub fn last_step_timing(&self) -> Option<StepTiming> {
        match &self.backend {
            Backend::Cuda { exec, .. } => exec.last_timing(),
            Backend::Cpu { .. } => None,
        }
    }

    /// The device budget checked at load (GPU only).
    pub fn device_budget(&self) -> Option<DeviceBudget> {
        match &self.backend {
            Backend::Cuda { budget, .. } => Some(*budget),
            Backend::Cpu { .. } => None,
        }
    }

    /// The GPU's name, or `cpu`.
    pub fn device_name(&self) -> String {
        match &self.backend {
            Backend::Cuda { exec, .. } => exec.ctx().device.name().to_string(),
            Backend::Cpu { .. } => "cpu".into(),
        }
    }
}

/// What the plans that size a session are built from.
pub(crate) struct Sizing<'a> {
    pub target: Target,
    pub lowering: &'a LoweringOptions,
    pub prefill_chunk: usize,
    pub max_model_len: usize,
    /// The context bucket of a full sequence.
    pub kv: usize,
    /// The widest decode batch bucket.
    pub max_batch: usize,
}

impl Sizing<'_> {
    /// The widest decode step at the full bucket and, for a GPU, the widest step with a
    /// prefill chunk at the full bucket, over `pool`.
    pub fn plans(&self, model: &Model, pool: KvPool) -> Result<(Plan, Option<Plan>), EngineError> {
        let shape = |bucket| StepShape {
            bucket,
            logits: LogitRows::Last,
            pool,
        };
        let probe = build_plan(
            model,
            shape(Bucket::Decode {
                batch: self.max_batch,
                kv: self.kv,
            }),
            None,
            self.target,
            self.lowering,
        )?;
        let chunk = self.prefill_chunk.min(self.max_model_len);
        // The widest step with a chunk: the chunk beside a full batch of decode rows (a mixed
        // step), or alone when sequences are decoded one at a time.
        let widest = if self.max_batch > 1 {
            Bucket::Mixed {
                chunk,
                batch: self.max_batch,
                kv: self.kv,
            }
        } else {
            Bucket::Prefill { chunk, kv: self.kv }
        };
        let prefill = match self.target {
            Target::Cuda { .. } if chunk > 1 => Some(build_plan(
                model,
                shape(widest),
                None,
                self.target,
                self.lowering,
            )?),
            _ => None,
        };
        Ok((probe, prefill))
    }
}

/// Blocks of a session's cache pool: `config.kv_blocks`, or sized as [`EngineConfig`] says;
/// never fewer than `per_seq` (one sequence of `max_model_len`; a GPU that cannot hold that
/// is refused later by the budget check, with the numbers).
pub(crate) fn pool_blocks(
    model: &Model,
    ctx: Option<&GpuCtx>,
    config: &EngineConfig,
    per_seq: usize,
    probe: &Plan,
    prefill: Option<&Plan>,
) -> Result<usize, EngineError> {
    if config.kv_blocks > 0 {
        return Ok(config.kv_blocks.max(per_seq));
    }
    // A position's bytes as the plans store them (the lowering may narrow the cache to F16),
    // else as the model declares them.
    let planned: usize = probe
        .graph
        .of_kind(ValueKind::State)
        .filter(|(_, v)| v.alias_of.is_none())
        .filter_map(|(_, v)| {
            let rows = *v.meta.shape.first()?;
            v.meta.bytes().map(|b| b / rows.max(1))
        })
        .sum();
    let per_position = if planned > 0 {
        planned
    } else {
        model.decl.state_bytes_per_position()
    };
    let block_bytes = (per_position * config.block_size).max(1);
    let wanted = per_seq.saturating_mul(config.max_num_seqs);
    let Some(ctx) = ctx else {
        return Ok(wanted.min(CPU_POOL_BYTES / block_bytes).max(per_seq));
    };
    let weights: usize = graph::weight_layout(probe)?
        .iter()
        .map(|(_, _, b)| b.next_multiple_of(graph::SLOT_ALIGN))
        .sum();
    let arena = probe
        .device_arena_bytes
        .max(prefill.map_or(0, |p| p.device_arena_bytes));
    let (free, _) = ctx
        .device
        .mem_get_info()
        .map_err(|e| EngineError::DeviceUnavailable {
            device: config.device.to_string(),
            reason: e.to_string(),
        })?;
    let spare = free.saturating_sub(weights + arena + DEVICE_RESERVE_BYTES);
    // Each layer's buffer is aligned on its own; a block's bytes round up a little.
    let fit = (spare as f64 * GPU_POOL_FRACTION) as usize / (block_bytes + graph::SLOT_ALIGN);
    Ok(wanted.min(fit).max(per_seq))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse_and_bad_ones_say_what_is_expected() {
        assert_eq!("cpu".parse::<Device>(), Ok(Device::Cpu));
        assert_eq!("cuda".parse::<Device>(), Ok(Device::Cuda(0)));
        assert_eq!("cuda:3".parse::<Device>(), Ok(Device::Cuda(3)));
        assert_eq!(Device::Cuda(3).to_string(), "cuda:3");
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", ""] {
            let e = bad.parse::<Device>().unwrap_err();
            assert!(e.contains("cuda:N"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_cache_that_does_not_fit_is_refused_with_every_number() {
        let b = DeviceBudget {
            max_model_len: 49152,
            rows: 65536,
            weights: 18 << 30,
            cache: 6 << 30,
            arena: 2 << 30,
            reserve: DEVICE_RESERVE_BYTES,
        };
        assert!(b.check(Device::Cuda(0), b.need(), b.need()).is_ok());
        let e = b
            .check(Device::Cuda(1), 20 << 30, 24 << 30)
            .unwrap_err()
            .to_string();
        for part in [
            "--max-model-len 49152",
            "65536 positions",
            "6144 MiB",
            "18432 MiB",
            "2048 MiB",
            "512 MiB",
            "27136 MiB",
            "cuda:1 has 20480 MiB free of 24576 MiB",
        ] {
            assert!(e.contains(part), "missing {part:?} in: {e}");
        }
    }
}
