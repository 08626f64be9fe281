//! What the tests of the embedded default model (tools/default-model) share: loading it, the
//! oracle's files (read by `support`), and the chat prompt. Needs `mod support;` beside it.

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

#[allow(unused_imports)]
pub use crate::support::{argmax, rel_rms, top2_gap};

pub fn oracle() -> crate::support::Oracle {
    crate::support::read_oracle(&dir())
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
