//! What the tests of the embedded default model (tools/default-model) share: loading it, the
//! oracle's files, and logit comparisons.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use engine::{Device, Engine, EngineConfig, Model};
use loader::chat::ChatMessage;
use models::Loaded;

/// The checkpoint's directory: beside this crate when built here, `tools/default-model` under
/// the working directory when the test binary was copied to another machine's checkout.
pub fn dir() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tools/default-model");
    if built.is_dir() {
        return built;
    }
    PathBuf::from("tools/default-model")
}

pub fn load() -> Loaded {
    let d = dir();
    models::load(&d.join("model.gguf"), Some(&d), false).unwrap_or_else(|e| panic!("{e:#}"))
}

pub fn engine(model: Arc<Model>) -> Engine {
    engine_on(model, Device::Cpu, 0)
}

/// `prefill_chunk` 0: the device's default.
pub fn engine_on(model: Arc<Model>, device: Device, prefill_chunk: usize) -> Engine {
    let config = EngineConfig {
        max_model_len: 256,
        prefill_chunk,
        device,
        ..EngineConfig::default()
    };
    Engine::new(model, config).unwrap_or_else(|e| panic!("{device}: {e}"))
}

pub fn oracle() -> (Vec<u32>, usize, Vec<f32>) {
    let oracle: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir().join("oracle.json")).unwrap()).unwrap();
    let tokens: Vec<u32> = oracle["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let vocab = oracle["n_vocab"].as_u64().unwrap() as usize;
    let bytes = std::fs::read(dir().join("oracle-logits.f32")).unwrap();
    let logits: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(logits.len(), tokens.len() * vocab);
    (tokens, vocab, logits)
}

pub fn rel_rms(a: &[f32], b: &[f32]) -> f64 {
    let (mut d, mut n) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        d += (*x as f64 - *y as f64).powi(2);
        n += (*y as f64).powi(2);
    }
    (d / n).sqrt()
}

pub fn argmax(row: &[f32]) -> usize {
    (0..row.len())
        .max_by(|&a, &b| row[a].total_cmp(&row[b]))
        .unwrap_or(0)
}

/// The gap between the best and the second-best logit.
pub fn top2_gap(row: &[f32]) -> f32 {
    let mut top = [f32::NEG_INFINITY; 2];
    for &x in row {
        if x > top[0] {
            top = [x, top[0]];
        } else if x > top[1] {
            top[1] = x;
        }
    }
    top[0] - top[1]
}

pub fn chat_prompt(loaded: &Loaded, user: &str) -> Vec<u32> {
    let tok = loaded.tokenizer.as_ref().unwrap();
    let tpl = loaded.chat_template.as_ref().unwrap();
    let text = tpl
        .render(&[ChatMessage::new("user", user)], true, true, None)
        .unwrap();
    tok.encode(&text, true).unwrap()
}

pub fn gpu_present() -> bool {
    ops::parity::test_gpu().is_some()
}
