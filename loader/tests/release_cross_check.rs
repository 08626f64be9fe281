//! MODEL.md §1.3: the GGUF header against config.json. The deepseek2 metadata is written by hand
//! from /work/shared/reference/deepseek2-tiny/README.md; the xing4_0 one from MODEL.md §1.1/§1.2.

use std::path::Path;

use loader::gguf::{Metadata, Value};
use loader::release::{CrossCheckError, Mismatch, ReleaseConfig, cross_check};

fn reference_config() -> ReleaseConfig {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/reference/deepseek2-tiny/config.json");
    ReleaseConfig::from_file(&p).unwrap()
}

/// README: hidden 256, 4 blocks (block 0 dense), 4 heads, q_lora 32, kv_lora 32, qk_nope 16,
/// qk_rope 8, v_head 16, dense ffn 128, expert ffn 32, 8 routed (top-2) + 1 shared, vocab 512,
/// context 16384, no MTP; theta 1e4, YaRN factor 4 / orig 4096 / log-mul 0.1 / beta 32, 1; eps 1e-6;
/// sigmoid gating (2), normalized top-k, scale 2.0, groups 1/1, head_count_kv 1.
fn deepseek2_tiny() -> Metadata {
    let mut m = Metadata::new();
    let p = "deepseek2.";
    m.insert("general.architecture", Value::String("deepseek2".into()));
    for (k, v) in [
        ("vocab_size", 512),
        ("context_length", 16384),
        ("embedding_length", 256),
        ("feed_forward_length", 128),
        ("block_count", 4),
        ("attention.head_count", 4),
        ("attention.head_count_kv", 1),
        ("expert_count", 8),
        ("expert_used_count", 2),
        ("expert_gating_func", 2),
        ("expert_group_count", 1),
        ("expert_group_used_count", 1),
        ("leading_dense_block_count", 1),
        ("attention.q_lora_rank", 32),
        ("attention.kv_lora_rank", 32),
        ("attention.key_length", 40),
        ("attention.value_length", 32),
        ("attention.key_length_mla", 24),
        ("attention.value_length_mla", 16),
        ("expert_feed_forward_length", 32),
        ("expert_shared_count", 1),
        ("rope.dimension_count", 8),
        ("rope.scaling.original_context_length", 4096),
    ] {
        m.insert(format!("{p}{k}"), Value::U32(v));
    }
    for (k, v) in [
        ("rope.freq_base", 10000.0),
        ("attention.layer_norm_rms_epsilon", 1e-6),
        ("expert_weights_scale", 2.0),
        ("rope.scaling.factor", 4.0),
        ("rope.scaling.yarn_beta_fast", 32.0),
        ("rope.scaling.yarn_beta_slow", 1.0),
        ("rope.scaling.yarn_log_multiplier", 0.1),
    ] {
        m.insert(format!("{p}{k}"), Value::F32(v));
    }
    m.insert(format!("{p}expert_weights_norm"), Value::Bool(true));
    m.insert(
        format!("{p}rope.scaling.type"),
        Value::String("yarn".into()),
    );
    m.insert("tokenizer.ggml.bos_token_id", Value::U32(0));
    m.insert("tokenizer.ggml.eos_token_id", Value::U32(1));
    m
}

fn mismatches(e: CrossCheckError) -> Vec<Mismatch> {
    match e {
        CrossCheckError::Mismatches(v) => v,
        other => panic!("expected mismatches, got {other}"),
    }
}

#[test]
fn reference_config_parses_with_its_values() {
    let c = reference_config();
    assert_eq!(c.model_type.as_deref(), Some("deepseek_v3"));
    assert_eq!(
        (
            c.hidden_size,
            c.num_hidden_layers,
            c.num_nextn_predict_layers
        ),
        (256, 4, 0)
    );
    assert_eq!(c.q_lora_rank, Some(32));
    let rs = c.rope_scaling.as_ref().unwrap();
    assert_eq!(
        (rs.kind(), rs.factor, rs.mscale_all_dim),
        (Some("yarn"), Some(4.0), Some(1.0))
    );
    assert_eq!(
        c.eos_token_id.as_ref().map(|e| e.ids().to_vec()),
        Some(vec![1])
    );
    // No clamp keys in a deepseek config: the ±30 default, flagged.
    let clamp = c.hc_clamp();
    assert_eq!((clamp.min, clamp.max, clamp.defaulted), (-30.0, 30.0, true));
}

#[test]
fn the_reference_checkpoint_passes_the_cross_check() {
    cross_check(&deepseek2_tiny(), &reference_config()).unwrap();
}

#[test]
fn every_mismatch_is_listed_with_both_keys_and_values() {
    let mut m = deepseek2_tiny();
    m.insert("deepseek2.expert_count", Value::U32(16));
    m.insert(
        "deepseek2.attention.layer_norm_rms_epsilon",
        Value::F32(1e-5),
    );
    let e = cross_check(&m, &reference_config()).unwrap_err();
    let text = e.to_string();
    let ms = mismatches(e);
    assert_eq!(ms.len(), 2, "{text}");
    assert!(ms.contains(&Mismatch::Differ {
        gguf_key: "deepseek2.expert_count".into(),
        config_key: "n_routed_experts".into(),
        gguf_value: "u32 16".into(),
        config_value: "8".into(),
    }));
    for needle in [
        "deepseek2.attention.layer_norm_rms_epsilon",
        "rms_norm_eps",
        "0.00001",
        "0.000001",
    ] {
        assert!(text.contains(needle), "{needle} missing from: {text}");
    }
}

#[test]
fn floats_agree_within_one_part_per_million() {
    let mut m = deepseek2_tiny();
    m.insert("deepseek2.rope.freq_base", Value::F32(10000.005));
    cross_check(&m, &reference_config()).unwrap();
    m.insert("deepseek2.rope.freq_base", Value::F32(10000.02));
    let ms = mismatches(cross_check(&m, &reference_config()).unwrap_err());
    assert!(matches!(&ms[..], [Mismatch::Differ { config_key, .. }] if config_key == "rope_theta"));
}

#[test]
fn yarn_log_multiplier_is_compared_with_a_tenth_of_mscale_all_dim() {
    let mut m = deepseek2_tiny();
    m.insert(
        "deepseek2.rope.scaling.yarn_log_multiplier",
        Value::F32(1.0),
    );
    let text = cross_check(&m, &reference_config())
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("yarn_log_multiplier") && text.contains("mscale_all_dim"),
        "{text}"
    );
}

#[test]
fn missing_gating_func_is_rejected_rather_than_defaulting_to_softmax() {
    let mut m = deepseek2_tiny();
    let mut cleaned = Metadata::new();
    for (k, v) in m.iter() {
        if k != "deepseek2.expert_gating_func" {
            cleaned.insert(k, v.clone());
        }
    }
    let text = cross_check(&cleaned, &reference_config())
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("expert_gating_func")
            && text.contains("scoring_func")
            && text.contains("absent"),
        "{text}"
    );
    m.insert("deepseek2.expert_gating_func", Value::U32(1));
    let text = cross_check(&m, &reference_config())
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("softmax") && text.contains("\"sigmoid\""),
        "{text}"
    );
}

#[test]
fn runtime_requirements_are_asserted() {
    let mut m = deepseek2_tiny();
    m.insert("deepseek2.attention.head_count_kv", Value::U32(4));
    let mut c = reference_config();
    c.rope_scaling.as_mut().unwrap().mscale = Some(0.707);
    let ms = mismatches(cross_check(&m, &c).unwrap_err());
    assert_eq!(ms.len(), 2, "{ms:?}");
    assert!(ms.iter().all(|x| matches!(x, Mismatch::Requirement { .. })));
    let text = ms.iter().map(|x| x.to_string()).collect::<String>();
    assert!(
        text.contains("head_count_kv") && text.contains("mscale"),
        "{text}"
    );
}

#[test]
fn a_wrong_model_type_or_architecture_is_named() {
    let mut c = reference_config();
    c.model_type = Some("llama".into());
    let text = cross_check(&deepseek2_tiny(), &c).unwrap_err().to_string();
    assert!(
        text.contains("model_type") && text.contains("\"llama\""),
        "{text}"
    );
    let mut m = deepseek2_tiny();
    m.insert("general.architecture", Value::String("qwen2".into()));
    assert!(matches!(
        cross_check(&m, &reference_config()),
        Err(CrossCheckError::Architecture(a)) if a == "qwen2"
    ));
}

// ---- xing4_0 (MODEL.md §1.1 header values, §1.2 config values)

const XING_CONFIG: &str = r#"{
  "architectures": ["Xing4_0ForCausalLM"], "model_type": "xing4_0",
  "vocab_size": 131072, "hidden_size": 3584, "intermediate_size": 9216, "moe_intermediate_size": 1024,
  "num_hidden_layers": 40, "num_nextn_predict_layers": 1, "num_attention_heads": 32,
  "num_key_value_heads": 32, "n_shared_experts": 1, "n_routed_experts": 64, "num_experts_per_tok": 4,
  "routed_scaling_factor": 2.0, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
  "n_group": 1, "topk_group": 1, "norm_topk_prob": true, "first_k_dense_replace": 2,
  "q_lora_rank": 768, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
  "v_head_dim": 128, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "rope_theta": 10000,
  "rope_scaling": {"type": "yarn", "factor": 64, "original_max_position_embeddings": 4096,
                   "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
  "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
  "mhc_h_res_clamp_min": -30.0, "mhc_h_res_clamp_max": 30.0,
  "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": false
}"#;

fn xing4_0() -> Metadata {
    let mut m = Metadata::new();
    m.insert("general.architecture", Value::String("xing4_0".into()));
    for (k, v) in [
        ("block_count", 41),
        ("nextn_predict_layers", 1),
        ("context_length", 262144),
        ("vocab_size", 131072),
        ("embedding_length", 3584),
        ("feed_forward_length", 9216),
        ("expert_feed_forward_length", 1024),
        ("leading_dense_block_count", 2),
        ("attention.head_count", 32),
        ("attention.head_count_kv", 1),
        ("attention.key_length", 576),
        ("attention.value_length", 512),
        ("attention.key_length_mla", 192),
        ("attention.value_length_mla", 128),
        ("attention.q_lora_rank", 768),
        ("attention.kv_lora_rank", 512),
        ("rope.dimension_count", 64),
        ("rope.scaling.original_context_length", 4096),
        ("expert_count", 64),
        ("expert_used_count", 4),
        ("expert_shared_count", 1),
        ("expert_gating_func", 2),
        ("expert_group_count", 1),
        ("expert_group_used_count", 1),
        ("hyper_connection.count", 4),
        ("hyper_connection.sinkhorn_iterations", 20),
    ] {
        m.insert(format!("xing4_0.{k}"), Value::U32(v));
    }
    for (k, v) in [
        ("attention.layer_norm_rms_epsilon", 1e-6),
        ("rope.freq_base", 10000.0),
        ("rope.scaling.factor", 64.0),
        ("rope.scaling.yarn_beta_fast", 32.0),
        ("rope.scaling.yarn_beta_slow", 1.0),
        ("rope.scaling.yarn_log_multiplier", 0.1),
        ("expert_weights_scale", 2.0),
        ("hyper_connection.epsilon", 1e-6),
    ] {
        m.insert(format!("xing4_0.{k}"), Value::F32(v));
    }
    m.insert("xing4_0.expert_weights_norm", Value::Bool(true));
    m.insert("xing4_0.rope.scaling.type", Value::String("yarn".into()));
    m
}

fn xing_config() -> ReleaseConfig {
    serde_json::from_str(XING_CONFIG).unwrap()
}

#[test]
fn the_released_xing4_values_pass_and_carry_the_clamp() {
    cross_check(&xing4_0(), &xing_config()).unwrap();
    let clamp = xing_config().hc_clamp();
    assert_eq!(
        (clamp.min, clamp.max, clamp.defaulted),
        (-30.0, 30.0, false)
    );
}

#[test]
fn xing4_hyper_connection_keys_are_checked_and_hc_mult_is_bounded() {
    let mut m = xing4_0();
    m.insert("xing4_0.hyper_connection.count", Value::U32(9));
    m.insert(
        "xing4_0.hyper_connection.sinkhorn_iterations",
        Value::U32(10),
    );
    let mut c = xing_config();
    c.hc_mult = Some(9);
    let ms = mismatches(cross_check(&m, &c).unwrap_err());
    let text: Vec<String> = ms.iter().map(|x| x.to_string()).collect();
    assert_eq!(ms.len(), 2, "{text:?}");
    assert!(
        text.iter()
            .any(|t| t.contains("hc_sinkhorn_iters") && t.contains("u32 10") && t.contains("20"))
    );
    assert!(
        text.iter()
            .any(|t| t.contains("hyper_connection.count") && t.contains("requires 1..=8"))
    );
    // Fewer streams than the release's 4 agree with their config and are taken.
    let mut m = xing4_0();
    m.insert("xing4_0.hyper_connection.count", Value::U32(2));
    let mut c = xing_config();
    c.hc_mult = Some(2);
    cross_check(&m, &c).expect("hc_mult 2 is accepted");
}

#[test]
fn block_count_includes_the_mtp_block() {
    let mut c = xing_config();
    c.num_nextn_predict_layers = 0;
    let text = cross_check(&xing4_0(), &c).unwrap_err().to_string();
    assert!(
        text.contains("xing4_0.block_count")
            && text.contains("num_hidden_layers+num_nextn_predict_layers"),
        "{text}"
    );
    assert!(text.contains("xing4_0.nextn_predict_layers"), "{text}");
}

#[test]
fn a_config_missing_a_required_key_is_an_error_naming_it() {
    let mut v: serde_json::Value = serde_json::from_str(XING_CONFIG).unwrap();
    v.as_object_mut().unwrap().remove("hidden_size");
    let e = serde_json::from_value::<ReleaseConfig>(v)
        .unwrap_err()
        .to_string();
    assert!(e.contains("hidden_size"), "{e}");
}

#[test]
fn the_reference_gguf_header_passes_against_its_config_json() {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/reference/deepseek2-tiny/model.gguf");
    let file = loader::gguf::GgufFile::open(&p).unwrap();
    cross_check(&file.metadata, &reference_config()).unwrap();
    // The hand-written metadata above agrees with the real header on every key it sets.
    for (k, v) in deepseek2_tiny().iter() {
        let real = file
            .metadata
            .get(k)
            .unwrap_or_else(|| panic!("{k} missing"));
        match (real.as_f64(), v.as_f64()) {
            (Some(a), Some(b)) => assert!((a - b).abs() <= 1e-6 * a.abs(), "{k}"),
            _ => assert_eq!(real, v, "{k}"),
        }
    }
}
