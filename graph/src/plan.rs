//! A graph bound to a bucket: its topological schedule and its arena layout.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use petgraph::Direction;
use petgraph::graph::DiGraph;

use crate::GraphError;
use crate::builder::{Graph, ValueId, ValueKind};
use crate::lower::{LoweringOptions, Target, lower};

/// Byte alignment of every arena slot (a cache line is 64; 256 suits the GPU too).
pub const SLOT_ALIGN: usize = 256;

/// The shape a step is planned for. `kv` is the context bucket: every sequence of the step
/// has at most `kv` cached positions after it, i.e. a block table of `kv / block_size` blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Bucket {
    /// `batch` tokens, one a sequence (`batch` sequences), attending over up to `kv` rows each.
    Decode { batch: usize, kv: usize },
    /// A chunk of `chunk` consecutive tokens of one sequence over `kv` cache rows.
    Prefill { chunk: usize, kv: usize },
    /// A chunk of `chunk` tokens of one sequence (rows `0..chunk`, sequence 0), then `batch`
    /// decode rows of one sequence each (sequences `1..=batch`, padding rows last), as vLLM's
    /// chunked prefill mixes them: the chunk's last row and the decode rows are contiguous,
    /// so each sequence's last row is one slice.
    Mixed {
        chunk: usize,
        batch: usize,
        kv: usize,
    },
}

impl Bucket {
    pub fn n_tokens(&self) -> usize {
        match *self {
            Bucket::Decode { batch, .. } => batch,
            Bucket::Prefill { chunk, .. } => chunk,
            Bucket::Mixed { chunk, batch, .. } => chunk + batch,
        }
    }

    pub fn kv(&self) -> usize {
        match *self {
            Bucket::Decode { kv, .. } | Bucket::Prefill { kv, .. } | Bucket::Mixed { kv, .. } => kv,
        }
    }

    /// Sequences the step's rows come from (rows of its block table).
    pub fn seqs(&self) -> usize {
        match *self {
            Bucket::Decode { batch, .. } => batch,
            Bucket::Prefill { .. } => 1,
            Bucket::Mixed { batch, .. } => 1 + batch,
        }
    }

    /// The decode bucket serving a context of `len` rows: the power of two at or above it.
    pub fn kv_bucket_for(len: usize, min: usize) -> usize {
        len.max(min).max(1).next_power_of_two()
    }
}

/// Which rows of the step get logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LogitRows {
    /// Only the last token's (generation).
    Last,
    /// Every token's (scoring, `--dump-logits`).
    All,
}

/// The latent cache every plan of a session shares: `blocks` fixed-size blocks of
/// `block_size` positions, one pool for all sequences (each sequence names its blocks in a
/// block table, as vLLM's paged cache does).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvPool {
    pub block_size: usize,
    pub blocks: usize,
}

/// Positions of a cache block unless a session chooses otherwise: a multiple of the
/// attention kernel's 32-row tiles, so a tile never straddles two blocks.
pub const DEFAULT_BLOCK_SIZE: usize = 64;

impl KvPool {
    /// Rows of the pool (what each layer's cache state holds).
    pub fn rows(&self) -> usize {
        self.block_size * self.blocks
    }

    /// A pool holding exactly one sequence of `kv` rows (tests and single-sequence tools).
    pub fn for_rows(kv: usize) -> KvPool {
        let block_size = DEFAULT_BLOCK_SIZE.min(kv.max(1).next_power_of_two());
        KvPool {
            block_size,
            blocks: kv.div_ceil(block_size),
        }
    }
}

/// What a declaration is asked to build.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StepShape {
    pub bucket: Bucket,
    pub logits: LogitRows,
    pub pool: KvPool,
}

impl StepShape {
    /// A step over a pool sized for one sequence of the bucket's `kv` rows.
    pub fn single(bucket: Bucket, logits: LogitRows) -> StepShape {
        StepShape {
            bucket,
            logits,
            pool: KvPool::for_rows(bucket.kv()),
        }
    }

    /// Blocks in each sequence's block table: the context bucket over the block size.
    pub fn table_width(&self) -> usize {
        self.bucket.kv().div_ceil(self.pool.block_size.max(1))
    }

    /// Rows that get logits: with [`LogitRows::Last`], each sequence's last row (every row of
    /// a decode step, the final row of a prefill chunk); with `All`, every row.
    pub fn logit_rows(&self) -> usize {
        match (self.logits, self.bucket) {
            (LogitRows::All, b) => b.n_tokens(),
            (LogitRows::Last, b) => b.seqs(),
        }
    }

    /// The first row that gets logits (they are the step's last [`Self::logit_rows`] rows).
    pub fn first_logit_row(&self) -> usize {
        self.bucket.n_tokens() - self.logit_rows()
    }
}

/// Arena placement of one value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    pub offset: usize,
    pub bytes: usize,
}

/// A schedule and memory layout for one step shape.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Unique per `Plan::new` (clones share it): what executors key captured work by.
    pub id: u64,
    pub shape: StepShape,
    pub graph: Graph,
    /// Node indices in execution order.
    pub schedule: Vec<usize>,
    /// Arena slot of every Input and Intermediate value (None for weights and state).
    pub slots: Vec<Option<Slot>>,
    /// Bytes the values need (what the CPU executor allocates).
    pub arena_bytes: usize,
    /// Per node (indexed like `graph.nodes`): the device scratch its CUDA kernels asked
    /// for (`Op::cuda_scratch_bytes`), live only while that node runs.
    pub scratch: Vec<Option<Slot>>,
    /// Bytes the values and every scratch slot need (what a device arena holds).
    pub device_arena_bytes: usize,
    /// The device the graph was lowered for and the options it was lowered with (None for a
    /// graph planned as declared).
    pub lowering: Option<(Target, LoweringOptions)>,
}

static NEXT_PLAN_ID: AtomicU64 = AtomicU64::new(1);

/// First offset where `bytes` fit between the `busy` ranges.
fn first_fit(mut busy: Vec<(usize, usize)>, bytes: usize) -> usize {
    busy.sort();
    let mut offset = 0;
    for (s, e) in busy {
        if offset + bytes <= s {
            break;
        }
        offset = offset.max(e);
    }
    offset
}

fn align(n: usize) -> usize {
    n.div_ceil(SLOT_ALIGN) * SLOT_ALIGN
}

impl Plan {
    /// The plan of a declared graph lowered for `target` with `opts` (see [`lower`]).
    pub fn lowered(
        graph: Graph,
        shape: StepShape,
        target: Target,
        opts: &LoweringOptions,
    ) -> Result<Plan, GraphError> {
        let mut plan = Plan::new(lower(graph, target, opts)?, shape)?;
        plan.lowering = Some((target, opts.clone()));
        Ok(plan)
    }

    /// The plan of `graph` as it is (no lowering: what the CPU runs, or a hand-built graph).
    pub fn new(graph: Graph, shape: StepShape) -> Result<Plan, GraphError> {
        // The DAG: an edge from the producer of each value to each consumer.
        let mut dag = DiGraph::<usize, ()>::new();
        let idx: Vec<_> = (0..graph.nodes.len()).map(|i| dag.add_node(i)).collect();
        let mut producer = vec![None; graph.values.len()];
        for (n, node) in graph.nodes.iter().enumerate() {
            for o in &node.outputs {
                producer[o.0] = Some(n);
            }
        }
        for (n, node) in graph.nodes.iter().enumerate() {
            for i in &node.inputs {
                if let Some(p) = producer[i.0] {
                    dag.add_edge(idx[p], idx[n], ());
                }
            }
        }
        // Kahn's algorithm, always taking the earliest-declared ready node: the
        // schedule keeps the model file's order wherever the data flow allows, so a
        // plan listing reads like the declaration.
        let mut indegree: Vec<usize> = idx
            .iter()
            .map(|&ix| dag.neighbors_directed(ix, Direction::Incoming).count())
            .collect();
        let mut ready: BinaryHeap<Reverse<usize>> = (0..idx.len())
            .filter(|&n| indegree[n] == 0)
            .map(Reverse)
            .collect();
        let mut schedule = Vec::with_capacity(idx.len());
        while let Some(Reverse(n)) = ready.pop() {
            schedule.push(n);
            for succ in dag.neighbors_directed(idx[n], Direction::Outgoing) {
                let m = dag[succ];
                indegree[m] -= 1;
                if indegree[m] == 0 {
                    ready.push(Reverse(m));
                }
            }
        }
        if schedule.len() != idx.len() {
            let stuck = (0..idx.len()).find(|&n| indegree[n] > 0).unwrap_or(0);
            return Err(GraphError::Cycle(graph.nodes[stuck].name.clone()));
        }

        // Lifetimes in schedule steps: [first, last] inclusive.
        let end = schedule.len();
        let mut first = vec![usize::MAX; graph.values.len()];
        let mut last = vec![0usize; graph.values.len()];
        for (step, &n) in schedule.iter().enumerate() {
            let node = &graph.nodes[n];
            for o in &node.outputs {
                first[o.0] = first[o.0].min(step);
                last[o.0] = last[o.0].max(step);
            }
            for i in &node.inputs {
                last[i.0] = last[i.0].max(step);
            }
        }
        for (id, v) in graph.values.iter().enumerate() {
            if v.kind == ValueKind::Input {
                first[id] = 0;
            }
        }
        for (_, v) in &graph.outputs {
            last[v.0] = end;
        }

        // Greedy first-fit, largest values first, among values whose lifetimes overlap.
        let mut order: Vec<usize> = (0..graph.values.len())
            .filter(|&i| {
                let v = &graph.values[i];
                v.alias_of.is_none() && matches!(v.kind, ValueKind::Input | ValueKind::Intermediate)
            })
            .collect();
        let bytes_of = |i: usize| -> Result<usize, GraphError> {
            graph.values[i]
                .meta
                .bytes()
                .map(align)
                .ok_or_else(|| GraphError::Unsized(graph.values[i].name.clone()))
        };
        let mut sizes = vec![0usize; graph.values.len()];
        for &i in &order {
            sizes[i] = bytes_of(i)?;
        }
        order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]).then(a.cmp(&b)));
        let mut slots: Vec<Option<Slot>> = vec![None; graph.values.len()];
        let mut placed: Vec<usize> = Vec::new();
        let mut arena_bytes = 0;
        for &i in &order {
            if first[i] == usize::MAX {
                // Declared but never produced nor consumed: an unused input still gets room.
                first[i] = 0;
            }
            let busy: Vec<(usize, usize)> = placed
                .iter()
                .filter(|&&j| first[j] <= last[i] && first[i] <= last[j])
                .filter_map(|&j| slots[j].map(|s| (s.offset, s.offset + s.bytes)))
                .collect();
            let offset = first_fit(busy, sizes[i]);
            slots[i] = Some(Slot {
                offset,
                bytes: sizes[i],
            });
            arena_bytes = arena_bytes.max(offset + sizes[i]);
            placed.push(i);
        }

        // Scratch is placed after the values so the CPU layout is the same with or
        // without it: each node's scratch goes into a gap among the values live at its
        // step (or past them), largest first.
        let mut scratch: Vec<Option<Slot>> = vec![None; graph.nodes.len()];
        let mut wants: Vec<(usize, usize, usize)> = Vec::new();
        for (step, &n) in schedule.iter().enumerate() {
            let node = &graph.nodes[n];
            let metas: Vec<&ops::TensorMeta> = node
                .inputs
                .iter()
                .map(|i| &graph.values[i.0].meta)
                .collect();
            let bytes = node.op.cuda_scratch_bytes(&metas);
            if bytes > 0 {
                wants.push((align(bytes), step, n));
            }
        }
        wants.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut device_arena_bytes = arena_bytes;
        for &(bytes, step, n) in &wants {
            let busy: Vec<(usize, usize)> = placed
                .iter()
                .filter(|&&j| first[j] <= step && step <= last[j])
                .filter_map(|&j| slots[j].map(|s| (s.offset, s.offset + s.bytes)))
                .collect();
            let offset = first_fit(busy, bytes);
            scratch[n] = Some(Slot { offset, bytes });
            device_arena_bytes = device_arena_bytes.max(offset + bytes);
        }
        Ok(Plan {
            id: NEXT_PLAN_ID.fetch_add(1, Ordering::Relaxed),
            shape,
            graph,
            schedule,
            slots,
            arena_bytes,
            scratch,
            device_arena_bytes,
            lowering: None,
        })
    }

    /// The arena slot of a value, following aliases to the storage they share.
    pub fn slot(&self, v: ValueId) -> Option<Slot> {
        self.slots[v.0]
    }

    /// The value whose storage `v` uses (itself unless it aliases an input).
    pub fn storage_of(&self, mut v: ValueId) -> ValueId {
        while let Some(src) = self.graph.values[v.0].alias_of {
            v = src;
        }
        v
    }

    /// A readable listing: one line per op with shapes, dtypes and arena offsets.
    pub fn render(&self) -> String {
        let g = &self.graph;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "plan {:?} logits={:?} pool={}x{}: {} ops, arena {} bytes",
            self.shape.bucket,
            self.shape.logits,
            self.shape.pool.blocks,
            self.shape.pool.block_size,
            self.schedule.len(),
            self.arena_bytes
        );
        match &self.lowering {
            Some((Target::Cpu, _)) => {
                let _ = writeln!(s, "lowered for cpu: as declared");
            }
            Some((target, opts)) => {
                let _ = writeln!(s, "lowered for {target}: {opts}");
            }
            None => {}
        }
        let weights: Vec<_> = g.of_kind(ValueKind::Weight).collect();
        let weight_bytes: usize = weights.iter().filter_map(|(_, v)| v.meta.bytes()).sum();
        let _ = writeln!(
            s,
            "weights: {} tensors, {} bytes",
            weights.len(),
            weight_bytes
        );
        for (_, v) in g
            .of_kind(ValueKind::State)
            .filter(|(_, v)| v.alias_of.is_none())
        {
            let _ = writeln!(s, "state {} {}", v.name, v.meta);
        }
        let place = |id: ValueId| -> String {
            let v = g.value(id);
            match v.kind {
                ValueKind::Weight => format!("{} {}", v.name, v.meta),
                ValueKind::State => format!("{} {} (state)", v.name, v.meta),
                _ => {
                    let st = self.storage_of(id);
                    match (st != id, self.slots[st.0]) {
                        (false, Some(sl)) => format!("{} {} @{}", v.name, v.meta, sl.offset),
                        (true, _) => format!("{} {} (= {})", v.name, v.meta, g.value(st).name),
                        (false, None) => format!("{} {}", v.name, v.meta),
                    }
                }
            }
        };
        for (_, v) in g.of_kind(ValueKind::Input) {
            let id = g.find(&v.name).unwrap_or(ValueId(0));
            let _ = writeln!(s, "input {}", place(id));
        }
        for (step, &n) in self.schedule.iter().enumerate() {
            let node = &g.nodes[n];
            let ins: Vec<String> = node.inputs.iter().map(|&i| place(i)).collect();
            let outs: Vec<String> = node.outputs.iter().map(|&o| place(o)).collect();
            let _ = writeln!(
                s,
                "{step:4} {}: {}\n       in:  {}\n       out: {}",
                node.name,
                node.op.describe(),
                ins.join(", "),
                outs.join(", ")
            );
        }
        for (name, v) in &g.outputs {
            let _ = writeln!(s, "output {name} = {}", g.value(*v).name);
        }
        s
    }
}

impl std::fmt::Display for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.render())
    }
}
