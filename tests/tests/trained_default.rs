//! The embedded default model (`tools/default-model`, trained by `train/`) against the third
//! oracle: `train/xing4.py`'s forward in f32 over the same weights, dequantized by llama.cpp's
//! `gguf` package (`train/reference.py` wrote `oracle.json` and `oracle-logits.f32`). Trained
//! weights, not random ones: routing with loud and quiet experts, attention with structure.

use std::path::PathBuf;
use std::sync::Arc;

use engine::{Engine, EngineConfig, GenerateRequest, Model, SamplingParams};
use graph::LogitRows;
use loader::chat::ChatMessage;
use models::Loaded;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tools/default-model")
}

fn load() -> Loaded {
    let d = dir();
    models::load(&d.join("model.gguf"), Some(&d), false).unwrap_or_else(|e| panic!("{e:#}"))
}

fn engine(model: Arc<Model>) -> Engine {
    let config = EngineConfig {
        max_model_len: 256,
        ..EngineConfig::default()
    };
    Engine::new(model, config).unwrap()
}

#[test]
fn the_cpu_logits_of_the_trained_default_match_the_training_scripts_forward() {
    let loaded = load();
    let oracle: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir().join("oracle.json")).unwrap()).unwrap();
    let tokens: Vec<u32> = oracle["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    // The Python tokenizer that made the training data and the runtime's agree on the prompt.
    let tok = loaded.tokenizer.as_ref().unwrap();
    let prompt = oracle["prompt"].as_str().unwrap();
    assert_eq!(tok.encode(prompt, true).unwrap(), tokens);

    let vocab = oracle["n_vocab"].as_u64().unwrap() as usize;
    let bytes = std::fs::read(dir().join("oracle-logits.f32")).unwrap();
    let want: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(want.len(), tokens.len() * vocab);

    let got = engine(loaded.model.clone())
        .forward(&tokens, LogitRows::All)
        .unwrap();
    assert_eq!(got.len(), want.len());
    let rel_rms = |a: &[f32], b: &[f32]| {
        let (mut d, mut n) = (0f64, 0f64);
        for (x, y) in a.iter().zip(b) {
            d += (*x as f64 - *y as f64).powi(2);
            n += (*y as f64).powi(2);
        }
        (d / n).sqrt()
    };
    let all = rel_rms(&got, &want);
    assert!(all < 2e-3, "relative RMS over every position {all:e}");
    for (pos, (g, w)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        let r = rel_rms(g, w);
        assert!(r < 2e-3, "position {pos}: relative RMS {r:e}");
        // Where the oracle's choice is clear, the runtime makes it too.
        let mut order: Vec<usize> = (0..vocab).collect();
        order.sort_by(|&a, &b| w[b].total_cmp(&w[a]));
        if w[order[0]] - w[order[1]] > 1e-2 {
            let argmax = (0..vocab).max_by(|&a, &b| g[a].total_cmp(&g[b])).unwrap();
            assert_eq!(argmax, order[0], "position {pos}");
        }
    }
    eprintln!("relative RMS against the oracle: {all:e}");
}

#[test]
fn the_default_model_answers_a_chat_turn_in_words_and_ends_it() {
    let loaded = load();
    let tok = loaded.tokenizer.as_ref().unwrap();
    let tpl = loaded.chat_template.as_ref().unwrap();
    let text = tpl
        .render(
            &[ChatMessage::new("user", "Who is Elizabeth?")],
            true,
            true,
            None,
        )
        .unwrap();
    let req = GenerateRequest {
        prompt: tok.encode(&text, true).unwrap(),
        max_tokens: 96,
        sampling: SamplingParams::greedy(),
        stop_tokens: vec![2],
        stop_strings: vec![],
        want_logits: false,
    };
    let out = engine(loaded.model.clone())
        .generate(&req, Some(tok), |_| std::ops::ControlFlow::Continue(()))
        .unwrap();
    let answer = out.text.rsplit("</think>").next().unwrap_or("").trim();
    eprintln!("answer: {answer:?}");
    // The turn ends by itself (the chat format was learned), in words of letters and
    // punctuation, at the end of a sentence. Random weights fail each of these.
    assert_eq!(out.finish, engine::FinishReason::Stop, "{answer:?}");
    let words: Vec<&str> = answer.split_whitespace().collect();
    assert!(words.len() >= 5, "{answer:?}");
    for w in &words {
        assert!(
            w.chars()
                .all(|c| c.is_ascii_alphabetic() || ",.;:'!?-\"()".contains(c)),
            "{w:?} in {answer:?}"
        );
    }
    assert!(answer.ends_with(['.', '!', '?', '"']), "{answer:?}");
}
