//! The Xing4.0 declaration end to end on the CPU, on tiny synthetic checkpoints
//! made by `make-model`: plan snapshots, prefill/decode agreement, cache isolation.

mod support;

use std::sync::Arc;

use engine::{Engine, EngineConfig, GenerateRequest, Model, SamplingParams};
use graph::{Bucket, GraphBuilder, LogitRows, Plan, StepShape};
use models::synth::Preset;

/// A tiny xing4_0 checkpoint, made once per test process.
fn tiny() -> Arc<Model> {
    support::synthetic(Preset::Tiny, 11, "xing4_model")
}

fn plan(model: &Model, bucket: Bucket, logits: LogitRows) -> Plan {
    let shape = StepShape::single(bucket, logits);
    let mut b = GraphBuilder::new(model);
    model.decl.declare(&mut b, &shape).unwrap();
    Plan::new(b.finish(), shape).unwrap()
}

#[test]
fn the_tiny_decode_plan_reads_like_the_spec() {
    let m = tiny();
    let p = plan(&m, Bucket::Decode { batch: 1, kv: 64 }, LogitRows::Last);
    insta::assert_snapshot!("tiny_xing4_decode_plan", p.render());
}

#[test]
fn the_tiny_prefill_plan_reads_like_the_spec() {
    let m = tiny();
    let p = plan(&m, Bucket::Prefill { chunk: 8, kv: 64 }, LogitRows::Last);
    insta::assert_snapshot!("tiny_xing4_prefill_plan", p.render());
}

fn engine(chunk: usize) -> Engine {
    let config = EngineConfig {
        max_model_len: 128,
        prefill_chunk: chunk,
        ..EngineConfig::default()
    };
    Engine::new(tiny(), config).unwrap()
}

fn prompt() -> Vec<u32> {
    (0..23).map(|i| (i * 37 + 5) % 500 + 1).collect()
}

#[test]
fn xing4_decode_steps_equal_the_rows_of_a_full_prefill_and_chunking_does_not_matter() {
    let p = prompt();
    let vocab = tiny().decl.n_vocab();
    let whole = engine(256).forward(&p, LogitRows::All).unwrap();
    let chunked = engine(7).forward(&p, LogitRows::All).unwrap();
    let mut step = engine(1);
    let mut rows = Vec::new();
    for &t in &p {
        rows.extend(step.forward(&[t], LogitRows::Last).unwrap());
    }
    assert_eq!(whole.len(), p.len() * vocab);
    let mut worst = 0f32;
    for ((a, b), c) in whole.iter().zip(&chunked).zip(&rows) {
        assert!(a.is_finite());
        worst = worst.max((a - b).abs()).max((a - c).abs());
    }
    // Different chunkings sum the same terms in different groupings only inside
    // matmuls over token blocks; f32 rounding, nothing more.
    assert!(worst < 1e-4, "worst |Δ| {worst}");
}

#[test]
fn xing4_logits_are_finite_and_of_order_one_through_every_block() {
    let logits = engine(64).forward(&prompt(), LogitRows::All).unwrap();
    let n = logits.len() as f64;
    let mean = logits.iter().map(|&x| x as f64).sum::<f64>() / n;
    let std = (logits
        .iter()
        .map(|&x| (x as f64 - mean).powi(2))
        .sum::<f64>()
        / n)
        .sqrt();
    assert!(logits.iter().all(|x| x.is_finite()));
    assert!((0.05..20.0).contains(&std), "logit std {std}");
}

#[test]
fn xing4_a_second_request_on_a_shared_cache_does_not_see_the_first_one() {
    let p = prompt();
    let short = &p[..5];
    let fresh = engine(64).forward(short, LogitRows::Last).unwrap();
    let mut shared = engine(64);
    let req = GenerateRequest {
        prompt: p.clone(),
        max_tokens: 4,
        sampling: SamplingParams::greedy(),
        stop_tokens: vec![],
        stop_strings: vec![],
        want_logits: false,
    };
    shared
        .generate(&req, None, |_| std::ops::ControlFlow::Continue(()))
        .unwrap();
    let mut first = Vec::new();
    let req2 = GenerateRequest {
        prompt: short.to_vec(),
        max_tokens: 1,
        ..req
    };
    shared
        .generate(&req2, None, |ev| {
            first = ev.logits.to_vec();
            std::ops::ControlFlow::Continue(())
        })
        .unwrap();
    assert_eq!(first, fresh);
}

#[test]
fn a_restored_prefix_gives_the_same_answer_as_a_full_prefill() {
    let p = prompt();
    let mut a = engine(64);
    a.forward(&p[..15], LogitRows::Last).unwrap();
    let snap = a.snapshot(15);
    let mut b = engine(64);
    b.forward(&[9, 9, 9], LogitRows::Last).unwrap();
    b.restore(&snap, 10).unwrap();
    let resumed = b.forward(&p[10..], LogitRows::Last).unwrap();
    let full = engine(64).forward(&p, LogitRows::Last).unwrap();
    for (x, y) in resumed.iter().zip(&full) {
        assert!((x - y).abs() < 1e-4, "{x} vs {y}");
    }
}
