//! The launch list a greedy decode step of the tiny Xing4.0 model lowers to on the
//! GPU (built from the plan, no GPU needed): every node's op and parameters, where
//! each device view points (weight buffer, state, arena offset) and its scratch.

use std::path::PathBuf;

use graph::{Bucket, LogitRows, StepShape, lowered_launches};
use loader::hparams::Arch;
use tools::synth::{Dims, Preset, SynthOptions, write_checkpoint};

#[test]
fn the_tiny_greedy_decode_step_lowers_to_this_launch_list() {
    let dir = std::env::temp_dir().join(format!("lowering_tiny_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    write_checkpoint(&SynthOptions {
        arch: Arch::Xing4_0,
        dims: Dims::preset(Preset::Tiny),
        seed: 11,
        out: dir.clone(),
        force: true,
        progress: false,
    })
    .unwrap_or_else(|e| panic!("{e:#}"));
    let loaded = tools::load::load(&dir.join("model.gguf"), Some(&dir), false).unwrap();
    let shape = StepShape {
        bucket: Bucket::Decode { batch: 1, kv: 64 },
        logits: LogitRows::Last,
    };
    let plan = engine::build_plan(&loaded.model, shape, true).unwrap();
    let text = lowered_launches(&plan).unwrap();
    let _ = std::fs::remove_dir_all(PathBuf::from(&dir));
    // The step ends in the argmax, whose I32 result is the only thing read back.
    let last = text
        .lines()
        .rev()
        .find(|l| l.starts_with(' '))
        .unwrap_or("");
    assert!(last.contains("argmax"), "{last}");
    assert!(text.contains("output next_token"), "{text}");
    insta::assert_snapshot!("tiny_xing4_greedy_decode_lowered", text);
}
