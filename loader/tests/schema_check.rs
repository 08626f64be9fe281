//! Per-architecture metadata keys and hyper-parameters, against the llama.cpp-made reference
//! checkpoint's header and hand-edited copies of it. The tensor tables belong to the
//! architectures: `models/registry/tests/schema_check.rs` checks them.

use std::path::{Path, PathBuf};

use loader::gguf::{GgufFile, Metadata, Value};
use loader::hparams::{Arch, HParams};
use loader::schema::Problem;

fn reference_model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/reference/deepseek2-tiny/model.gguf")
}

fn reference() -> Metadata {
    let f = GgufFile::open(&reference_model()).expect("reference checkpoint opens");
    f.metadata.clone()
}

fn problems(meta: &Metadata) -> (Vec<Problem>, String) {
    let e = HParams::from_metadata(meta).expect_err("schema violation");
    let text = e.to_string();
    (e.problems, text)
}

fn without(meta: &Metadata, key: &str) -> Metadata {
    let mut m = Metadata::new();
    for (k, v) in meta.iter().filter(|(k, _)| *k != key) {
        m.insert(k, v.clone());
    }
    m
}

#[test]
fn a_missing_gating_function_is_an_error_not_a_silent_softmax() {
    let meta = without(&reference(), "deepseek2.expert_gating_func");
    let (p, text) = problems(&meta);
    assert_eq!(
        p,
        vec![Problem::MissingKey {
            key: "deepseek2.expert_gating_func".into(),
            expected: "u32"
        }],
        "{text}"
    );
}

#[test]
fn every_missing_or_mistyped_key_is_listed_at_once() {
    let mut meta = without(&reference(), "deepseek2.attention.kv_lora_rank");
    meta.insert("deepseek2.block_count", Value::String("four".into()));
    meta.insert("deepseek2.expert_weights_norm", Value::U32(1));
    let meta = without(&meta, "deepseek2.rope.scaling.yarn_log_multiplier");
    let (p, text) = problems(&meta);
    assert_eq!(p.len(), 4, "{text}");
    for key in [
        "attention.kv_lora_rank",
        "block_count",
        "expert_weights_norm",
        "rope.scaling.yarn_log_multiplier",
    ] {
        assert!(
            text.contains(&format!("`deepseek2.{key}`")),
            "{key} not named: {text}"
        );
    }
    assert!(text.contains("\"four\""), "{text}");
}

#[test]
fn values_the_runtime_cannot_run_are_refused() {
    let mut meta = reference();
    meta.insert("deepseek2.attention.head_count_kv", Value::U32(4));
    meta.insert("deepseek2.expert_gating_func", Value::U32(3));
    meta.insert("deepseek2.attention.key_length", Value::U32(41));
    meta.insert("deepseek2.expert_group_count", Value::U32(4));
    let (p, text) = problems(&meta);
    let keys: Vec<&str> = p
        .iter()
        .filter_map(|p| match p {
            Problem::BadValue { key, .. } => Some(key.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(
        keys,
        [
            "deepseek2.attention.head_count_kv",
            "deepseek2.attention.key_length",
            "deepseek2.expert_gating_func",
            "deepseek2.expert_group_count"
        ],
        "{text}"
    );
}

#[test]
fn an_unknown_architecture_is_named() {
    let mut meta = reference();
    meta.insert("general.architecture", Value::String("llama".into()));
    let (_, text) = problems(&meta);
    assert!(
        text.contains("\"llama\"") && text.contains("xing4_0"),
        "{text}"
    );
}

/// The released header's values (spec §1.1).
fn xing_release_metadata() -> Metadata {
    let mut m = Metadata::new();
    let u = Value::U32;
    m.insert("general.architecture", Value::String("xing4_0".into()));
    for (k, v) in [
        ("block_count", u(41)),
        ("nextn_predict_layers", u(1)),
        ("context_length", u(262144)),
        ("vocab_size", u(131072)),
        ("embedding_length", u(3584)),
        ("feed_forward_length", u(9216)),
        ("expert_feed_forward_length", u(1024)),
        ("leading_dense_block_count", u(2)),
        ("attention.head_count", u(32)),
        ("attention.head_count_kv", u(1)),
        ("attention.key_length", u(576)),
        ("attention.value_length", u(512)),
        ("attention.key_length_mla", u(192)),
        ("attention.value_length_mla", u(128)),
        ("attention.q_lora_rank", u(768)),
        ("attention.kv_lora_rank", u(512)),
        ("attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
        ("rope.dimension_count", u(64)),
        ("rope.freq_base", Value::F32(10000.0)),
        ("rope.scaling.type", Value::String("yarn".into())),
        ("rope.scaling.factor", Value::F32(64.0)),
        ("rope.scaling.original_context_length", u(4096)),
        ("rope.scaling.yarn_beta_fast", Value::F32(32.0)),
        ("rope.scaling.yarn_beta_slow", Value::F32(1.0)),
        ("rope.scaling.yarn_log_multiplier", Value::F32(0.1)),
        ("expert_count", u(64)),
        ("expert_used_count", u(4)),
        ("expert_shared_count", u(1)),
        ("expert_gating_func", u(2)),
        ("expert_weights_norm", Value::Bool(true)),
        ("expert_weights_scale", Value::F32(2.0)),
        ("expert_group_count", u(1)),
        ("expert_group_used_count", u(1)),
        ("hyper_connection.count", u(4)),
        ("hyper_connection.sinkhorn_iterations", u(20)),
        ("hyper_connection.epsilon", Value::F32(1e-6)),
    ] {
        m.insert(format!("xing4_0.{k}"), v);
    }
    m
}

#[test]
fn the_release_header_gives_the_spec_derived_constants() {
    let h = HParams::from_metadata(&xing_release_metadata()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(h.arch, Arch::Xing4_0);
    assert_eq!((h.n_block, h.n_layer, h.n_nextn), (41, 40, 1));
    assert_eq!((h.qk_nope, h.qk_rope, h.v_head), (128, 64, 128));
    let hc = h.hc.expect("hyper-connections");
    assert_eq!((hc.count, hc.sinkhorn_iters, hc.eps), (4, 20, 1e-6));
}

#[test]
fn hparams_survive_to_metadata_then_from_metadata() {
    let h = HParams::from_metadata(&xing_release_metadata()).unwrap();
    let mut m = Metadata::new();
    h.to_metadata(&mut m);
    assert_eq!(HParams::from_metadata(&m).unwrap(), h);
    // Every key the writer emits is one the schema knows, with the release's values.
    for (k, v) in xing_release_metadata().iter() {
        assert_eq!(m.get(k), Some(v), "{k}");
    }
}

#[test]
fn a_xing_header_without_hyper_connection_keys_is_refused() {
    let m = without(&xing_release_metadata(), "xing4_0.hyper_connection.count");
    let e = HParams::from_metadata(&m).unwrap_err().to_string();
    assert!(e.contains("xing4_0.hyper_connection.count"), "{e}");
}
