//! The embedded default model (`tools/default-model`, trained by `train/`) against the third
//! oracle: `train/xing4.py`'s forward in f32 over the same weights, dequantized by llama.cpp's
//! `gguf` package (`train/reference.py` wrote `oracle.json` and `oracle-logits.f32`). Trained
//! weights, not random ones: routing with loud and quiet experts, attention with structure.

mod support;
mod trained_support;

use graph::LogitRows;
use trained_support::{argmax, chat_prompt, engine, load, oracle, rel_rms};

#[test]
fn the_cpu_logits_of_the_trained_default_match_the_training_scripts_forward() {
    let loaded = load();
    let o = oracle();
    let (tokens, vocab, want) = (&o.tokens, o.n_vocab, &o.logits);
    // The Python tokenizer that made the training data and the runtime's agree on the prompt.
    let tok = loaded.tokenizer.as_ref().unwrap();
    assert_eq!(tok.encode(&o.prompt, true).unwrap(), *tokens);

    let got = engine(loaded.model.clone())
        .forward(tokens, LogitRows::All)
        .unwrap();
    assert_eq!(got.len(), want.len());
    let all = rel_rms(&got, want);
    assert!(all < 2e-3, "relative RMS over every position {all:e}");
    for (pos, (g, w)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        let r = rel_rms(g, w);
        assert!(r < 2e-3, "position {pos}: relative RMS {r:e}");
        // Where the oracle's choice is clear, the runtime makes it too.
        let mut order: Vec<usize> = (0..vocab).collect();
        order.sort_by(|&a, &b| w[b].total_cmp(&w[a]));
        if w[order[0]] - w[order[1]] > 1e-2 {
            assert_eq!(argmax(g), order[0], "position {pos}");
        }
    }
    eprintln!("relative RMS against the oracle: {all:e}");
}

#[test]
fn the_default_model_answers_a_chat_turn_in_words_and_ends_it() {
    let loaded = load();
    let tok = loaded.tokenizer.as_ref().unwrap();
    let req = support::greedy_request(chat_prompt(&loaded, "Who is Elizabeth?"), 96, vec![2]);
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
