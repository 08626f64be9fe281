//! A llama-bench-shaped table for one checkpoint: prefill (`pp<P>`) and decode
//! (`tg<N> @ d<D>`) rates as mean ± sd over repetitions, the first decode step
//! apart from the steady rate, an eager-vs-graph A/B interleaved in one process
//! (A, B, A, B, ...), and the host time spent enqueueing a step against the
//! stream time between events around it.
//!
//! Token ids are synthetic (no tokenizer). A depth D is reached by prefilling
//! min(D, 512) synthetic tokens for real (untimed) and then tiling those cache rows
//! up to D positions, so the attention reads D real-looking rows without paying a
//! D-token prefill; the decode then runs at positions D, D+1, ...

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use engine::scheduler::{Scheduler, SchedulerConfig, SeqEvent};
use engine::{CacheSnapshot, Device, Engine, EngineConfig, GenerateRequest};

#[derive(Parser, Debug)]
#[command(about = "Prefill/decode rates of a checkpoint, llama-bench style")]
struct Args {
    /// A .gguf file or a release directory holding one. Default: the embedded default model (tools/default-model).
    #[arg(long)]
    model: Option<PathBuf>,
    #[command(flatten)]
    lowering: tools::LoweringArgs,
    /// The release directory, when it is not beside the .gguf.
    #[arg(long)]
    tokenizer_path: Option<PathBuf>,
    /// `cpu`, `cuda[:N]`, or `auto`.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Prefill lengths (each a `pp<P>` test from an empty cache).
    #[arg(
        short = 'p',
        long = "n-prompt",
        value_delimiter = ',',
        default_value = "512"
    )]
    prompt: Vec<usize>,
    /// Decode lengths (each a `tg<N>` test at every depth).
    #[arg(
        short = 'n',
        long = "n-gen",
        value_delimiter = ',',
        default_value = "128"
    )]
    gen_len: Vec<usize>,
    /// Cache depths the decode tests start from.
    #[arg(
        short = 'd',
        long = "depth",
        value_delimiter = ',',
        default_value = "0,4096,32768"
    )]
    depth: Vec<usize>,
    /// Repetitions of each test (and of each arm of the A/B).
    #[arg(short = 'r', long = "repetitions", default_value_t = 3)]
    reps: usize,
    /// Prefill chunk size in tokens (0: the engine's default for the device, 4096 on a GPU,
    /// 256 on the CPU).
    #[arg(long, default_value_t = 0)]
    prefill_chunk: usize,
    /// Skip the eager arm of the decode A/B (graph replay only).
    #[arg(long)]
    no_ab: bool,
    /// Decode steps timed with events per arm for the host-vs-device columns.
    #[arg(long, default_value_t = 32)]
    timing_steps: usize,
    /// At each depth, profile one decode step node by node (GPU only), and the last chunk of
    /// each prefill test, and print where their device time goes, grouped by the node's name
    /// without its layer prefix; with `-b`, one decode step of each B; with `--join`, the
    /// mixed step halfway through the joining prompt's admission.
    #[arg(long)]
    profile: bool,
    /// Batched mode, in the shape of llama-batched-bench: for each count B, B sequences of
    /// `-p` prompt tokens each generate `-n` tokens through the scheduler (continuous
    /// batching); prints prefill t/s, aggregate decode t/s and per-sequence decode t/s.
    /// Replaces the single-sequence tests.
    #[arg(short = 'b', long = "batch", value_delimiter = ',')]
    batch: Vec<usize>,
    /// With `-b`: once the B sequences decode, one prompt of N synthetic tokens joins them, and
    /// the running sequences' inter-token latency (a step's wall time) is reported before and
    /// while it is admitted (mixed steps: decode rows plus a prefill chunk).
    #[arg(long, value_name = "N", requires = "batch")]
    join: Option<usize>,
    /// With `--join`: tokens one step may carry, decode rows plus the prefill chunk (serve's
    /// `--max-num-batched-tokens`).
    #[arg(long, value_name = "T", default_value_t = 4096)]
    max_num_batched_tokens: usize,
    /// With `--join`: query-key pairs the prompt's chunk may attend in a step beside decode
    /// rows (serve's `--mixed-attention-budget`; 0: no bound).
    #[arg(long, value_name = "PAIRS", default_value_t = 0)]
    mixed_attention_budget: usize,
    /// With `--join`: tokens the prompt's chunk may carry in a step beside decode rows
    /// (serve's `--mixed-chunk-tokens`; 0: no bound beyond the step's tokens).
    #[arg(long, value_name = "T", default_value_t = engine::scheduler::DEFAULT_MIXED_CHUNK_TOKENS)]
    mixed_chunk_tokens: usize,
    /// Structured outputs' host cost instead of the model tests: the JSON schema in FILE is
    /// compiled against the checkpoint's vocabulary and the token mask of every step of `-r`
    /// answers is timed (each token drawn at random among the allowed ones); prints the median
    /// and p90 µs per token.
    #[arg(long, value_name = "FILE")]
    mask_schema: Option<PathBuf>,
}

impl Args {
    fn join_budget(&self) -> JoinBudget {
        JoinBudget {
            tokens: self.max_num_batched_tokens,
            attention: self.mixed_attention_budget,
            mixed_tokens: self.mixed_chunk_tokens,
        }
    }
}

/// `blk.12.attn.q_a` → `attn.q_a`, and in a node fused across layers every part loses its
/// layer (`blk.3.hc_ffn_post+blk.4.hc_attn_pre+attn_norm` → `hc_ffn_post+hc_attn_pre+attn_norm`);
/// names outside the layers stay as they are.
fn without_layer(name: &str) -> String {
    let part = |p: &'_ str| -> String {
        match p.strip_prefix("blk.").and_then(|rest| rest.split_once('.')) {
            Some((layer, tail)) if layer.bytes().all(|b| b.is_ascii_digit()) => tail.to_string(),
            _ => p.to_string(),
        }
    };
    name.split('+').map(part).collect::<Vec<_>>().join("+")
}

/// The H200's device-to-device copy rate (bench/RESULTS.md 2026-12-02 (b)): what a node that
/// only streams its bytes could reach.
const COPY_CEILING_GBS: f64 = 4270.0;

/// Prints a profiled step grouped by node name without its layer: launches, µs, share, and the
/// bytes the nodes must move with the rate that makes and its share of the copy ceiling.
fn print_profile(label: &str, nodes: &[engine::NodeTime]) {
    let total: f64 = nodes.iter().map(|n| n.ms).sum::<f64>() * 1e3;
    // (name, op, launches, µs, bytes)
    let mut groups: Vec<(String, String, usize, f64, u64)> = Vec::new();
    for n in nodes {
        let key = without_layer(&n.node);
        match groups.iter_mut().find(|g| g.0 == key) {
            Some(g) => {
                g.2 += 1;
                g.3 += n.ms * 1e3;
                g.4 += n.bytes;
            }
            None => groups.push((key.to_string(), n.op.clone(), 1, n.ms * 1e3, n.bytes)),
        }
    }
    groups.sort_by(|a, b| b.3.total_cmp(&a.3));
    println!();
    println!(
        "profile {label}: {} nodes, {total:.0} µs of device time back to back",
        nodes.len()
    );
    println!(
        "(MB: weights, of the routed experts those the step touched, and activations in and \
         out, and the cache rows an attention reads, each sequence's once; the cache writes \
         not counted; the route plan's time carries a copy of its table; \
         ceiling {COPY_CEILING_GBS:.0} GB/s)"
    );
    println!("| node | op | count | µs/step | µs each | share | MB/step | GB/s | of ceiling |");
    println!("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (name, op, count, us, bytes) in &groups {
        let gbs = *bytes as f64 / us.max(1e-9) / 1e3;
        println!(
            "| {name} | {op} | {count} | {us:.1} | {:.2} | {:.1}% | {:.2} | {gbs:.0} | {:.0}% |",
            us / *count as f64,
            100.0 * us / total.max(1e-9),
            *bytes as f64 / 1e6,
            100.0 * gbs / COPY_CEILING_GBS
        );
    }
}

/// Mean and sample standard deviation.
fn mean_sd(xs: &[f64]) -> (f64, f64) {
    let n = xs.len().max(1) as f64;
    let m = xs.iter().sum::<f64>() / n;
    let var = if xs.len() > 1 {
        xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    (m, var.sqrt())
}

/// Deterministic synthetic ids in `1..vocab`.
fn synthetic_ids(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (1 + s % (vocab.max(2) as u64 - 1)) as u32
        })
        .collect()
}

/// One decode run: per-step seconds, and the host/device split when timing is on.
struct DecodeRun {
    last_id: u32,
    steps: Vec<f64>,
    host: Vec<f64>,
    device: Vec<f64>,
}

/// Decodes `n` greedy steps from the current cache, feeding each chosen id back.
fn decode(engine: &mut Engine, first: u32, n: usize) -> Result<DecodeRun> {
    let mut run = DecodeRun {
        last_id: first,
        steps: Vec::with_capacity(n),
        host: Vec::new(),
        device: Vec::new(),
    };
    let mut id = first;
    for _ in 0..n {
        let t = Instant::now();
        id = engine.forward_argmax(&[id])?;
        run.steps.push(t.elapsed().as_secs_f64());
        if let Some(tm) = engine.last_step_timing() {
            run.host.push(tm.host_submit_s);
            run.device.push(tm.device_s);
        }
    }
    run.last_id = id;
    Ok(run)
}

/// Puts the engine at depth `d`: a real prefill of up to 512 tokens, tiled to `d` rows.
/// Returns the snapshot to restore before each repetition.
fn fill_depth(engine: &mut Engine, d: usize, vocab: usize) -> Result<CacheSnapshot> {
    engine.reset();
    if d == 0 {
        return Ok(CacheSnapshot::default());
    }
    let real = d.min(512);
    engine.forward_argmax(&synthetic_ids(real, vocab, 7))?;
    let snap = engine.try_snapshot(real)?;
    let layers = snap
        .layers
        .into_iter()
        .map(|(name, rows)| {
            let row = rows.len() / real;
            let mut tiled = Vec::with_capacity(row * d);
            while tiled.len() < row * d {
                let take = (row * d - tiled.len()).min(rows.len());
                tiled.extend_from_slice(&rows[..take]);
            }
            (name, tiled)
        })
        .collect();
    let snap = CacheSnapshot { len: d, layers };
    engine.restore(&snap, d)?;
    Ok(snap)
}

struct Row {
    test: String,
    arm: &'static str,
    rate: (f64, f64),
    first_ms: Option<f64>,
    host_us: Option<f64>,
    device_us: Option<f64>,
}

fn main() -> Result<()> {
    let a = Args::parse();
    if a.reps == 0 {
        bail!("-r must be at least 1");
    }
    if a.gen_len.contains(&0) || a.prompt.contains(&0) {
        bail!("-p and -n lengths must be at least 1");
    }
    let device: Device = a
        .device
        .parse()
        .map_err(|e: String| anyhow::anyhow!("--device: {e}"))?;
    let (gguf, release_dir) = match &a.model {
        Some(m) => models::resolve(Some(m), a.tokenizer_path.as_deref())?,
        None => {
            let dir = tools::default_checkpoint()?;
            (dir.join("model.gguf"), Some(dir))
        }
    };
    let loaded = models::load(&gguf, release_dir.as_deref(), true)?;
    if let Some(schema) = &a.mask_schema {
        let tok = loaded
            .tokenizer
            .as_ref()
            .context("--mask-schema needs the checkpoint's tokenizer")?;
        return mask_cost(tok, schema, a.reps);
    }
    let model = loaded.model.clone();
    let vocab = model.decl.n_vocab();
    if !a.batch.is_empty() {
        return batched(&a, model, device);
    }
    let max_d = a.depth.iter().copied().max().unwrap_or(0);
    let max_n = a.gen_len.iter().copied().max().unwrap_or(1);
    let max_p = a.prompt.iter().copied().max().unwrap_or(1);
    let config = EngineConfig {
        max_model_len: (max_d + max_n + 1).max(max_p),
        prefill_chunk: a.prefill_chunk,
        device,
        cuda_graphs: true,
        lowering: a.lowering.options()?,
        ..EngineConfig::default()
    };
    let t_load = Instant::now();
    let mut engine = Engine::new(model.clone(), config.clone())
        .with_context(|| format!("starting the engine on {device}"))?;
    tools::upload_with_progress(&mut engine, "bench")?;
    let h = &model.hparams;
    let model_desc = format!(
        "{} {}L {:.2} GiB",
        model.decl.arch(),
        h.n_layer,
        model.total_weight_bytes() as f64 / (1u64 << 30) as f64
    );
    eprintln!(
        "{model_desc} on {} ({}), engine ready in {:.1} s, max-model-len {}, prefill chunk {}",
        device,
        engine.device_name(),
        t_load.elapsed().as_secs_f64(),
        config.max_model_len,
        engine.config().prefill_chunk
    );
    if let Some(b) = engine.device_budget() {
        eprintln!(
            "device memory: {:.0} MiB weights + {:.0} MiB cache ({} rows) + {:.0} MiB step arena",
            b.weights as f64 / 1048576.0,
            b.cache as f64 / 1048576.0,
            b.rows,
            b.arena as f64 / 1048576.0
        );
    }
    let gpu = engine.on_gpu();
    let mut rows: Vec<Row> = Vec::new();
    let mut profiles: Vec<(String, Vec<engine::NodeTime>)> = Vec::new();

    for &p in &a.prompt {
        let ids = synthetic_ids(p, vocab, p as u64);
        // One warm-up: kernels compile, plans are built, pages are touched.
        engine.reset();
        engine.forward_argmax(&ids)?;
        let mut rates = Vec::new();
        for _ in 0..a.reps {
            engine.reset();
            let t = Instant::now();
            engine.forward_argmax(&ids)?;
            rates.push(p as f64 / t.elapsed().as_secs_f64());
        }
        let row = Row {
            test: format!("pp{p}"),
            arm: if gpu { "eager" } else { "cpu" },
            rate: mean_sd(&rates),
            first_ms: None,
            host_us: None,
            device_us: None,
        };
        eprintln!("  {} {:.1} t/s", row.test, row.rate.0);
        rows.push(row);
        if gpu && a.profile {
            // The last chunk: its attention reads the most cache rows.
            let last = p - (p - 1) % engine.config().prefill_chunk.max(1) - 1;
            engine.reset();
            if last > 0 {
                engine.forward_argmax(&ids[..last])?;
            }
            engine.profile_next_step();
            engine.forward_argmax(&ids[last..])?;
            profiles.push((
                format!("pp{p}, chunk at {last}..{p}"),
                engine.take_profile(),
            ));
        }
    }

    let arms: Vec<(&'static str, bool)> = match (gpu, a.no_ab) {
        (false, _) => vec![("cpu", false)],
        (true, true) => vec![("graph", true)],
        // A = eager, B = graph, interleaved so drift lands on both.
        (true, false) => vec![("eager", false), ("graph", true)],
    };
    for &d in &a.depth {
        let snap = fill_depth(&mut engine, d, vocab)?;
        let first_id = synthetic_ids(1, vocab, 99 + d as u64)[0];
        for &n in &a.gen_len {
            let restart = |engine: &mut Engine| -> Result<u32> {
                if d == 0 {
                    engine.reset();
                    // The context's first token, so decode starts at position 1.
                    Ok(engine.forward_argmax(&[first_id])?)
                } else {
                    engine.truncate(d);
                    if engine.cached_len() < d {
                        engine.restore(&snap, d)?;
                    }
                    Ok(first_id)
                }
            };
            let mut steady: Vec<Vec<f64>> = vec![Vec::new(); arms.len()];
            let mut firsts: Vec<Vec<f64>> = vec![Vec::new(); arms.len()];
            // Warm-up per arm: plans, kernels and the bucket's capture.
            for &(_, graphs) in &arms {
                engine.set_cuda_graphs(graphs);
                let id = restart(&mut engine)?;
                decode(&mut engine, id, n.min(4))?;
            }
            for _ in 0..a.reps {
                for (k, &(_, graphs)) in arms.iter().enumerate() {
                    engine.set_cuda_graphs(graphs);
                    let id = restart(&mut engine)?;
                    let run = decode(&mut engine, id, n)?;
                    firsts[k].push(run.steps[0]);
                    let rest = &run.steps[1..];
                    if !rest.is_empty() {
                        steady[k].push(rest.len() as f64 / rest.iter().sum::<f64>());
                    }
                }
            }
            for (k, &(arm, graphs)) in arms.iter().enumerate() {
                let (mut host_us, mut device_us) = (None, None);
                if gpu && a.timing_steps > 0 {
                    engine.set_cuda_graphs(graphs);
                    engine.set_step_timing(true)?;
                    let id = restart(&mut engine)?;
                    let run = decode(&mut engine, id, a.timing_steps.min(n))?;
                    engine.set_step_timing(false)?;
                    // The first step may capture; the split is about steady steps.
                    let skip = usize::from(run.host.len() > 1);
                    host_us = Some(mean_sd(&run.host[skip..]).0 * 1e6);
                    device_us = Some(mean_sd(&run.device[skip..]).0 * 1e6);
                }
                let test = if d == 0 {
                    format!("tg{n}")
                } else {
                    format!("tg{n} @ d{d}")
                };
                let row = Row {
                    test,
                    arm,
                    rate: mean_sd(&steady[k]),
                    first_ms: Some(mean_sd(&firsts[k]).0 * 1e3),
                    host_us,
                    device_us,
                };
                eprintln!("  {} [{}] {:.1} t/s", row.test, row.arm, row.rate.0);
                rows.push(row);
            }
            if gpu && a.profile {
                engine.set_cuda_graphs(true);
                let id = restart(&mut engine)?;
                let id = decode(&mut engine, id, 2)?.last_id;
                engine.profile_next_step();
                engine.forward_argmax(&[id])?;
                profiles.push((format!("tg{n} @ d{d}"), engine.take_profile()));
            }
        }
    }
    engine.set_cuda_graphs(true);
    for (label, nodes) in &profiles {
        print_profile(label, nodes);
    }

    let device_name = engine.device_name();
    println!(
        "| model | device | test | arm | t/s | first step ms | host submit µs/step | device µs/step |"
    );
    println!("| --- | --- | --- | --- | ---: | ---: | ---: | ---: |");
    let opt = |v: Option<f64>, prec: usize| match v {
        Some(x) => format!("{x:.prec$}"),
        None => "-".to_string(),
    };
    for r in &rows {
        println!(
            "| {model_desc} | {device_name} | {} | {} | {:.2} ± {:.2} | {} | {} | {} |",
            r.test,
            r.arm,
            r.rate.0,
            r.rate.1,
            opt(r.first_ms, 2),
            opt(r.host_us, 1),
            opt(r.device_us, 1)
        );
    }
    for pair in rows.windows(2) {
        if let [e, g] = pair
            && e.test == g.test
            && e.arm == "eager"
            && g.arm == "graph"
            && e.rate.0 > 0.0
        {
            println!(
                "{}: graph replay {:.2}x the eager rate",
                g.test,
                g.rate.0 / e.rate.0
            );
        }
    }
    println!(
        "(t/s: decode steps after the first, mean ± sd over {} reps; depth by tiling a real 512-token prefill's cache rows)",
        a.reps
    );
    Ok(())
}

/// One batched run's figures.
struct BatchRun {
    /// Seconds until every sequence had its first token.
    prefill_s: f64,
    /// Tokens generated while every sequence was decoding, and the seconds that took.
    steady_tokens: usize,
    steady_s: f64,
    steady_steps: usize,
    total_tokens: usize,
    total_s: f64,
}

/// `b` sequences of `p` distinct synthetic prompt tokens, `n` greedy tokens each.
#[allow(clippy::too_many_arguments)]
fn batch_run(
    engine: Engine,
    b: usize,
    p: usize,
    n: usize,
    vocab: usize,
    seed: u64,
    mut profile: Option<&mut Vec<engine::NodeTime>>,
) -> Result<(Engine, BatchRun)> {
    let mut s = Scheduler::new(
        engine,
        SchedulerConfig {
            max_num_seqs: b,
            max_num_batched_tokens: usize::MAX / 2,
            prefix_caching: false,
            sample_on_host: false,
            // The prompts' prefill before the decode window stays in whole chunks, as before
            // the mixed cap existed, so that its tok/s compares across versions.
            mixed_chunk_tokens: 0,
            ..SchedulerConfig::default()
        },
        None,
    );
    for k in 0..b {
        s.add(GenerateRequest::greedy(
            synthetic_ids(p, vocab, seed * 1000 + k as u64),
            n,
        ));
    }
    let t0 = Instant::now();
    let mut started = std::collections::HashSet::new();
    let (mut prefill_s, mut steady_from) = (None, None);
    let (mut steady_tokens, mut steady_s, mut total_tokens, mut finished) = (0, 0.0, 0, 0);
    let mut steady_steps = 0usize;
    while s.has_work() {
        // One decode step of the full batch, node by node (GPU only).
        let profiling = steady_from.is_some()
            && finished == 0
            && profile.as_ref().is_some_and(|p| p.is_empty());
        if profiling {
            s.engine_mut().profile_next_step();
        }
        let before = t0.elapsed().as_secs_f64();
        let events = s.step();
        if profiling && let Some(p) = profile.as_mut() {
            **p = s.engine_mut().take_profile();
        }
        let after = t0.elapsed().as_secs_f64();
        let mut tokens = 0;
        for ev in events {
            match ev {
                SeqEvent::Token { seq, .. } => {
                    tokens += 1;
                    started.insert(seq);
                }
                SeqEvent::Finished { .. } => finished += 1,
                SeqEvent::Failed { error, .. } => bail!("a sequence failed: {error}"),
            }
        }
        total_tokens += tokens;
        // The steady window: from the step after the last first token to the first finish.
        if steady_from.is_some() && finished == 0 && !profiling {
            steady_tokens += tokens;
            steady_s += after - before;
            steady_steps += 1;
        }
        if prefill_s.is_none() && started.len() == b {
            prefill_s = Some(after);
            steady_from = Some(after);
        }
    }
    let total_s = t0.elapsed().as_secs_f64();
    Ok((
        s.into_engine(),
        BatchRun {
            prefill_s: prefill_s.unwrap_or(total_s),
            steady_tokens,
            steady_s,
            steady_steps,
            total_tokens,
            total_s,
        },
    ))
}

/// Inter-token latencies of B running sequences before and while a long prompt joins.
struct JoinRun {
    /// Step wall times (ms) of the steady steps before the prompt was added.
    before_ms: Vec<f64>,
    /// Step wall times (ms) from the prompt's arrival to its first token.
    during_ms: Vec<f64>,
    /// The joining prompt's time to its first token (ms).
    ttft_ms: f64,
}

/// Steady steps timed before the prompt joins.
const JOIN_BEFORE_STEPS: usize = 16;

/// Decode tokens each running sequence needs so it is still decoding when the prompt of
/// `join` tokens has its first token: the steps before, the prompt's chunks with room to spare.
fn join_gen_len(n: usize, b: usize, join: usize, budget: JoinBudget) -> usize {
    n.max(JOIN_BEFORE_STEPS + 2 * budget.chunks(b, join) + 8)
}

/// A join's step limits: `--max-num-batched-tokens`, `--mixed-attention-budget` and
/// `--mixed-chunk-tokens`.
#[derive(Clone, Copy, Debug)]
struct JoinBudget {
    tokens: usize,
    attention: usize,
    mixed_tokens: usize,
}

impl JoinBudget {
    /// Chunks the scheduler cuts a `join`-token prompt into beside `b` decode rows (its
    /// `mixed_chunk`; the token budget less the decode rows, but at least a block of the
    /// engine's default size, and the mixed cap, as the scheduler allows).
    fn chunks(self, b: usize, join: usize) -> usize {
        let (mut done, mut chunks) = (0, 0);
        while done < join {
            done += engine::scheduler::mixed_chunk(
                join - done,
                done,
                engine::scheduler::chunk_cap(
                    usize::MAX,
                    self.tokens.saturating_sub(b).max(graph::DEFAULT_BLOCK_SIZE),
                    true,
                    self.mixed_tokens,
                ),
                true,
                self.attention,
                engine::scheduler::MIXED_CHUNK_QUANTUM,
            );
            chunks += 1;
        }
        chunks
    }
}

/// `b` sequences of `p` synthetic tokens decode; after [`JOIN_BEFORE_STEPS`] steady steps a
/// prompt of `join` tokens arrives (scheduler budget `budget` tokens a step); runs to the end.
/// With `profile`, the mixed step halfway through the admission runs profiled (eagerly, an
/// event between nodes) into it, and its time stays out of the latencies.
#[allow(clippy::too_many_arguments)]
fn join_run(
    engine: Engine,
    b: usize,
    p: usize,
    n: usize,
    join: usize,
    budget: JoinBudget,
    vocab: usize,
    mut profile: Option<&mut Vec<engine::NodeTime>>,
) -> Result<(Engine, JoinRun)> {
    let mut s = Scheduler::new(
        engine,
        SchedulerConfig {
            max_num_seqs: b + 1,
            max_num_batched_tokens: budget.tokens,
            prefix_caching: false,
            sample_on_host: false,
            mixed_attention_budget: budget.attention,
            mixed_chunk_tokens: budget.mixed_tokens,
        },
        None,
    );
    for k in 0..b {
        s.add(GenerateRequest::greedy(
            synthetic_ids(p, vocab, 7000 + k as u64),
            n,
        ));
    }
    let mut started = std::collections::HashSet::new();
    let (mut before_ms, mut during_ms) = (Vec::new(), Vec::new());
    let mut joined: Option<(u64, Instant)> = None;
    let mut ttft_ms = None;
    let halfway = budget.chunks(b, join) / 2;
    while s.has_work() {
        if joined.is_none() && before_ms.len() == JOIN_BEFORE_STEPS {
            let id = s.add(GenerateRequest::greedy(synthetic_ids(join, vocab, 7999), 2));
            joined = Some((id, Instant::now()));
        }
        let profiling = joined.is_some()
            && ttft_ms.is_none()
            && during_ms.len() == halfway
            && profile.as_ref().is_some_and(|p| p.is_empty());
        if profiling {
            s.engine_mut().profile_next_step();
        }
        let t = Instant::now();
        let events = s.step();
        let ms = t.elapsed().as_secs_f64() * 1e3;
        if profiling && let Some(p) = profile.as_mut() {
            **p = s.engine_mut().take_profile();
        }
        let mut join_token = false;
        for ev in events {
            match ev {
                SeqEvent::Token { seq, .. } => {
                    if joined.is_some_and(|(id, _)| id == seq) {
                        join_token = true;
                    } else {
                        started.insert(seq);
                    }
                }
                SeqEvent::Finished { .. } => {}
                SeqEvent::Failed { error, .. } => bail!("a sequence failed: {error}"),
            }
        }
        match joined {
            None if started.len() == b => before_ms.push(ms),
            Some((_, at)) if ttft_ms.is_none() => {
                // The profiled step ran eagerly with events: not a latency of the server's.
                if !profiling {
                    during_ms.push(ms);
                }
                if join_token {
                    ttft_ms = Some(at.elapsed().as_secs_f64() * 1e3);
                }
            }
            _ => {}
        }
    }
    let Some(ttft_ms) = ttft_ms else {
        bail!("the joining prompt of {join} tokens never had its first token");
    };
    Ok((
        s.into_engine(),
        JoinRun {
            before_ms,
            during_ms,
            ttft_ms,
        },
    ))
}

/// The q-quantile (0..=1) of `xs` by nearest rank.
fn quantile(xs: &[f64], q: f64) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

fn batched(a: &Args, model: std::sync::Arc<engine::Model>, device: Device) -> Result<()> {
    if a.batch.contains(&0) {
        bail!("-b counts must be at least 1");
    }
    let vocab = model.decl.n_vocab();
    let p = a.prompt.iter().copied().max().unwrap_or(512);
    let n = a.gen_len.iter().copied().max().unwrap_or(128).max(2);
    let max_b = a.batch.iter().copied().max().unwrap_or(1);
    if a.max_num_batched_tokens == 0 {
        bail!("--max-num-batched-tokens must be at least 1");
    }
    if a.join == Some(0) {
        bail!("--join must be at least 1 token");
    }
    let join_n = a.join.map(|j| join_gen_len(n, max_b, j, a.join_budget()));
    let config = EngineConfig {
        max_model_len: (p + join_n.unwrap_or(n) + 1).max(a.join.map_or(0, |j| j + 3)),
        prefill_chunk: a.prefill_chunk,
        device,
        cuda_graphs: true,
        lowering: a.lowering.options()?,
        max_num_seqs: max_b + usize::from(a.join.is_some()),
        ..EngineConfig::default()
    };
    let t_load = Instant::now();
    let mut engine = Engine::new(model.clone(), config.clone())
        .with_context(|| format!("starting the engine on {device}"))?;
    tools::upload_with_progress(&mut engine, "bench")?;
    let pool = engine.pool();
    eprintln!(
        "{} on {} ({}), engine ready in {:.1} s; KV cache: {} blocks = {} positions",
        model.decl.arch(),
        device,
        engine.device_name(),
        t_load.elapsed().as_secs_f64(),
        pool.blocks,
        pool.rows()
    );
    if let Some(join) = a.join {
        return join_table(a, engine, join, p, n, vocab);
    }
    let mut rows = Vec::new();
    for &b in &a.batch {
        // One warm-up: kernels compile, plans are built and the batch buckets captured.
        let (e, _) = batch_run(engine, b, p, n.min(8), vocab, 1, None)?;
        engine = e;
        let mut pre = Vec::new();
        let mut agg = Vec::new();
        let mut tot = Vec::new();
        let mut step_ms = Vec::new();
        for r in 0..a.reps {
            let (e, run) = batch_run(engine, b, p, n, vocab, 2 + r as u64, None)?;
            engine = e;
            if run.steady_steps > 0 {
                step_ms.push(run.steady_s * 1e3 / run.steady_steps as f64);
            }
            pre.push((b * p) as f64 / run.prefill_s);
            if run.steady_s > 0.0 {
                agg.push(run.steady_tokens as f64 / run.steady_s);
            }
            tot.push(run.total_tokens as f64 / run.total_s);
        }
        let (pm, _) = mean_sd(&pre);
        let (am, asd) = mean_sd(&agg);
        let (tm, _) = mean_sd(&tot);
        let (sm, _) = mean_sd(&step_ms);
        if agg.is_empty() {
            // No window to measure: printing zeros would read as a measurement.
            eprintln!(
                "  B={b}: no step had all {b} sequences decoding (the first finished before the \
                 last had its first token): raise -n (--n-gen)"
            );
            rows.push(format!(
                "| {b} | {p} | {n} | {pm:.1} | - | - | - | {tm:.1} |"
            ));
            continue;
        }
        eprintln!("  B={b}: decode {am:.1} t/s aggregate, {sm:.2} ms a step");
        rows.push(format!(
            "| {b} | {p} | {n} | {pm:.1} | {am:.1} ± {asd:.1} | {:.1} | {sm:.2} | {tm:.1} |",
            am / b as f64
        ));
        if a.profile && engine.on_gpu() {
            let mut nodes = Vec::new();
            let (e, _) = batch_run(engine, b, p, n, vocab, 99, Some(&mut nodes))?;
            engine = e;
            print_profile(
                &format!("decode step of B={b} after {p} prompt tokens"),
                &nodes,
            );
        }
    }
    println!(
        "| B | prompt | gen | prefill t/s | aggregate decode t/s | per-sequence decode t/s | ms/step | total t/s |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in &rows {
        println!("{r}");
    }
    println!(
        "(decode: tokens of the steps where all B sequences decode, from the last first token to the first finish; mean ± sd over {} reps; prefill: B·prompt over the time until every sequence had its first token, decode steps of early sequences included)",
        a.reps
    );
    Ok(())
}

/// `--join`: for each B, the running sequences' inter-token latency before and while a prompt
/// of `join` tokens is admitted.
fn join_table(
    a: &Args,
    mut engine: Engine,
    join: usize,
    p: usize,
    n: usize,
    vocab: usize,
) -> Result<()> {
    let budget = a.join_budget();
    let mut rows = Vec::new();
    for &b in &a.batch {
        let decode_len = join_gen_len(n, b, join, budget);
        // One warm-up run: kernels compile, the decode and mixed-step plans are built.
        let (e, _) = join_run(engine, b, p, decode_len, join, budget, vocab, None)?;
        let (e, run) = join_run(e, b, p, decode_len, join, budget, vocab, None)?;
        engine = e;
        if a.profile && engine.on_gpu() {
            let mut nodes = Vec::new();
            let (e, _) = join_run(
                engine,
                b,
                p,
                decode_len,
                join,
                budget,
                vocab,
                Some(&mut nodes),
            )?;
            engine = e;
            print_profile(
                &format!(
                    "mixed step of B={b} halfway through a {join}-token prompt's admission ({} tokens a step, attention budget {})",
                    budget.tokens, budget.attention
                ),
                &nodes,
            );
        }
        let (d, bf) = (&run.during_ms, &run.before_ms);
        eprintln!(
            "  B={b}: a {join}-token prompt joined in {} steps, {:.1} ms to its first token",
            d.len(),
            run.ttft_ms
        );
        rows.push(format!(
            "| {b} | {join} | {} | {} | {:.2} | {:.2} | {} | {:.2} | {:.2} | {:.2} | {:.1} |",
            budget.tokens,
            budget.attention,
            quantile(bf, 0.5),
            quantile(bf, 0.99),
            d.len(),
            quantile(d, 0.5),
            quantile(d, 0.99),
            d.iter().copied().fold(0.0, f64::max),
            run.ttft_ms
        ));
    }
    println!(
        "| B | joining prompt | tokens a step | attention budget | ITL p50 ms before | ITL p99 before | steps to admit | ITL p50 ms while admitted | ITL p99 while admitted | ITL max | join TTFT ms |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in &rows {
        println!("{r}");
    }
    println!(
        "(ITL: the wall time of a step that gave each running sequence a token; before: {JOIN_BEFORE_STEPS} steps of the B sequences alone; while admitted: from the prompt's arrival to its first token)"
    );
    Ok(())
}

/// The structured-output mask's cost per token (see `--mask-schema`).
fn mask_cost(
    tok: &loader::tokenizer::Tokenizer,
    path: &std::path::Path,
    answers: usize,
) -> Result<()> {
    use engine::sampling::Rng;
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let schema: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    let eos = tok
        .piece_to_id("<_end>")
        .or(tok.eos_id())
        .context("the vocabulary has no end-of-turn token")?;
    let t = Instant::now();
    let guidance = tools::guidance::Guidance::new(tok, eos, None, &[eos])?;
    let trie_ms = t.elapsed().as_secs_f64() * 1e3;
    let grammar = tools::guidance::json_schema_grammar(&schema, true);
    let mut rng = Rng::new(1);
    let (mut compile_us, mut step_us, mut lengths) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..answers {
        let t = Instant::now();
        let mut c = guidance
            .constraint(&grammar, false)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        compile_us.push(t.elapsed().as_secs_f64() * 1e6);
        let mut n = 0;
        loop {
            let t = Instant::now();
            let mask = c.next_mask().map_err(anyhow::Error::msg)?;
            step_us.push(t.elapsed().as_secs_f64() * 1e6);
            let mask = mask.context("a JSON schema's constraint always has a mask")?;
            let allowed: Vec<u32> = (0..tok.vocab_size() as u32)
                .filter(|&id| mask.allows(id))
                .collect();
            if allowed.is_empty() || allowed == [eos] || n >= 4096 {
                break;
            }
            let others: Vec<u32> = allowed.iter().copied().filter(|&id| id != eos).collect();
            let pick = others[(rng.next_u64() % others.len() as u64) as usize];
            c.commit(pick).map_err(anyhow::Error::msg)?;
            n += 1;
        }
        lengths.push(n as f64);
    }
    let q = |v: &mut Vec<f64>, p: f64| {
        v.sort_by(f64::total_cmp);
        v[((v.len() - 1) as f64 * p).round() as usize]
    };
    println!(
        "mask cost: {} over a vocabulary of {} ({} answers, {} masks; trie built once in {trie_ms:.0} ms)",
        path.display(),
        tok.vocab_size(),
        answers,
        step_us.len()
    );
    let mean = step_us.iter().sum::<f64>() / step_us.len().max(1) as f64;
    println!("| measure | median | p90 |");
    println!("| --- | ---: | ---: |");
    println!(
        "| mask µs/token (mean {mean:.1}, max {:.0}) | {:.1} | {:.1} |",
        q(&mut step_us, 1.0),
        q(&mut step_us, 0.5),
        q(&mut step_us, 0.9)
    );
    println!(
        "| compile µs/request | {:.0} | {:.0} |",
        q(&mut compile_us, 0.5),
        q(&mut compile_us, 0.9)
    );
    println!(
        "| tokens/answer | {:.0} | {:.0} |",
        q(&mut lengths, 0.5),
        q(&mut lengths, 0.9)
    );
    Ok(())
}
