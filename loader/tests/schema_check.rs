//! Per-architecture schemas and hyper-parameters, against the llama.cpp-made reference
//! checkpoint and hand-edited copies of its header.

use std::path::{Path, PathBuf};

use loader::GgmlType;
use loader::gguf::{GgufFile, Metadata, TensorInfo, Value};
use loader::hparams::{Arch, HParams};
use loader::schema::{Problem, check, expected_tensors};

fn reference_model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/reference/deepseek2-tiny/model.gguf")
}

fn reference() -> (Metadata, Vec<TensorInfo>) {
    let f = GgufFile::open(&reference_model()).expect("reference checkpoint opens");
    (f.metadata.clone(), f.tensors.clone())
}

#[test]
fn the_reference_deepseek2_checkpoint_passes_its_schema_with_the_readme_dimensions() {
    let (meta, tensors) = reference();
    let h = check(&meta, &tensors).unwrap_or_else(|e| panic!("{e}"));
    // Dimensions as its README states them.
    assert_eq!(h.arch, Arch::Deepseek2);
    assert_eq!((h.n_embd, h.n_block, h.n_layer, h.n_nextn), (256, 4, 4, 0));
    assert_eq!(
        (h.n_head, h.n_head_kv, h.q_lora_rank, h.kv_lora_rank),
        (4, 1, 32, 32)
    );
    assert_eq!((h.qk_nope, h.qk_rope, h.v_head, h.rope_dim), (16, 8, 16, 8));
    assert_eq!((h.key_length, h.value_length), (40, 32));
    assert_eq!((h.n_ff, h.n_ff_exp, h.n_dense_lead), (128, 32, 1));
    assert_eq!((h.n_expert, h.n_expert_used, h.n_expert_shared), (8, 2, 1));
    assert_eq!((h.n_vocab, h.n_ctx_train), (512, 16384));
    assert_eq!(h.expert_gating, loader::hparams::ExpertGating::Sigmoid);
    assert!(h.expert_weights_norm);
    assert_eq!(h.expert_weights_scale, 2.0);
    assert_eq!(h.rms_eps, 1e-6);
    assert_eq!(h.rope_freq_base, 1e4);
    let y = h.yarn.expect("yarn");
    assert_eq!(
        (y.factor, y.orig_ctx, y.beta_fast, y.beta_slow),
        (4.0, 4096, 32.0, 1.0)
    );
    assert_eq!(y.log_multiplier, 0.1);
    assert!(h.hc.is_none());
    // Every tensor in the file is one the schema lists (it has no NextN block).
    assert_eq!(expected_tensors(&h).len(), tensors.len());
}

fn problems(meta: &Metadata, tensors: &[TensorInfo]) -> (Vec<Problem>, String) {
    let e = check(meta, tensors).expect_err("schema violation");
    let text = e.to_string();
    (e.problems, text)
}

#[test]
fn a_missing_tensor_and_a_wrong_shape_are_both_listed_with_expected_and_found() {
    let (meta, mut tensors) = reference();
    tensors.retain(|t| t.name != "blk.2.ffn_up_exps.weight");
    let t = tensors
        .iter_mut()
        .find(|t| t.name == "blk.1.attn_q_b.weight")
        .unwrap();
    t.ne = vec![32, 95];
    let (p, text) = problems(&meta, &tensors);
    assert_eq!(p.len(), 2, "{text}");
    assert!(p.contains(&Problem::MissingTensor {
        name: "blk.2.ffn_up_exps.weight".into(),
        ne: vec![256, 32, 8],
        allowed: loader::schema::ANY,
    }));
    assert!(p.contains(&Problem::WrongShape {
        name: "blk.1.attn_q_b.weight".into(),
        expected: vec![32, 96],
        found: vec![32, 95],
    }));
    assert!(
        text.contains("blk.2.ffn_up_exps.weight") && text.contains("[32, 96]"),
        "{text}"
    );
    assert!(text.contains("2 problems"), "{text}");
}

#[test]
fn a_norm_in_a_quantized_type_and_a_stray_trunk_tensor_are_refused() {
    let (meta, mut tensors) = reference();
    let norm = tensors
        .iter_mut()
        .find(|t| t.name == "blk.0.attn_norm.weight")
        .unwrap();
    norm.ty = GgmlType::BF16;
    let mut stray = tensors[0].clone();
    stray.name = "blk.1.rope_freqs.weight".into();
    tensors.push(stray);
    let (p, text) = problems(&meta, &tensors);
    assert!(
        p.contains(&Problem::DisallowedType {
            name: "blk.0.attn_norm.weight".into(),
            allowed: &[GgmlType::F32],
            found: GgmlType::BF16,
        }),
        "{text}"
    );
    assert!(p.contains(&Problem::UnexpectedTensor {
        name: "blk.1.rope_freqs.weight".into()
    }));
}

#[test]
fn nextn_blocks_are_optional_and_their_tensors_are_ignored() {
    let (mut meta, mut tensors) = reference();
    meta.insert("deepseek2.block_count", Value::U32(5));
    meta.insert("deepseek2.nextn_predict_layers", Value::U32(1));
    let mut extra = tensors[0].clone();
    extra.name = "blk.4.nextn.eh_proj.weight".into();
    tensors.push(extra);
    let h = check(&meta, &tensors).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((h.n_block, h.n_nextn, h.n_layer), (5, 1, 4));
    // A block past block_count is not a NextN block.
    let mut beyond = tensors[0].clone();
    beyond.name = "blk.5.attn_norm.weight".into();
    tensors.push(beyond);
    let (p, _) = problems(&meta, &tensors);
    assert_eq!(
        p,
        vec![Problem::UnexpectedTensor {
            name: "blk.5.attn_norm.weight".into()
        }]
    );
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
    let (meta, tensors) = reference();
    let meta = without(&meta, "deepseek2.expert_gating_func");
    let (p, text) = problems(&meta, &tensors);
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
    let (meta, tensors) = reference();
    let mut meta = without(&meta, "deepseek2.attention.kv_lora_rank");
    meta.insert("deepseek2.block_count", Value::String("four".into()));
    meta.insert("deepseek2.expert_weights_norm", Value::U32(1));
    let meta = without(&meta, "deepseek2.rope.scaling.yarn_log_multiplier");
    let (p, text) = problems(&meta, &tensors);
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
    let (mut meta, tensors) = reference();
    meta.insert("deepseek2.attention.head_count_kv", Value::U32(4));
    meta.insert("deepseek2.expert_gating_func", Value::U32(3));
    meta.insert("deepseek2.attention.key_length", Value::U32(41));
    meta.insert("deepseek2.expert_group_count", Value::U32(4));
    let (p, text) = problems(&meta, &tensors);
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
    let (mut meta, tensors) = reference();
    meta.insert("general.architecture", Value::String("llama".into()));
    let (_, text) = problems(&meta, &tensors);
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
    // Spec §2 tensor table: 40 trunk blocks, 2 dense (19 tensors) + 38 MoE (24), + 3 globals.
    let rules = expected_tensors(&h);
    assert_eq!(rules.len(), 2 * 19 + 38 * 24 + 3);
    let find = |n: &str| rules.iter().find(|r| r.name == n).unwrap().ne.clone();
    assert_eq!(find("blk.0.hc_attn_fn.weight"), [14336, 24]);
    assert_eq!(find("blk.5.attn_k_b.weight"), [128, 512, 32]);
    assert_eq!(find("blk.5.attn_v_b.weight"), [512, 128, 32]);
    assert_eq!(find("blk.5.attn_q_b.weight"), [768, 6144]);
    assert_eq!(find("blk.5.attn_kv_a_mqa.weight"), [3584, 576]);
    assert_eq!(find("blk.5.attn_output.weight"), [4096, 3584]);
    assert_eq!(find("blk.1.ffn_down.weight"), [9216, 3584]);
    assert_eq!(find("blk.39.ffn_down_exps.weight"), [1024, 3584, 64]);
    assert_eq!(find("output.weight"), [3584, 131072]);
    assert!(rules.iter().all(|r| !r.name.starts_with("blk.40.")));
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
