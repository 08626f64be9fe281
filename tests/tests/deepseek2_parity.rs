//! Parity with external oracles on `shared/reference/deepseek2-tiny`: llama.cpp's
//! CPU logits and float64 logits of the same checkpoint (see that folder's README
//! for what each holds and which tolerances fit).

use std::path::PathBuf;

use engine::{Engine, EngineConfig, GenerateRequest, SamplingParams};
use graph::LogitRows;
use serde_json::Value;

fn reference(dir: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/reference")
        .join(dir)
}

fn json(path: PathBuf) -> Value {
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn rows(v: &Value) -> Vec<Vec<f64>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        })
        .collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// ‖ours − ref‖₂ / ‖ref‖₂ over one row.
fn rel_rms(ours: &[f32], reference: &[f64]) -> f64 {
    let num: f64 = ours
        .iter()
        .zip(reference)
        .map(|(a, b)| (*a as f64 - b).powi(2))
        .sum();
    let den: f64 = reference.iter().map(|b| b * b).sum();
    (num / den).sqrt()
}

fn max_abs(ours: &[f32], reference: &[f64]) -> f64 {
    ours.iter()
        .zip(reference)
        .map(|(a, b)| (*a as f64 - b).abs())
        .fold(0.0, f64::max)
}

fn argmax64(r: &[f64]) -> usize {
    (0..r.len()).fold(0, |b, i| if r[i] > r[b] { i } else { b })
}

fn argmax32(r: &[f32]) -> usize {
    (0..r.len()).fold(0, |b, i| if r[i] > r[b] { i } else { b })
}

fn engine(chunk: usize) -> Engine {
    let dir = reference("deepseek2-tiny");
    let loaded = models::load(&dir.join("model.gguf"), Some(&dir), false).unwrap();
    let config = EngineConfig {
        max_model_len: 256,
        prefill_chunk: chunk,
        ..EngineConfig::default()
    };
    Engine::new(loaded.model, config).unwrap()
}

#[test]
fn deepseek2_tiny_matches_float64_and_llama_cpp_over_prompt_and_teacher_forced_steps() {
    let r = json(reference("deepseek2-tiny").join("logits.json"));
    let prompt = ids(&r["prompt_ids"]);
    let greedy = ids(&r["greedy"]["token_ids"]);
    let f64_rows = rows(&r["numpy_f64"]["rows"]);
    let mut llama_rows = rows(&r["prompt_logits"]);
    let step_rows = rows(&r["greedy"]["step_logits"]);
    llama_rows.extend(step_rows[1..].iter().cloned());
    let mut margins: Vec<f64> = r["prompt_top2_margin"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    margins.extend(
        r["greedy"]["step_top2_margin"].as_array().unwrap()[1..]
            .iter()
            .map(|x| x.as_f64().unwrap()),
    );
    let vocab = 512;

    let mut e = engine(64);
    let mut ours: Vec<Vec<f32>> = e
        .forward(&prompt, LogitRows::All)
        .unwrap()
        .chunks(vocab)
        .map(|c| c.to_vec())
        .collect();
    // Teacher forcing: each greedy token decoded one step at a time.
    for &t in &greedy[..greedy.len() - 1] {
        ours.push(e.forward(&[t], LogitRows::Last).unwrap());
    }
    assert_eq!(ours.len(), f64_rows.len());

    let (mut worst_f64, mut worst_llama, mut worst_abs) = (0f64, 0f64, 0f64);
    for (i, row) in ours.iter().enumerate() {
        let vs_f64 = rel_rms(row, &f64_rows[i]);
        let vs_llama = rel_rms(row, &llama_rows[i]);
        worst_f64 = worst_f64.max(vs_f64);
        worst_llama = worst_llama.max(vs_llama);
        worst_abs = worst_abs.max(max_abs(row, &f64_rows[i]));
        assert!(
            vs_f64 < 1e-3,
            "row {i}: relative RMS vs float64 {vs_f64:.2e}"
        );
        assert!(
            vs_llama < 0.04,
            "row {i}: relative RMS vs llama.cpp {vs_llama:.3}"
        );
        assert_eq!(
            argmax32(row),
            argmax64(&f64_rows[i]),
            "row {i}: argmax vs float64"
        );
        if margins[i] > 0.1 {
            assert_eq!(
                argmax32(row),
                argmax64(&llama_rows[i]),
                "row {i}: argmax vs llama.cpp"
            );
        }
    }
    eprintln!(
        "deepseek2-tiny, 31 rows: worst relative RMS vs float64 {worst_f64:.2e} (max |Δ| {worst_abs:.2e}), vs llama.cpp {worst_llama:.4}"
    );
}

#[test]
fn deepseek2_tiny_free_running_greedy_decoding_agrees_with_llama_cpp() {
    let r = json(reference("deepseek2-tiny").join("logits.json"));
    let prompt = ids(&r["prompt_ids"]);
    let greedy = ids(&r["greedy"]["token_ids"]);
    let mut e = engine(256);
    let req = GenerateRequest {
        prompt,
        max_tokens: greedy.len(),
        sampling: SamplingParams::greedy(),
        stop_tokens: vec![],
        stop_strings: vec![],
        want_logits: false,
    };
    let out = e
        .generate(&req, None, |_| std::ops::ControlFlow::Continue(()))
        .unwrap();
    assert_eq!(out.tokens, greedy);
}

#[test]
fn deepseek2_tiny_long_yarn_prompt_matches_at_position_199() {
    let r = json(reference("deepseek2-tiny-yarn-long").join("logits.json"));
    let prompt = ids(&r["prompt_ids"]);
    assert_eq!(prompt.len(), 200);
    let f64_row = &rows(&r["numpy_f64"]["rows"])[0];
    let llama_row: Vec<f64> = r["last_logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    // Chunks of 64 as the oracle ran it: absolute positions across chunks.
    let mut e = engine(64);
    let last = e.forward(&prompt, LogitRows::Last).unwrap();
    let vs_f64 = rel_rms(&last, f64_row);
    let vs_llama = rel_rms(&last, &llama_row);
    eprintln!(
        "yarn-long pos 199: relative RMS vs float64 {vs_f64:.2e}, vs llama.cpp {vs_llama:.4}"
    );
    assert!(vs_f64 < 1e-3, "{vs_f64}");
    assert!(vs_llama < 0.04, "{vs_llama}");
    assert_eq!(argmax32(&last), r["last_argmax"].as_u64().unwrap() as usize);
}

#[test]
fn a_decode_step_equals_the_last_row_of_a_full_prefill_and_chunking_does_not_matter() {
    let r = json(reference("deepseek2-tiny").join("logits.json"));
    let prompt = ids(&r["prompt_ids"]);
    let vocab = 512;
    let whole = engine(256).forward(&prompt, LogitRows::All).unwrap();
    let chunked = engine(5).forward(&prompt, LogitRows::All).unwrap();
    let mut stepwise = engine(1);
    let mut last = Vec::new();
    for &t in &prompt {
        last = stepwise.forward(&[t], LogitRows::Last).unwrap();
    }
    let n = prompt.len();
    let whole_last = &whole[(n - 1) * vocab..];
    for (a, b) in whole.iter().zip(&chunked) {
        assert!((a - b).abs() <= 1e-4 * (1.0 + a.abs()), "{a} vs {b}");
    }
    for (a, b) in whole_last.iter().zip(&last) {
        assert!((a - b).abs() <= 1e-4 * (1.0 + a.abs()), "{a} vs {b}");
    }
}

#[test]
fn a_second_request_on_a_shared_cache_does_not_see_the_first_one() {
    let r = json(reference("deepseek2-tiny").join("logits.json"));
    let prompt = ids(&r["prompt_ids"]);
    let short = &prompt[..6];
    let fresh = engine(256).forward(short, LogitRows::Last).unwrap();
    let mut shared = engine(256);
    let req = GenerateRequest {
        prompt: prompt.clone(),
        max_tokens: 4,
        sampling: SamplingParams::greedy(),
        stop_tokens: vec![],
        stop_strings: vec![],
        want_logits: false,
    };
    shared
        .generate(&req, None, |_| std::ops::ControlFlow::Continue(()))
        .unwrap();
    let req2 = GenerateRequest {
        prompt: short.to_vec(),
        max_tokens: 1,
        ..req
    };
    let mut first = Vec::new();
    shared
        .generate(&req2, None, |ev| {
            first = ev.logits.to_vec();
            std::ops::ControlFlow::Continue(())
        })
        .unwrap();
    assert_eq!(first, fresh);
}
