//! What the workspace tests share: synthetic checkpoints made once per test process.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use engine::Model;
use loader::hparams::Arch;
use models::synth::{Dims, Preset, SynthOptions, write_checkpoint};

/// The Xing4.0 checkpoint of `preset` made with `seed`, written once per process under a temp
/// directory named for `name`, and loaded.
pub fn synthetic(preset: Preset, seed: u64, name: &str) -> Arc<Model> {
    synthetic_dims(
        Dims::preset(preset),
        &format!("{preset:?}").to_lowercase(),
        seed,
        name,
    )
}

/// As [`synthetic`], of `dims` (named `label` in the directory).
pub fn synthetic_dims(dims: Dims, label: &str, seed: u64, name: &str) -> Arc<Model> {
    static DIRS: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let dirs = DIRS.get_or_init(|| Mutex::new(HashMap::new()));
    let dir = {
        let mut dirs = dirs.lock().unwrap_or_else(|e| e.into_inner());
        dirs.entry(format!("{name}_{label}_{seed}"))
            .or_insert_with(|| {
                let d = std::env::temp_dir()
                    .join(format!("{name}_{label}_{seed}_{}", std::process::id()));
                let _ = std::fs::remove_dir_all(&d);
                write_checkpoint(&SynthOptions {
                    arch: Arch::Xing4_0,
                    dims,
                    seed,
                    out: d.clone(),
                    force: true,
                    progress: false,
                })
                .unwrap_or_else(|e| panic!("{e:#}"));
                d
            })
            .clone()
    };
    models::load(&dir.join("model.gguf"), Some(&dir), false)
        .unwrap()
        .model
}

/// ‖a − b‖ / ‖b‖.
pub fn rel_rms(a: &[f32], b: &[f32]) -> f64 {
    let (mut d, mut n) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        d += (*x as f64 - *y as f64).powi(2);
        n += (*y as f64).powi(2);
    }
    (d / n.max(1e-30)).sqrt()
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

/// Logits `train/reference.py` wrote into `dir`: `oracle.json` (the prompt, its token ids, the
/// vocabulary size) and `oracle-logits.f32` (one row a position).
pub struct Oracle {
    pub prompt: String,
    pub tokens: Vec<u32>,
    pub n_vocab: usize,
    pub logits: Vec<f32>,
}

pub fn read_oracle(dir: &std::path::Path) -> Oracle {
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("oracle.json")).unwrap()).unwrap();
    let tokens: Vec<u32> = meta["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let n_vocab = meta["n_vocab"].as_u64().unwrap() as usize;
    let logits: Vec<f32> = std::fs::read(dir.join("oracle-logits.f32"))
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(logits.len(), tokens.len() * n_vocab);
    Oracle {
        prompt: meta["prompt"].as_str().unwrap().to_string(),
        tokens,
        n_vocab,
        logits,
    }
}

/// A greedy request for `max_tokens` after `prompt`, ending at any of `stop_tokens`.
pub fn greedy_request(
    prompt: Vec<u32>,
    max_tokens: usize,
    stop_tokens: Vec<u32>,
) -> engine::GenerateRequest {
    engine::GenerateRequest {
        prompt,
        max_tokens,
        sampling: engine::SamplingParams::greedy(),
        stop_tokens,
        stop_strings: vec![],
        want_logits: false,
    }
}

/// The CPU's relative RMS against `train/reference.py`'s logits in
/// `tests/reference/<reference>`, on `make-model`'s checkpoint of `arch`/`dims`/`seed` (written
/// to a temporary directory, removed after; the oracle's prompt must tokenize to its ids).
pub fn cpu_against_oracle(arch: Arch, dims: Dims, seed: u64, reference: &str) -> f64 {
    let dir = std::env::temp_dir().join(format!("oracle_{reference}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    write_checkpoint(&SynthOptions {
        arch,
        dims,
        seed,
        out: dir.clone(),
        force: true,
        progress: false,
    })
    .unwrap_or_else(|e| panic!("{e:#}"));
    // The release directory passes the config.json cross-check.
    let loaded = models::load(&dir.join("model.gguf"), Some(&dir), false)
        .unwrap_or_else(|e| panic!("{e:#}"));
    let o = read_oracle(
        &PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/reference")
            .join(reference),
    );
    let tok = loaded.tokenizer.as_ref().unwrap();
    assert_eq!(tok.encode(&o.prompt, true).unwrap(), o.tokens);
    let config = engine::EngineConfig {
        max_model_len: 64,
        ..engine::EngineConfig::default()
    };
    let got = engine::Engine::new(loaded.model.clone(), config)
        .unwrap()
        .forward(&o.tokens, graph::LogitRows::All)
        .unwrap();
    assert_eq!(got.len(), o.logits.len());
    std::fs::remove_dir_all(&dir).unwrap();
    rel_rms(&got, &o.logits)
}
