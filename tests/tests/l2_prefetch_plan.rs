//! Where a decode step at the release's dimensions asks L2 for its products' weights ahead of
//! them (`Plan::prefetch`, `graph::l2_prefetches`). No GPU and no checkpoint: the plan is built
//! from the full preset's tensor list, as `make-model --preset full` would write it.

use std::collections::HashMap;

use graph::{
    Bucket, GraphBuilder, L2_PREFETCH_LOOKBACK, L2_PREFETCH_WINDOW, LogitRows, LoweringOptions,
    Plan, StepShape, Target,
};
use loader::hparams::Arch;
use models::synth::{Dims, Preset, plan as tensor_plan};
use ops::{DType, TensorMeta};

const HOPPER: Target = Target::Cuda {
    compute_capability: (9, 0),
};

fn full_plan(bucket: Bucket, target: Target, opts: &LoweringOptions) -> Plan {
    let h = Dims::preset(Preset::Full).hparams(Arch::Xing4_0).unwrap();
    let decl = models::declaration(&h, None).unwrap();
    let metas: HashMap<String, TensorMeta> = tensor_plan(&h)
        .into_iter()
        .map(|t| {
            let shape: Vec<usize> = t.ne.iter().rev().map(|&n| n as usize).collect();
            (t.name, TensorMeta::new(shape, DType::from_ggml(t.ty)))
        })
        .collect();
    let shape = StepShape::single(bucket, LogitRows::Last);
    let mut b = GraphBuilder::new(&metas);
    decl.declare(&mut b, &shape).unwrap();
    Plan::lowered(b.finish(), shape, target, opts).unwrap()
}

/// A schedule position, its node's name and the weights (name, bytes) prefetched before it.
type Prefetch = (usize, String, Vec<(String, usize)>);

fn prefetches(p: &Plan) -> Vec<Prefetch> {
    p.schedule
        .iter()
        .enumerate()
        .filter(|&(k, _)| !p.prefetch[k].is_empty())
        .map(|(k, &n)| {
            let names = p.prefetch[k]
                .iter()
                .map(|&(v, b)| (p.graph.value(v).name.clone(), b))
                .collect();
            (k, p.graph.nodes[n].name.clone(), names)
        })
        .collect()
}

fn position(p: &Plan, node: &str) -> usize {
    p.schedule
        .iter()
        .position(|&n| p.graph.nodes[n].name == node)
        .unwrap_or_else(|| panic!("no node {node}"))
}

/// Where `weight` is prefetched (schedule position, bytes), if it is.
fn prefetched(p: &Plan, weight: &str) -> Option<(usize, usize)> {
    prefetches(p)
        .into_iter()
        .find_map(|(k, _, w)| w.iter().find(|(n, _)| n == weight).map(|&(_, b)| (k, b)))
}

fn weight_bytes(p: &Plan, weight: &str) -> usize {
    let v = p.graph.find(weight).unwrap();
    p.graph.value(v).meta.bytes().unwrap()
}

const LAYERS: usize = 40;

#[test]
fn a_short_decode_step_has_each_layers_attention_weights_asked_for_before_they_are_read() {
    for batch in [1, 8] {
        let p = full_plan(
            Bucket::Decode { batch, kv: 1024 },
            HOPPER,
            &LoweringOptions::default(),
        );
        for l in 0..LAYERS {
            let pair = position(&p, &format!("blk.{l}.attn.q_a+kv_a"));
            for w in ["attn_q_a", "attn_kv_a_mqa", "attn_q_b"] {
                let name = format!("blk.{l}.{w}.weight");
                let (at, bytes) = prefetched(&p, &name).unwrap_or_else(|| panic!("{name}"));
                assert!(
                    at < pair && pair - at <= L2_PREFETCH_LOOKBACK,
                    "{name} at {at}, pair at {pair}"
                );
                assert_eq!(bytes, weight_bytes(&p, &name), "{name} whole");
            }
            let out = position(&p, &format!("blk.{l}.attn.out"));
            let name = format!("blk.{l}.attn_output.weight");
            let (at, bytes) = prefetched(&p, &name).unwrap_or_else(|| panic!("{name}"));
            assert!(
                at < out && out - at <= L2_PREFETCH_LOOKBACK,
                "{name} at {at}, out at {out}"
            );
            assert!(bytes >= L2_PREFETCH_WINDOW / 4, "{name}: {bytes} bytes");
        }
    }
}

#[test]
fn no_routed_expert_stack_is_prefetched_and_no_launch_asks_for_more_than_the_window() {
    for batch in [1, 8, 64] {
        for kv in [1024, 65536] {
            let p = full_plan(
                Bucket::Decode { batch, kv },
                HOPPER,
                &LoweringOptions::default(),
            );
            for (k, node, w) in prefetches(&p) {
                assert!(
                    w.iter().all(|(n, _)| !n.contains("_exps")),
                    "B={batch} kv={kv} before {node}: {w:?}"
                );
                let total: usize = w.iter().map(|&(_, b)| b).sum();
                assert!(
                    total <= L2_PREFETCH_WINDOW,
                    "B={batch} kv={kv} position {k} ({node}): {total} bytes"
                );
            }
        }
    }
}

#[test]
fn a_deep_context_leaves_the_output_projection_unasked_until_the_attention_has_read_the_cache() {
    let p = full_plan(
        Bucket::Decode {
            batch: 1,
            kv: 131072,
        },
        HOPPER,
        &LoweringOptions::default(),
    );
    for l in 0..LAYERS {
        let attend = position(&p, &format!("blk.{l}.attn.attend"));
        let name = format!("blk.{l}.attn_output.weight");
        let (at, _) = prefetched(&p, &name).unwrap_or_else(|| panic!("{name}"));
        assert!(at > attend, "{name} at {at}, the attention at {attend}");
    }
    // At a short context the same prefetch goes out before the attention.
    let short = full_plan(
        Bucket::Decode { batch: 1, kv: 1024 },
        HOPPER,
        &LoweringOptions::default(),
    );
    let (at, _) = prefetched(&short, "blk.5.attn_output.weight").unwrap();
    assert!(at < position(&short, "blk.5.attn.attend"));
}

#[test]
fn prefill_chunks_older_cards_and_a_zero_window_prefetch_nothing() {
    let off = LoweringOptions {
        l2_prefetch_window: 0,
        ..LoweringOptions::default()
    };
    let ampere = Target::Cuda {
        compute_capability: (8, 9),
    };
    let decode = Bucket::Decode { batch: 1, kv: 1024 };
    for (bucket, target, opts) in [
        (decode, HOPPER, &off),
        (decode, ampere, &LoweringOptions::default()),
        (decode, Target::Cpu, &LoweringOptions::default()),
        (
            Bucket::Prefill {
                chunk: 512,
                kv: 1024,
            },
            HOPPER,
            &LoweringOptions::default(),
        ),
    ] {
        let p = full_plan(bucket, target, opts);
        assert!(prefetches(&p).is_empty(), "{bucket:?} {target}");
        assert!(!p.to_string().contains("prefetch into L2"));
    }
    let on = full_plan(decode, HOPPER, &LoweringOptions::default()).to_string();
    assert!(
        on.contains("     prefetch into L2: blk.7.attn_q_a.weight (5505024 bytes), "),
        "the plan lists its prefetches"
    );
}
