//! GPU parity on shapes nobody tuned for: proptest draws legal checkpoint shapes (hidden width,
//! heads, low ranks, rope width, experts, top-k, shared experts, routing; deepseek2 without
//! hyper-connections or xing4_0 with 1, 2 or 4 streams; experts stored as IQ4_NL, Q8_0 or
//! BF16), `make-model`'s writer builds each, and the GPU's logits are compared with the CPU's:
//! relative RMS at the typical position, the CPU's choice wherever its top-2 gap is clear of
//! the row's largest difference, and a short greedy continuation on the f32 path. Each run
//! draws fresh shapes (`PROPTEST_RNG_SEED` fixes the draw); a failing case prints its whole
//! shape, which `make-model`'s flags rebuild.
//! `XING4_SHAPE_CASES` sets the case count (default 64; `XING4_CPU_SHAPE_CASES` the CPU-only
//! check's, default 6); `XING4_LITE_DIR` adds a checkpoint
//! from disk (the full `make-model --preset lite`). Skips (saying why) without a CUDA GPU.

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use engine::{Device, Engine, EngineConfig, Model};
use graph::LogitRows;
use loader::GgmlType;
use loader::hparams::{Arch, ExpertGating};
use models::synth::{Dims, Preset, SynthOptions, write_checkpoint};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

mod support;
use support::{argmax, rel_rms, top2_gap};

fn gpu_present() -> bool {
    ops::parity::test_gpu().is_some()
}

fn engine(model: Arc<Model>, device: Device, chunk: usize) -> Engine {
    let config = EngineConfig {
        max_model_len: 128,
        prefill_chunk: chunk,
        device,
        ..EngineConfig::default()
    };
    Engine::new(model, config).unwrap_or_else(|e| panic!("{device}: {e}"))
}

/// The prompt `k` of a checkpoint with `vocab` pieces: 23 ordinary tokens.
fn prompt(vocab: usize, k: u32) -> Vec<u32> {
    let (a, b) = [(97, 13), (61, 7)][k as usize];
    (0..23u32)
        .map(|i| (i * a + b) % (vocab as u32 - 3) + 3)
        .collect()
}

/// The GPU's prompt logits in one chunk (bf16 activations into the tensor-core GEMMs) against
/// the CPU's: the median per-position relative RMS, or Err where the GPU chose another token
/// where the CPU's top-2 gap is clear of the row's largest difference.
fn prefill_median(model: &Arc<Model>, prompt: &[u32], what: &str) -> Result<f64, String> {
    let vocab = model.hparams.n_vocab;
    let cpu = engine(model.clone(), Device::Cpu, 0)
        .forward(prompt, LogitRows::All)
        .map_err(|e| format!("{what}: cpu: {e}"))?;
    let gpu = Engine::new(
        model.clone(),
        EngineConfig {
            max_model_len: 128,
            device: Device::Cuda(0),
            ..EngineConfig::default()
        },
    )
    .map_err(|e| format!("{what}: the GPU refused it: {e}"))?
    .forward(prompt, LogitRows::All)
    .map_err(|e| format!("{what}: gpu: {e}"))?;
    let mut per_pos: Vec<f64> = Vec::new();
    for (pos, (g, c)) in gpu.chunks(vocab).zip(cpu.chunks(vocab)).enumerate() {
        per_pos.push(rel_rms(g, c));
        let err = g
            .iter()
            .zip(c)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        if top2_gap(c) > 2.0 * err && argmax(g) != argmax(c) {
            return Err(format!(
                "{what}: position {pos}: the GPU chose another clear token"
            ));
        }
    }
    per_pos.sort_by(f64::total_cmp);
    Ok(per_pos[per_pos.len() / 2])
}

/// CPU and GPU on the checkpoint at `dir`: logits of a prompt (prefilled in one chunk, the
/// GPU's bf16 tensor-core paths) and 12 greedy tokens on the f32 path. Err describes a miss.
fn compare(dir: &Path, what: &str) -> Result<String, String> {
    let loaded = models::load(&dir.join("model.gguf"), Some(dir), false)
        .map_err(|e| format!("{what}: load: {e:#}"))?;
    let model = loaded.model.clone();
    let prompt = prompt(model.hparams.n_vocab, 0);
    let cpu = engine(model.clone(), Device::Cpu, 0)
        .forward(&prompt, LogitRows::All)
        .map_err(|e| format!("{what}: cpu: {e}"))?;
    // The f32 path (chunks of at most gemv_max_rows: no bf16 tiles) must agree to rounding
    // wherever routing does not flip: its median is the kernels' own error.
    let chunk = graph::LoweringOptions::default().gemv_max_rows;
    let gpu32 = engine(model.clone(), Device::Cuda(0), chunk)
        .forward(&prompt, LogitRows::All)
        .map_err(|e| format!("{what}: gpu f32 path: {e}"))?;
    let mut per_pos32: Vec<f64> = gpu32
        .chunks(model.hparams.n_vocab)
        .zip(cpu.chunks(model.hparams.n_vocab))
        .map(|(g, c)| rel_rms(g, c))
        .collect();
    per_pos32.sort_by(f64::total_cmp);
    let median32 = per_pos32[per_pos32.len() / 2];
    if median32 > 1e-3 {
        return Err(format!(
            "{what}: f32 path: median per-position relative RMS {median32:.3e}"
        ));
    }
    // bf16 activations into the prefill GEMMs, and the routing flips they cause on random
    // weights (DESIGN §5; tests/tests/gpu_model.rs measured up to 2.4e-2 from flips alone).
    // One flip of a top-1 route early in the prompt changes that position's whole expert
    // output and, through attention, every later position (seen on a deepseek2 draw: hidden
    // 256, 7 heads, top-1 of 10 sigmoid experts, seed 41: layer 1's top-2 router gap at
    // position 1 is 1.9e-4 in train/xing4.py, and from position 1 on the logits differed by
    // 0.1 to 0.8 while the f32 path agreed to 2.6e-6; with seed 9 the same shape passed).
    // A kernel error misses on any prompt; such a near-tie rarely recurs on a second one.
    let mut median = prefill_median(&model, &prompt, what)?;
    let mut note = String::new();
    if median > 3e-2 {
        let second = prefill_median(&model, &self::prompt(model.hparams.n_vocab, 1), what)?;
        note = format!(" (first prompt {median:.2e}: a routing near-tie; second prompt)");
        median = second;
    }
    if median > 3e-2 {
        return Err(format!(
            "{what}: median per-position relative RMS {median:.3e} on both prompts"
        ));
    }
    let req = support::greedy_request(prompt.clone(), 12, vec![]);
    let mut gaps = Vec::new();
    let c = engine(model.clone(), Device::Cpu, chunk)
        .generate(&req, None, |ev| {
            gaps.push(top2_gap(ev.logits));
            ControlFlow::Continue(())
        })
        .map_err(|e| format!("{what}: cpu generate: {e}"))?;
    let g = engine(model, Device::Cuda(0), chunk)
        .generate(&req, None, |_| ControlFlow::Continue(()))
        .map_err(|e| format!("{what}: gpu generate: {e}"))?;
    if let Some(k) = (0..c.tokens.len()).find(|&k| c.tokens[k] != g.tokens[k])
        && gaps[k] > 1e-3
    {
        return Err(format!(
            "{what}: greedy token {k} differs at a CPU gap of {:.3e}\ncpu {:?}\ngpu {:?}",
            gaps[k], c.tokens, g.tokens
        ));
    }
    Ok(format!(
        "{what}: median relative RMS {median:.2e} (bf16 prefill{note}), {median32:.2e} (f32 path)"
    ))
}

/// `make-model`'s checkpoint of shape `s` (seed `n`) in `dir`.
fn write_shape(s: &Shape, n: usize, dir: &Path) -> Result<(), String> {
    write_checkpoint(&SynthOptions {
        arch: s.arch,
        dims: s.dims.clone(),
        seed: n as u64,
        out: dir.to_path_buf(),
        force: true,
        progress: false,
    })
    .map(|_| ())
    .map_err(|e| format!("{e:#}"))
}

#[derive(Clone, Debug)]
struct Shape {
    arch: Arch,
    dims: Dims,
}

fn shapes() -> impl Strategy<Value = Shape> {
    (
        (
            prop::sample::select(vec![256usize, 512, 768]),
            1usize..=8,
            prop::sample::select(vec![0usize, 32, 96]),
            prop::sample::select(vec![64usize, 128, 192]),
            prop::sample::select(vec![16usize, 32, 64, 128]),
            prop::sample::select(vec![16usize, 32, 64]),
            prop::sample::select(vec![16usize, 32, 64, 128]),
        ),
        (
            2usize..=16,
            1usize..=6,
            0usize..=2,
            prop::sample::select(vec![32usize, 64, 96, 256, 1408]),
            prop::bool::ANY,
            prop::bool::ANY,
            prop::bool::ANY,
            1usize..=3,
            prop::sample::select(vec![1usize, 2, 4]),
            // The release's IQ4_NL experts most often, else a Q8_0 or BF16 quantization's.
            prop::sample::select(vec![None, None, Some(GgmlType::Q8_0), Some(GgmlType::BF16)]),
        ),
    )
        .prop_map(
            |(
                (embd, heads, q_lora, kv_lora, nope, rope, v),
                (ne, k, shared, ff_exp, softmax, xing, norm, layers, hc, expert_type),
            )| {
                let arch = if xing { Arch::Xing4_0 } else { Arch::Deepseek2 };
                let mut d = Dims::preset(Preset::Tiny);
                d.n_embd = embd;
                d.n_head = heads;
                d.q_lora = q_lora;
                d.kv_lora = kv_lora;
                d.qk_nope = nope;
                d.qk_rope = rope;
                d.v_head = v;
                d.n_expert = ne;
                d.n_expert_used = k.min(ne);
                d.n_expert_shared = shared;
                d.n_ff_exp = ff_exp;
                d.n_ff = 2 * ff_exp.max(128);
                d.n_layer = layers + 1;
                d.n_dense = 1;
                d.hc = if xing { hc } else { 0 };
                d.expert_type = expert_type;
                d.gating = if softmax {
                    ExpertGating::Softmax
                } else {
                    ExpertGating::Sigmoid
                };
                d.norm_topk = norm;
                d.routed_scale = if softmax { 1.0 } else { 2.0 };
                Shape { arch, dims: d }
            },
        )
}

#[test]
fn gpu_logits_match_the_cpu_on_random_legal_shapes() {
    if !gpu_present() {
        eprintln!("skipped: no CUDA GPU");
        return;
    }
    let cases: u32 = std::env::var("XING4_SHAPE_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let root = std::env::temp_dir().join(format!("gpu_shapes_{}", std::process::id()));
    // No shrinking: each case costs GPU seconds. Every case runs and reports, so one device
    // run shows every shape that fails, not the first.
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: 0,
        ..Config::default()
    });
    let counter = AtomicUsize::new(0);
    let failures = std::sync::Mutex::new(Vec::new());
    let _ = runner.run(&shapes(), |s| {
        let n = counter.fetch_add(1, Ordering::Relaxed) + 1;
        let dir = root.join(format!("case{n}"));
        let _ = std::fs::remove_dir_all(&dir);
        let what = format!("case {n}: {:?} {:?}", s.arch, s.dims);
        let r = write_shape(&s, n, &dir)
            .map_err(|e| format!("{what}: make-model: {e}"))
            .and_then(|_| compare(&dir, &what));
        let _ = std::fs::remove_dir_all(&dir);
        match r {
            Ok(line) => eprintln!("ok {line}"),
            Err(e) => {
                eprintln!("FAILED {e}");
                failures.lock().unwrap().push(e);
            }
        }
        Ok(())
    });
    let _ = std::fs::remove_dir_all(&root);
    if let Ok(dir) = std::env::var("XING4_LITE_DIR") {
        match compare(Path::new(&dir), "lite") {
            Ok(s) => eprintln!("ok {s}"),
            Err(e) => {
                eprintln!("FAILED {e}");
                failures.lock().unwrap().push(e);
            }
        }
    }
    let failures = failures.into_inner().unwrap();
    assert!(
        failures.is_empty(),
        "{} of {cases} shapes (and the lite checkpoint, when given) fail:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The shapes the GPU test draws are ones `make-model` writes and the CPU runs (on every
/// machine, so a generator drawing illegal shapes fails here, not on a GPU host).
#[test]
fn random_legal_shapes_build_and_run_on_the_cpu() {
    let root = std::env::temp_dir().join(format!("cpu_shapes_{}", std::process::id()));
    let cases = std::env::var("XING4_CPU_SHAPE_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let counter = AtomicUsize::new(0);
    let result = runner.run(&shapes(), |s| {
        let n = counter.fetch_add(1, Ordering::Relaxed) + 1;
        let dir = root.join(format!("case{n}"));
        write_shape(&s, n, &dir)
            .map_err(|e| TestCaseError::fail(format!("make-model {:?}: {e}", s.dims)))?;
        let loaded = models::load(&dir.join("model.gguf"), Some(&dir), false)
            .map_err(|e| TestCaseError::fail(format!("load {:?}: {e:#}", s.dims)))?;
        let logits = engine(loaded.model.clone(), Device::Cpu, 0)
            .forward(&[3, 5, 7, 11, 13], LogitRows::All)
            .map_err(|e| TestCaseError::fail(format!("{e}")))?;
        let _ = std::fs::remove_dir_all(&dir);
        prop_assert!(logits.iter().all(|x| x.is_finite()), "{:?}", s.dims);
        Ok(())
    });
    let _ = std::fs::remove_dir_all(&root);
    if let Err(e) = result {
        panic!("{e}");
    }
}
