//! The schema check with the registered tensor tables, against the llama.cpp-made reference
//! checkpoint and edited copies of its tensor list.

use std::path::{Path, PathBuf};

use loader::GgmlType;
use loader::gguf::{GgufFile, Metadata, TensorInfo, Value};
use loader::hparams::Arch;
use loader::schema::Problem;
use models::check_schema;

fn reference_model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/reference/deepseek2-tiny/model.gguf")
}

fn reference() -> (Metadata, Vec<TensorInfo>) {
    let f = GgufFile::open(&reference_model()).expect("reference checkpoint opens");
    (f.metadata.clone(), f.tensors.clone())
}

#[test]
fn the_reference_deepseek2_checkpoint_passes_its_schema_with_the_readme_dimensions() {
    let (meta, tensors) = reference();
    let h = check_schema(&meta, &tensors).unwrap_or_else(|e| panic!("{e}"));
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
    assert_eq!(models::tensors(&h).len(), tensors.len());
}

fn problems(meta: &Metadata, tensors: &[TensorInfo]) -> (Vec<Problem>, String) {
    let e = check_schema(meta, tensors).expect_err("schema violation");
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
    let h = check_schema(&meta, &tensors).unwrap_or_else(|e| panic!("{e}"));
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
