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
    static DIRS: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let dirs = DIRS.get_or_init(|| Mutex::new(HashMap::new()));
    let dir = {
        let mut dirs = dirs.lock().unwrap_or_else(|e| e.into_inner());
        dirs.entry(format!("{name}_{seed}"))
            .or_insert_with(|| {
                let d = std::env::temp_dir().join(format!(
                    "{name}_{}_{seed}_{}",
                    format!("{preset:?}").to_lowercase(),
                    std::process::id()
                ));
                let _ = std::fs::remove_dir_all(&d);
                write_checkpoint(&SynthOptions {
                    arch: Arch::Xing4_0,
                    dims: Dims::preset(preset),
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
