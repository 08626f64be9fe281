//! xing4_0 with fewer hyper-connection streams than the release's 4 (`hc_mult` 1 and 2, which
//! llama.cpp refuses and this runtime reads): a tiny checkpoint of each, run on the CPU against
//! `train/xing4.py`'s forward (reference/xing4-hc1 and xing4-hc2, written by `python3
//! train/reference.py DIR --out tests/tests/reference/xing4-hc<N> --prompt "Hello world, the
//! model reads text and code data."` on `make-model --arch xing4_0 --preset tiny --hc <N>
//! --seed 1`). The GPU runs these counts in tests/tests/gpu_shapes.rs.

mod support;

use loader::hparams::Arch;
use models::synth::{Dims, Preset, SynthOptions, write_checkpoint};

fn matches_the_pytorch_forward(hc: usize) {
    let mut dims = Dims::preset(Preset::Tiny);
    dims.hc = hc;
    let rel = support::cpu_against_oracle(Arch::Xing4_0, dims, 1, &format!("xing4-hc{hc}"));
    eprintln!("hc {hc}: relative RMS against the PyTorch forward {rel:e}");
    // Both sides compute in f32 from the same dequantized weights: summation order only.
    assert!(rel < 1e-4, "hc {hc}: relative RMS {rel:e}");
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
