//! xing4_0 with fewer hyper-connection streams than the release's 4 (`hc_mult` 1 and 2, which
//! llama.cpp refuses and this runtime reads): a tiny checkpoint of each, run on the CPU against
//! `train/xing4.py`'s forward (reference/xing4-hc1 and xing4-hc2, written by `python3
//! train/reference.py DIR --out tests/tests/reference/xing4-hc<N> --prompt "Hello world, the
//! model reads text and code data."` on `make-model --arch xing4_0 --preset tiny --hc <N>
//! --seed 1`). The GPU runs these counts in tests/tests/gpu_shapes.rs.

use std::path::PathBuf;

mod support;

use engine::{Engine, EngineConfig};
use graph::LogitRows;
use loader::hparams::Arch;
use models::synth::{Dims, Preset, SynthOptions, write_checkpoint};

fn matches_the_pytorch_forward(hc: usize) {
    let dir = std::env::temp_dir().join(format!("xing4_hc{hc}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut dims = Dims::preset(Preset::Tiny);
    dims.hc = hc;
    write_checkpoint(&SynthOptions {
        arch: Arch::Xing4_0,
        dims,
        seed: 1,
        out: dir.clone(),
        force: true,
        progress: false,
    })
    .unwrap();
    let loaded = models::load(&dir.join("model.gguf"), Some(&dir), false)
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(loaded.model.hparams.hc.map(|h| h.count), Some(hc));
    let reference =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/reference/xing4-hc{hc}"));
    let o = support::read_oracle(&reference);
    let tok = loaded.tokenizer.as_ref().unwrap();
    assert_eq!(tok.encode(&o.prompt, true).unwrap(), o.tokens);
    let config = EngineConfig {
        max_model_len: 64,
        ..EngineConfig::default()
    };
    let got = Engine::new(loaded.model.clone(), config)
        .unwrap()
        .forward(&o.tokens, LogitRows::All)
        .unwrap();
    assert_eq!(got.len(), o.logits.len());
    let rel = support::rel_rms(&got, &o.logits);
    eprintln!("hc {hc}: relative RMS against the PyTorch forward {rel:e}");
    // Both sides compute in f32 from the same dequantized weights: summation order only.
    assert!(rel < 1e-4, "hc {hc}: relative RMS {rel:e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn one_stream_matches_the_pytorch_forward_on_the_cpu() {
    matches_the_pytorch_forward(1);
}

#[test]
fn two_streams_match_the_pytorch_forward_on_the_cpu() {
    matches_the_pytorch_forward(2);
}

#[test]
fn more_streams_than_the_kernels_take_are_refused_by_name() {
    let dir = std::env::temp_dir().join(format!("xing4_hc9_{}", std::process::id()));
    let mut dims = Dims::preset(Preset::Tiny);
    dims.hc = 9;
    let e = write_checkpoint(&SynthOptions {
        arch: Arch::Xing4_0,
        dims,
        seed: 1,
        out: dir,
        force: true,
        progress: false,
    })
    .unwrap_err();
    assert!(format!("{e:#}").contains("--hc must be 1..=8"), "{e:#}");
}
