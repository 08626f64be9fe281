//! What the tiny Xing4.0 model lowers to, per step shape and device (no GPU needed to plan):
//! the plan text names every node's op, parameters and kernel variant, so a change of fusion
//! or variant shows in review. And the CUDA lowering's graph, run by the CPU executor (every
//! fused op's reference is the chain it replaces), computes what the declaration computes.

mod support;

use std::sync::Arc;

use engine::{Model, build_plan};
use graph::{
    Bucket, CpuExecutor, HostState, LogitRows, LoweringOptions, Plan, StepShape, Target,
    lowered_launches,
};
use models::synth::Preset;

const HOPPER: Target = Target::Cuda {
    compute_capability: (9, 0),
};

fn tiny() -> Arc<Model> {
    support::synthetic(Preset::Tiny, 11, "lowering_snapshot")
}

/// The plan lines of a decode step's routed gate+up products (`batch` sequences), each checked
/// to end with `label`. The tiny model's down products take the generic kernel (an input width
/// of 32), so its gate+up products are the ones the expert thresholds move.
fn gate_up_labels_end_with(
    m: &Model,
    batch: usize,
    target: Target,
    o: &LoweringOptions,
    label: &str,
) {
    let shape = StepShape::single(Bucket::Decode { batch, kv: 128 }, LogitRows::Last);
    let plan = build_plan(m, shape, None, target, o).unwrap().to_string();
    let lines: Vec<&str> = plan
        .lines()
        .filter(|l| l.contains(": expert_swiglu "))
        .collect();
    assert!(!lines.is_empty());
    for l in lines {
        assert!(l.ends_with(label), "{l}");
    }
}

fn plan(model: &Model, bucket: Bucket, target: Target) -> Plan {
    let shape = StepShape::single(bucket, LogitRows::Last);
    build_plan(model, shape, None, target, &LoweringOptions::default()).unwrap()
}

const DECODE: Bucket = Bucket::Decode { batch: 1, kv: 64 };
/// Past every GEMV threshold, below the tiled router's and the rows pass's.
const SHORT_CHUNK: Bucket = Bucket::Prefill { chunk: 32, kv: 64 };
/// Past every threshold (the attention stays split-K: tiny's latent is too narrow for flash).
const LONG_CHUNK: Bucket = Bucket::Prefill {
    chunk: 512,
    kv: 512,
};

#[test]
fn the_cpu_runs_the_declaration_as_written() {
    let m = tiny();
    for (bucket, name) in [
        (DECODE, "cpu_decode"),
        (SHORT_CHUNK, "cpu_prefill_32"),
        (LONG_CHUNK, "cpu_prefill_512"),
    ] {
        let p = plan(&m, bucket, Target::Cpu);
        let text = p.to_string();
        // Spec-level ops only: no fused op appears in a CPU plan.
        for fused in [
            "hc_post_pre",
            "then linear",
            "linear_pair",
            "gate_up_swiglu",
            "into the cache",
        ] {
            assert!(!text.contains(fused), "{name} has `{fused}`:\n{text}");
        }
        insta::assert_snapshot!(name, text);
    }
}

#[test]
fn the_cuda_lowering_fuses_and_picks_a_kernel_for_every_step_shape() {
    let m = tiny();
    for (bucket, name) in [
        (DECODE, "cuda_decode"),
        (SHORT_CHUNK, "cuda_prefill_32"),
        (LONG_CHUNK, "cuda_prefill_512"),
    ] {
        let p = plan(&m, bucket, HOPPER);
        let text = p.to_string();
        assert!(text.contains("lowered for cuda sm_90"), "{text}");
        insta::assert_snapshot!(name, text);
    }
    let decode = plan(&m, DECODE, HOPPER).to_string();
    assert!(decode.contains("linear_pair [gemv, weights first]"));
    assert!(decode.contains("expert_swiglu n_expert=8 n_ff=32 [int lanes]"));
    let long = plan(&m, LONG_CHUNK, HOPPER).to_string();
    assert!(long.contains("[rows cpw=1]"), "{long}");
    assert!(long.contains("[grouped wgmma]"), "{long}");
    assert!(long.contains("[inverse table]"), "{long}");
    // Only the head's one row (the last token's logits) still takes a GEMV.
    let gemv: Vec<&str> = long.lines().filter(|l| l.contains("[gemv")).collect();
    assert_eq!(gemv.len(), 1, "{gemv:?}");
    assert!(gemv[0].contains(" logits: linear"), "{gemv:?}");
}

/// Sixteen sequences of one decode row each: past the GEMV thresholds, so the products read
/// each weight once for all rows on the tensor cores; the rows' logits all come out.
const BATCH_16: Bucket = Bucket::Decode { batch: 16, kv: 128 };
/// A chunk of 40 beside 4 decode rows: the attention stays split-K (the flash kernel stages
/// one sequence) and the logits are the chunk's last row and the decode rows.
const MIXED: Bucket = Bucket::Mixed {
    chunk: 40,
    batch: 4,
    kv: 128,
};

#[test]
fn batched_and_mixed_steps_lower_to_these_plans() {
    let m = tiny();
    for (bucket, name) in [
        (BATCH_16, "cuda_decode_batch_16"),
        (MIXED, "cuda_mixed_40_4"),
    ] {
        let p = plan(&m, bucket, HOPPER);
        let text = p.to_string();
        assert!(!text.contains("[flash"), "{name}:\n{text}");
        insta::assert_snapshot!(name, text);
    }
    let batch = plan(&m, BATCH_16, HOPPER).to_string();
    assert!(batch.contains("block_table I32[16,2]"), "{batch}");
    assert!(batch.contains("logits F32[16,512]"), "{batch}");
    let mixed = plan(&m, MIXED, HOPPER).to_string();
    assert!(mixed.contains("block_table I32[5,2]"), "{mixed}");
    assert!(mixed.contains("slice_rows(start=39, len=5)"), "{mixed}");
}

#[test]
fn a_gpu_without_warpgroup_mma_gets_the_mma_sync_expert_kernel() {
    let ampere = Target::Cuda {
        compute_capability: (8, 0),
    };
    let text = plan(&tiny(), LONG_CHUNK, ampere).to_string();
    assert!(text.contains("[grouped mma.sync]"), "{text}");
    assert!(!text.contains("wgmma"), "{text}");
}

#[test]
fn the_shared_expert_rides_the_routed_skinny_launches_and_computes_the_declared_graph() {
    // Tiny's experts are 32 wide, too narrow for the skinny kernel's 256-value k-tiles (its
    // down product is generic); at 256 they take it, as the release's 1,024 do.
    let mut dims = models::synth::Dims::preset(Preset::Tiny);
    dims.n_ff_exp = 256;
    let m = made(dims, "wide_experts");
    // 16 tokens' routes take the skinny kernel: the shared expert's products join them.
    let batch = plan(&m, BATCH_16, HOPPER).to_string();
    assert!(
        batch.contains("moe.experts_act+shared.gate+up+act: expert_swiglu"),
        "{batch}"
    );
    assert!(
        batch.contains("moe.experts_down+shared.down: expert_down"),
        "{batch}"
    );
    assert!(
        !batch.contains("moe.shared.gate+up+act: gate_up_swiglu"),
        "{batch}"
    );
    // Off, they keep launches of their own.
    let off = LoweringOptions {
        fuse_shared_expert: false,
        ..LoweringOptions::default()
    };
    let shape = StepShape::single(BATCH_16, LogitRows::Last);
    let apart = build_plan(&m, shape, None, HOPPER, &off)
        .unwrap()
        .to_string();
    assert!(
        apart.contains("moe.shared.gate+up+act: gate_up_swiglu"),
        "{apart}"
    );
    assert!(!apart.contains("+shared.gate+up+act"), "{apart}");
    // One token's routes take the integer GEMV, which carries the shared expert too.
    let one = plan(&m, DECODE, HOPPER).to_string();
    assert!(
        one.contains(
            "moe.experts_act+shared.gate+up+act: expert_swiglu n_expert=8 n_ff=256 [int lanes]"
        ),
        "{one}"
    );
    assert!(
        one.contains("moe.experts_down+shared.down: expert_down n_expert=8 n_embd=256 [int lanes]"),
        "{one}"
    );
    // A long chunk's take the grouped GEMM: apart there.
    let long = plan(&m, LONG_CHUNK, HOPPER).to_string();
    assert!(
        long.contains("moe.shared.gate+up+act: gate_up_swiglu"),
        "{long}"
    );
    assert!(!long.contains("+shared.gate+up+act"), "{long}");
    // A 12-token chunk (48 routes) takes the fused nodes; run by the CPU executor, the
    // lowered graph gives the declaration's bits (the fused ops' references are the two ops').
    let tokens: Vec<u32> = (0..12).map(|i| (i * 53 + 7) % 512).collect();
    let chunk = StepShape::single(Bucket::Prefill { chunk: 12, kv: 64 }, LogitRows::All);
    let text = build_plan(&m, chunk, None, HOPPER, &LoweringOptions::default())
        .unwrap()
        .to_string();
    assert!(text.contains("+shared.gate+up+act"), "{text}");
    let f32_cache = LoweringOptions {
        f16_latent_cache: false,
        ..LoweringOptions::default()
    };
    let declared = run_on_cpu(&m, Target::Cpu, &f32_cache, &tokens, 91);
    let lowered = run_on_cpu(&m, HOPPER, &f32_cache, &tokens, 91);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&declared.0), bits(&lowered.0));
    assert_eq!(bits(&declared.1), bits(&lowered.1));
}

#[test]
fn every_fusion_can_be_turned_off_and_then_the_declaration_stays() {
    let m = tiny();
    let off = LoweringOptions {
        fuse_hc: false,
        fuse_norm_linear: false,
        pair_linears: false,
        fuse_gate_up: false,
        fuse_kv_cache_write: false,
        fold_shared_add: false,
        fuse_routed_hc: false,
        fuse_query_kv: false,
        fuse_shared_expert: false,
        router_routes_max_rows: 0,
        ..LoweringOptions::default()
    };
    let shape = StepShape::single(DECODE, LogitRows::Last);
    let unfused = build_plan(&m, shape, None, HOPPER, &off).unwrap();
    let declared = plan(&m, DECODE, Target::Cpu);
    assert_eq!(unfused.schedule.len(), declared.schedule.len());
    let fused = plan(&m, DECODE, HOPPER);
    assert!(
        fused.schedule.len() < declared.schedule.len(),
        "{} fused nodes vs {} declared",
        fused.schedule.len(),
        declared.schedule.len()
    );
}

#[test]
fn the_tiny_greedy_decode_step_lowers_to_this_launch_list() {
    let m = tiny();
    let shape = StepShape::single(DECODE, LogitRows::Last);
    let plan = build_plan(&m, shape, Some(0), HOPPER, &LoweringOptions::default()).unwrap();
    let text = lowered_launches(&plan).unwrap();
    // The step ends in the token choice, whose I32 result is the only thing read back.
    let last = text
        .lines()
        .rev()
        .find(|l| l.starts_with(' '))
        .unwrap_or("");
    assert!(last.contains("sample_rows"), "{last}");
    assert!(text.contains("output next_token"), "{text}");
    insta::assert_snapshot!("tiny_xing4_greedy_decode_lowered", text);
}

#[test]
fn a_penalised_choice_lowers_to_the_penalty_then_the_draw() {
    let m = tiny();
    let shape = StepShape::single(DECODE, LogitRows::Last);
    let plan = build_plan(&m, shape, Some(64), HOPPER, &LoweringOptions::default()).unwrap();
    let text = lowered_launches(&plan).unwrap();
    assert!(text.contains("input penalty_ids I32[1,64]"), "{text}");
    assert!(text.contains("input penalty F32[1]"), "{text}");
    let at = |what: &str| {
        text.lines()
            .position(|l| l.starts_with(' ') && l.contains(what))
            .unwrap_or_else(|| panic!("no {what} in {text}"))
    };
    assert!(at("penalize_rows") < at("sample_rows"), "{text}");
}

/// Runs `tokens` at positions `0..n` then one decode token on the CPU executor, through the
/// plans built for `target` with `opts`; returns every prefill row's logits and the decode
/// step's.
fn run_on_cpu(
    m: &Model,
    target: Target,
    opts: &LoweringOptions,
    tokens: &[u32],
    next: u32,
) -> (Vec<f32>, Vec<f32>) {
    let opts = opts.clone();
    let n = tokens.len();
    let prefill = StepShape::single(Bucket::Prefill { chunk: n, kv: 64 }, LogitRows::All);
    let decode = StepShape::single(Bucket::Decode { batch: 1, kv: 64 }, LogitRows::Last);
    let p = build_plan(m, prefill, None, target, &opts).unwrap();
    let d = build_plan(m, decode, None, target, &opts).unwrap();
    let mut state = HostState::for_plan(&p, 64).unwrap();
    let mut exec = CpuExecutor::new();
    let bytes = |v: &[i32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
    let pos: Vec<i32> = (0..n as i32).collect();
    // One sequence in the pool's one block: slots are positions.
    let table = bytes(&[0]);
    exec.run(
        &p,
        m,
        &mut state,
        &[
            ("tokens", &bytes(&ids)),
            ("positions", &bytes(&pos)),
            ("kv_slots", &bytes(&pos)),
            ("block_table", &table),
            ("row_seq", &bytes(&vec![0; n])),
        ],
    )
    .unwrap();
    let rows = exec.output_f32(&p, "logits").unwrap().to_vec();
    exec.run(
        &d,
        m,
        &mut state,
        &[
            ("tokens", &bytes(&[next as i32])),
            ("positions", &bytes(&[n as i32])),
            ("kv_slots", &bytes(&[n as i32])),
            ("block_table", &table),
            ("row_seq", &bytes(&[0])),
        ],
    )
    .unwrap();
    (rows, exec.output_f32(&d, "logits").unwrap().to_vec())
}

#[test]
fn the_latent_cache_is_f16_only_where_every_attention_kernel_reads_f16() {
    let m = tiny();
    let shape = StepShape::single(DECODE, LogitRows::Last);
    let caches = |o: &LoweringOptions, target: Target| -> Vec<ops::DType> {
        let p = build_plan(&m, shape, None, target, o).unwrap();
        let types: Vec<ops::DType> = p
            .graph
            .of_kind(graph::ValueKind::State)
            .map(|(_, v)| v.meta.dtype)
            .collect();
        assert!(!types.is_empty());
        types
    };
    let d = LoweringOptions::default();
    let all = |v: Vec<ops::DType>, t: ops::DType| v.iter().all(|&x| x == t);
    assert!(all(caches(&d, HOPPER), ops::DType::F16));
    let f32_products = LoweringOptions {
        attention_f16_split: false,
        ..d.clone()
    };
    assert!(all(caches(&f32_products, HOPPER), ops::DType::F32));
    let kept = LoweringOptions {
        f16_latent_cache: false,
        ..d.clone()
    };
    assert!(all(caches(&kept, HOPPER), ops::DType::F32));
    assert!(all(caches(&d, Target::Cpu), ops::DType::F32));
}

/// A profile's attention bytes are the cache rows the step reads: each sequence's positions up
/// to its furthest token's, once, whatever the kernel (16 decode rows of 3 sequences here).
#[test]
fn a_profile_counts_the_cache_rows_each_sequence_attends_once() {
    let m = tiny();
    let p = plan(&m, BATCH_16, HOPPER);
    let positions: Vec<i32> = (0..16)
        .map(|i| [40, 7, 100][i % 3] - (i as i32 / 3))
        .collect();
    let row_seq: Vec<i32> = (0..16i32).map(|i| i % 3).collect();
    let bytes = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (pb, sb) = (bytes(&positions), bytes(&row_seq));
    let inputs: [(&str, &[u8]); 2] = [("positions", &pb), ("row_seq", &sb)];
    let mut attention = 0;
    for node in &p.graph.nodes {
        let got = p.graph.node_cache_bytes(node, &inputs);
        if node.op.name() != "mla_attention" {
            assert_eq!(got, 0, "{}", node.name);
            continue;
        }
        attention += 1;
        let cache = &p.graph.value(node.inputs[1]).meta;
        let row = cache.bytes().unwrap() / cache.shape[0];
        // Furthest positions 40, 7, 100: 41 + 8 + 101 rows.
        assert_eq!(got, (150 * row) as u64, "{}", node.name);
    }
    assert!(attention > 0);
    // Without the step's inputs nothing is counted.
    let node = p
        .graph
        .nodes
        .iter()
        .find(|n| n.op.name() == "mla_attention")
        .unwrap();
    assert_eq!(p.graph.node_cache_bytes(node, &[]), 0);
    // A padding row (position -1) reads nothing; two tokens of one sequence read its rows once.
    assert_eq!(ops::CacheReads::bytes(&[-1, 3, 5], &[0, 1, 1], 10), 60);
}

#[test]
fn the_cuda_lowered_graph_computes_the_declared_one_on_the_cpu() {
    let m = tiny();
    let tokens: Vec<u32> = (0..12).map(|i| (i * 37 + 5) % 512).collect();
    let d = LoweringOptions::default();
    let (declared_rows, declared_next) = run_on_cpu(&m, Target::Cpu, &d, &tokens, 77);
    // The fusions alone (the cache kept F32): each fused op's reference is the chain it
    // replaces, in the same order, so the same bits.
    let f32_cache = LoweringOptions {
        f16_latent_cache: false,
        ..d.clone()
    };
    let (lowered_rows, lowered_next) = run_on_cpu(&m, HOPPER, &f32_cache, &tokens, 77);
    assert_eq!(declared_rows.len(), 12 * m.decl.n_vocab());
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&declared_rows), bits(&lowered_rows));
    assert_eq!(bits(&declared_next), bits(&lowered_next));
    // The default plan stores the cache as F16: the references then read keys and values
    // rounded to f16 (11 significant bits), which moves the logits by about that much.
    let (f16_rows, f16_next) = run_on_cpu(&m, HOPPER, &d, &tokens, 77);
    let rel = |a: &[f32], b: &[f32]| {
        let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
        let den: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum();
        (num / den).sqrt()
    };
    let (r_rows, r_next) = (
        rel(&declared_rows, &f16_rows),
        rel(&declared_next, &f16_next),
    );
    assert!(
        r_rows > 0.0,
        "an F16 cache changed nothing: was it narrowed?"
    );
    assert!(
        r_rows < 1e-2 && r_next < 1e-2,
        "rows {r_rows:.3e}, next {r_next:.3e}"
    );
}

/// The tiny xing4_0 checkpoint of `dims` (seed 11), loaded; its directory is removed after.
fn made(dims: models::synth::Dims, name: &str) -> Arc<Model> {
    let dir = std::env::temp_dir().join(format!("lowering_{name}_{}", std::process::id()));
    models::synth::write_checkpoint(&models::synth::SynthOptions {
        arch: loader::hparams::Arch::Xing4_0,
        dims,
        seed: 11,
        out: dir.clone(),
        force: true,
        progress: false,
    })
    .unwrap_or_else(|e| panic!("{e:#}"));
    let model = models::load(&dir.join("model.gguf"), Some(&dir), false)
        .unwrap_or_else(|e| panic!("{e:#}"))
        .model;
    std::fs::remove_dir_all(&dir).unwrap();
    model
}

/// Experts stored in another type than IQ4_NL (a Q8_0 quantization of a model) take the
/// generic expert kernel in every step shape, where IQ4_NL ones take GEMV, skinny or grouped
/// kernels; the plan has the same nodes.
#[test]
fn experts_of_another_weight_type_take_the_generic_kernel_in_every_step_shape() {
    let mut dims = models::synth::Dims::preset(Preset::Tiny);
    dims.expert_type = Some(loader::GgmlType::Q8_0);
    let q8 = made(dims, "q8_experts");
    let iq4 = tiny();
    for bucket in [DECODE, SHORT_CHUNK, LONG_CHUNK] {
        let text = plan(&q8, bucket, HOPPER).to_string();
        let experts: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("expert_swiglu") || l.contains("expert_down"))
            .collect();
        assert!(!experts.is_empty(), "{text}");
        for l in &experts {
            assert!(l.contains("[generic]"), "{bucket:?}: {l}");
        }
        // (tiny's IQ4_NL down projection, 32 wide, is generic anyway; its gate/up, 256 wide,
        // is not.)
        let release = plan(&iq4, bucket, HOPPER).to_string();
        assert!(
            release
                .lines()
                .filter(|l| l.contains("expert_swiglu"))
                .all(|l| !l.contains("[generic]")),
            "{bucket:?}:\n{release}"
        );
        assert_eq!(
            text.lines().count(),
            release.lines().count(),
            "{bucket:?}: the same nodes"
        );
    }
}

/// A latent wider than the GPU attention kernel covers (kv_lora_rank 640; the release's is 512)
/// runs on the CPU, and the CUDA plan is refused when it is made, naming the node and the rule.
#[test]
fn a_latent_too_wide_for_the_gpu_attention_is_refused_when_the_plan_is_made() {
    let mut dims = models::synth::Dims::preset(Preset::Tiny);
    dims.kv_lora = 640;
    let wide = made(dims, "wide_latent");
    assert!(
        plan(&wide, DECODE, Target::Cpu)
            .to_string()
            .contains("mla_attention")
    );
    let shape = StepShape::single(DECODE, LogitRows::Last);
    let e = build_plan(&wide, shape, None, HOPPER, &LoweringOptions::default())
        .unwrap_err()
        .to_string();
    for part in [
        "blk.0.",
        "mla_attention",
        "kv_lora_rank (found 640)",
        "at most 576 and 512",
    ] {
        assert!(e.contains(part), "{part:?} missing from: {e}");
    }
}

/// A latent the flash kernel takes (kv_lora 64 with a 64-wide rope key): a prefill chunk of
/// 512 runs on it whole; a mixed step's 300-token chunk runs on it and its decode rows on the
/// split kernel (one sequence's rows at a time each); a chunk below the flash threshold beside
/// decode rows, and a decode batch, stay on the split kernel, unless the context bucket is deep
/// (2048 positions or more) and the chunk at least 16 rows.
#[test]
fn a_mixed_step_s_long_chunk_takes_the_flash_kernel_and_its_decode_rows_the_split_one() {
    let mut dims = models::synth::Dims::preset(Preset::Tiny);
    dims.kv_lora = 64;
    dims.qk_rope = 64;
    let m = made(dims, "flash_latent");
    let attention = |bucket: Bucket| -> Vec<String> {
        plan(&m, bucket, HOPPER)
            .to_string()
            .lines()
            .filter(|l| l.contains(": mla_attention "))
            .map(|l| l.to_string())
            .collect()
    };
    let all = |bucket: Bucket, label: &str| {
        let lines = attention(bucket);
        assert!(!lines.is_empty(), "{bucket:?}");
        for l in &lines {
            assert!(l.ends_with(label), "{bucket:?}: {l}");
        }
    };
    all(
        Bucket::Prefill {
            chunk: 512,
            kv: 512,
        },
        "[flash f16]",
    );
    all(
        Bucket::Mixed {
            chunk: 300,
            batch: 4,
            kv: 512,
        },
        "[flash f16 rows 0..300, then split-k f16]",
    );
    all(
        Bucket::Mixed {
            chunk: 40,
            batch: 4,
            kv: 512,
        },
        "[split-k f16]",
    );
    all(Bucket::Decode { batch: 64, kv: 512 }, "[split-k f16]");
    // Over a deep context a short chunk takes the flash kernel too (each split row would read
    // the whole context); a decode batch there stays on the split kernel.
    all(
        Bucket::Mixed {
            chunk: 40,
            batch: 4,
            kv: 4096,
        },
        "[flash f16 rows 0..40, then split-k f16]",
    );
    all(
        Bucket::Mixed {
            chunk: 8,
            batch: 4,
            kv: 4096,
        },
        "[split-k f16]",
    );
    all(
        Bucket::Prefill {
            chunk: 100,
            kv: 4096,
        },
        "[flash f16]",
    );
    all(
        Bucket::Decode {
            batch: 64,
            kv: 4096,
        },
        "[split-k f16]",
    );
}

/// The warpgroup split kernel is the default on compute capability 9.0 for the model's
/// attention shape alone (32 heads, a 512-wide latent, a 64-wide rope key): that shape's decode
/// steps and short mixed steps take it, the decode rows beside a chunk on the flash kernel keep
/// the other split kernel, and so do the tiny preset's shape, another compute capability and
/// the options with it turned off (whose line then does not name it).
#[test]
fn decode_steps_of_the_model_s_attention_shape_take_the_warpgroup_kernel_on_hopper() {
    let mut dims = models::synth::Dims::preset(Preset::Tiny);
    dims.n_head = 32;
    dims.kv_lora = 512;
    dims.qk_rope = 64;
    let real = made(dims, "wg_latent");
    let wg = LoweringOptions::default();
    assert!(wg.attention_wg);
    let off = LoweringOptions {
        attention_wg: false,
        ..LoweringOptions::default()
    };
    let labels = |m: &Model, bucket: Bucket, o: &LoweringOptions, target: Target| {
        let shape = StepShape::single(bucket, LogitRows::Last);
        build_plan(m, shape, None, target, o)
            .unwrap()
            .to_string()
            .lines()
            .filter(|l| l.contains(": mla_attention "))
            .map(|l| l.to_string())
            .collect::<Vec<String>>()
    };
    let all = |lines: Vec<String>, label: &str| {
        assert!(!lines.is_empty());
        for l in &lines {
            assert!(l.ends_with(label), "{l}");
        }
    };
    let decode = Bucket::Decode { batch: 8, kv: 4096 };
    let mixed = |chunk| Bucket::Mixed {
        chunk,
        batch: 4,
        kv: 512,
    };
    all(labels(&real, decode, &wg, HOPPER), "[split-k f16 wg]");
    all(labels(&real, mixed(8), &wg, HOPPER), "[split-k f16 wg]");
    all(
        labels(&real, mixed(300), &wg, HOPPER),
        "[flash f16 rows 0..300, then split-k f16]",
    );
    all(labels(&real, decode, &off, HOPPER), "[split-k f16]");
    let ada = Target::Cuda {
        compute_capability: (8, 9),
    };
    all(labels(&real, decode, &wg, ada), "[split-k f16]");
    all(labels(&tiny(), decode, &wg, HOPPER), "[split-k f16]");
    assert!(wg.to_string().contains("products=f16 wg cache=f16"), "{wg}");
    assert!(!off.to_string().contains(" wg"), "{off}");
}

/// Decode steps whose experts average at most five routes take the skinny kernel's integer
/// path, busier ones its f16 path's 16-route tiles, and the option turns the integer path off
/// (the tiny model: 8 experts, top 4, so 3 to 10 sequences; 1 or 2 take the integer GEMV).
#[test]
fn decode_experts_with_few_routes_each_take_the_integer_skinny_path() {
    let m = tiny();
    let on = LoweringOptions::default();
    assert_eq!(on.expert_skinny_int_routes_an_expert, 5);
    let off = LoweringOptions {
        expert_skinny_int_routes_an_expert: 0,
        ..LoweringOptions::default()
    };
    let no_deep_ring = LoweringOptions {
        expert_int_deep_ring_routes_an_expert: 0,
        ..LoweringOptions::default()
    };
    let all = |batch: usize, o: &LoweringOptions, label: &str| {
        gate_up_labels_end_with(&m, batch, HOPPER, o, label)
    };
    // The tiny model routes top-4 of 8 experts: 3 tokens are 1.5 routes an expert, past one
    // and within the deep ring's 3; 10 tokens are 5.
    all(3, &on, "[skinny int deep]");
    // 6 tokens are 24 routes, three an expert: the deep ring's last; 7 are past it.
    all(6, &on, "[skinny int deep]");
    all(7, &on, "[skinny int]");
    all(3, &no_deep_ring, "[skinny int]");
    all(10, &on, "[skinny int]");
    all(11, &on, "[skinny]");
    all(8, &off, "[skinny]");
    all(2, &on, "[int lanes]");
    assert!(
        on.to_string().contains(
            "(int <=5 an expert, deep ring <=3, staged inputs gate+up <=1 down <=5, stream>=0 bulk)"
        ),
        "{on}"
    );
}

/// The streamed integer kernel takes the skinny expert products from its routes on, on the
/// integer and the f16 path's steps alike, only where bulk copies exist (compute capability
/// 9.0 and later), and never below the GEMV's routes.
#[test]
fn decode_experts_past_the_stream_threshold_take_the_streamed_kernel_on_hopper() {
    let m = tiny();
    let stream = LoweringOptions {
        expert_int_stream_min_routes: 12,
        ..LoweringOptions::default()
    };
    let ampere = Target::Cuda {
        compute_capability: (8, 0),
    };
    let all = |batch: usize, target: Target, o: &LoweringOptions, label: &str| {
        gate_up_labels_end_with(&m, batch, target, o, label)
    };
    // The tiny model routes top-4: 3 tokens are 12 routes, 2 tokens 8 (the integer GEMV's).
    all(3, HOPPER, &stream, "[skinny int stream bulk]");
    all(11, HOPPER, &stream, "[skinny int stream bulk]");
    let lanes = LoweringOptions {
        expert_int_stream_bulk: false,
        ..stream
    };
    all(3, HOPPER, &lanes, "[skinny int stream]");
    all(2, HOPPER, &stream, "[int lanes]");
    all(3, ampere, &stream, "[skinny int deep]");
    assert!(stream.to_string().contains("stream>=12 bulk"), "{stream}");
}

/// The integer path's products copy their first routes' inputs through the weight ring where
/// that was measured faster: down at every step it takes, gate+up up to one route an expert
/// (where it does not take the deep ring); each threshold at 0 turns its staging off. A model
/// of the tiny preset's shape with 256-wide experts, so that down takes the skinny kernel too
/// (8 experts, top 4: 2 sequences take the integer GEMV, 3 to 10 the integer path).
#[test]
fn integer_expert_products_stage_their_inputs_where_that_was_measured_faster() {
    let mut dims = models::synth::Dims::preset(Preset::Tiny);
    dims.n_ff_exp = 256;
    let m = made(dims, "staged_inputs");
    let labels = |batch: usize, o: &LoweringOptions, op: &str| {
        let shape = StepShape::single(Bucket::Decode { batch, kv: 128 }, LogitRows::Last);
        let lines: Vec<String> = build_plan(&m, shape, None, HOPPER, o)
            .unwrap()
            .to_string()
            .lines()
            .filter(|l| l.contains(op))
            .map(|l| l.to_string())
            .collect();
        assert!(!lines.is_empty(), "{op}");
        lines
    };
    let all = |lines: Vec<String>, label: &str| {
        for l in &lines {
            assert!(l.ends_with(label), "{l}");
        }
    };
    let (gate_up, down) = (": expert_swiglu ", ": expert_down ");
    let on = LoweringOptions::default();
    // 3 sequences: 1.5 routes an expert, the deep ring's gate+up; 7: 3.5, past it.
    all(labels(3, &on, gate_up), "[skinny int deep]");
    all(labels(7, &on, gate_up), "[skinny int]");
    for batch in [3, 7, 10] {
        all(labels(batch, &on, down), "[skinny int staged]");
    }
    all(labels(11, &on, down), "[skinny]");
    all(labels(2, &on, down), "[int lanes]");
    // Gate+up stages up to its threshold's routes an expert (past the deep ring's steps).
    let gate_up_to_two = LoweringOptions {
        expert_int_deep_ring_routes_an_expert: 0,
        expert_int_staged_gate_up_routes_an_expert: 2,
        ..LoweringOptions::default()
    };
    all(labels(4, &gate_up_to_two, gate_up), "[skinny int staged]");
    all(labels(5, &gate_up_to_two, gate_up), "[skinny int]");
    let never = LoweringOptions {
        expert_int_staged_gate_up_routes_an_expert: 0,
        expert_int_staged_down_routes_an_expert: 0,
        ..gate_up_to_two
    };
    all(labels(4, &never, gate_up), "[skinny int]");
    all(labels(7, &never, down), "[skinny int]");
}

#[test]
fn dense_ffns_past_64_rows_take_the_tensor_core_tiles() {
    let m = tiny();
    let o = LoweringOptions::default();
    assert_eq!(o.skinny_max_rows, 64);
    let gate_up = |batch: usize| {
        let shape = StepShape::single(Bucket::Decode { batch, kv: 128 }, LogitRows::Last);
        build_plan(&m, shape, None, HOPPER, &o)
            .unwrap()
            .to_string()
            .lines()
            .find(|l| l.contains("blk.0.ffn.gate+up+act: "))
            .expect("a dense block")
            .to_string()
    };
    assert!(
        gate_up(64).ends_with("gate_up_swiglu [skinny]"),
        "{}",
        gate_up(64)
    );
    assert!(
        gate_up(65).ends_with("gate_up_swiglu [tensor cores]"),
        "{}",
        gate_up(65)
    );
    assert!(
        gate_up(128).ends_with("gate_up_swiglu [tensor cores]"),
        "{}",
        gate_up(128)
    );
}
