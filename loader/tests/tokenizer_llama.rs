//! The GGUF "llama" (SentencePiece-style) tokenizer against an equivalent Hugging Face
//! tokenizer.json (BPE + byte fallback + Metaspace "first"), on a small vocabulary with the
//! released special-token layout (MODEL.md §8).

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use loader::gguf::{Metadata, Value, ValueType};
use loader::tokenizer::{StreamDecoder, Tokenizer, TokenizerError, sentencepiece_merges};
use serde_json::json;

const SPECIALS: [&str; 24] = [
    "<_unk>",
    "<_start>",
    "<_end>",
    "<_pad>",
    "<_user>",
    "<_bot>",
    "<_system>",
    "<_observation>",
    "<_sep>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<_control1>",
    "<_control2>",
    "<_control3>",
    "<_control4>",
    "<_control5>",
    "<_control6>",
    "<_control7>",
    "<_control8>",
    "<_control9>",
];

/// Pieces are created by these merges in order; a created piece's score is -(its rank).
const CREATED: &[(&str, &str)] = &[
    ("▁", "t"),
    ("h", "e"),
    ("▁t", "he"),
    ("t", "he"),
    ("i", "s"),
    ("▁", "i"),
    ("▁i", "s"),
    ("▁", "c"),
    ("a", "p"),
    ("▁c", "ap"),
    ("i", "t"),
    ("a", "l"),
    ("it", "al"),
    ("▁cap", "ital"),
    ("▁", "o"),
    ("▁o", "f"),
    ("▁", "F"),
    ("r", "a"),
    ("n", "c"),
    ("▁F", "ra"),
    ("▁Fra", "nc"),
    ("▁Franc", "e"),
    ("W", "h"),
    ("a", "t"),
    ("Wh", "at"),
    ("▁", "W"),
    ("▁W", "h"),
    ("▁Wh", "at"),
    ("l", "o"),
    ("l", "lo"),
    ("e", "llo"),
    ("H", "ello"),
    ("▁", "H"),
    ("▁H", "ello"),
    ("▁", "w"),
    ("o", "r"),
    ("▁w", "or"),
    ("l", "d"),
    ("▁wor", "ld"),
    ("▁", "▁"),
    ("e", "r"),
    ("▁the", "at"),
    ("e", "at"),
    ("P", "a"),
    ("r", "i"),
    ("ri", "s"),
    ("Pa", "ris"),
    ("A", "n"),
    ("An", "d"),
    ("▁", "A"),
    ("▁A", "nd"),
    ("n", "d"),
    ("▁", "J"),
    ("a", "n"),
    ("▁J", "ap"),
    ("▁Jap", "an"),
    ("i", "n"),
    ("▁", "l"),
    ("▁l", "in"),
    ("▁lin", "e"),
    ("o", "n"),
    ("on", "e"),
    ("▁", "one"),
];

const BASE: &str = "▁abcdefghijklmnopqrstuvwxyzAFHJPTW?.,!'0123456789";

struct Vocab {
    tokens: Vec<String>,
    scores: Vec<f32>,
    types: Vec<i32>,
    /// Every split of every piece into two normal pieces, best score first (how HF's SentencePiece
    /// converter lists merges); with only the creating merge per piece the two sources disagree.
    merges: Vec<(String, String)>,
}

fn vocab() -> Vocab {
    let mut v = Vocab {
        tokens: vec![],
        scores: vec![],
        types: vec![],
        merges: vec![],
    };
    for (i, s) in SPECIALS.iter().enumerate() {
        v.tokens.push(s.to_string());
        v.scores.push(0.0);
        v.types.push(if i == 0 { 2 } else { 3 });
    }
    for i in 24..140 {
        v.tokens.push(format!("<_unused{i}>"));
        v.scores.push(0.0);
        v.types.push(3);
    }
    for b in 0..=255u8 {
        v.tokens.push(format!("<0x{b:02X}>"));
        v.scores.push(0.0);
        v.types.push(6);
    }
    assert_eq!(v.tokens.len(), 396);
    for c in BASE.chars() {
        v.tokens.push(c.to_string());
        v.scores.push(-1000.0);
        v.types.push(1);
    }
    for (rank, (a, b)) in CREATED.iter().enumerate() {
        let p = format!("{a}{b}");
        assert!(!v.tokens.contains(&p), "fixture creates {p:?} twice");
        v.tokens.push(p);
        v.scores.push(-(rank as f32));
        v.types.push(1);
    }
    v.merges = sentencepiece_merges(&v.tokens, &v.scores, &v.types);
    v
}

fn metadata(v: &Vocab) -> Metadata {
    let mut m = Metadata::new();
    m.insert("tokenizer.ggml.model", Value::String("llama".into()));
    m.insert(
        "tokenizer.ggml.tokens",
        Value::Array(
            ValueType::String,
            v.tokens.iter().map(|t| Value::String(t.clone())).collect(),
        ),
    );
    m.insert(
        "tokenizer.ggml.scores",
        Value::Array(
            ValueType::F32,
            v.scores.iter().map(|&s| Value::F32(s)).collect(),
        ),
    );
    m.insert(
        "tokenizer.ggml.token_type",
        Value::Array(
            ValueType::I32,
            v.types.iter().map(|&t| Value::I32(t)).collect(),
        ),
    );
    m.insert("tokenizer.ggml.bos_token_id", Value::U32(1));
    m.insert("tokenizer.ggml.eos_token_id", Value::U32(2));
    m.insert("tokenizer.ggml.unknown_token_id", Value::U32(0));
    m
}

fn tokenizer_json(v: &Vocab) -> serde_json::Value {
    let vocab: serde_json::Map<String, serde_json::Value> = v
        .tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let added: Vec<_> = v
        .tokens
        .iter()
        .zip(&v.types)
        .enumerate()
        .filter(|(_, (_, ty))| matches!(ty, 2 | 3))
        .map(|(i, (t, _))| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": true})
        })
        .collect();
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false},
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}
        ]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<_unk>", "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": vocab, "merges": v.merges.iter().map(|(a, b)| json!([a, b])).collect::<Vec<_>>()}
    })
}

fn temp_dir(name: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("loader-{name}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn both() -> (Tokenizer, Tokenizer) {
    let v = vocab();
    let dir = temp_dir("tokenizer-llama");
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, serde_json::to_string(&tokenizer_json(&v)).unwrap()).unwrap();
    let hf = Tokenizer::from_file(&path).unwrap();
    let gguf = Tokenizer::from_gguf(&metadata(&v)).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    (hf, gguf)
}

const TEXTS: &[&str] = &[
    "What is the capital of France?",
    "Hello world",
    "the theater line one",
    "  leading spaces and  double   inside ",
    "naïve café — 世界 🙂!",
    "<_user>What is the capital of France?<_bot><think>\n",
    "<_system><_user>Hi<_bot></think>Paris.<_end>\n<_user>And Japan?<_bot><think>\n",
    "a <_use b <_user",
    "<_sep><_observation>x</tool_response>",
    "line one\nline two\n\n",
    "Xylophone QUIZ",
    "",
];

#[test]
fn gguf_llama_and_tokenizer_json_encode_every_text_to_the_same_ids() {
    let (hf, gguf) = both();
    for text in TEXTS {
        for parse_special in [true, false] {
            let a = hf.encode(text, parse_special).unwrap();
            let b = gguf.encode(text, parse_special).unwrap();
            assert_eq!(a, b, "{text:?} parse_special={parse_special}");
        }
    }
}

#[test]
fn merges_listing_one_split_per_piece_would_disagree_with_score_order() {
    // Pins why `sentencepiece_merges` lists every split: `i`+`s` (rank 4) outranks `▁`+`i` (rank 5),
    // so rank-ordered BPE with only the creating merges stops at [▁, is] while score-greedy merging
    // continues to `▁is` (score -6) through `▁`+`is`.
    let mut v = vocab();
    v.merges = CREATED
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    let dir = temp_dir("tokenizer-llama-one-merge");
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, serde_json::to_string(&tokenizer_json(&v)).unwrap()).unwrap();
    let hf = Tokenizer::from_file(&path).unwrap();
    let gguf = Tokenizer::from_gguf(&metadata(&v)).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let id = |p: &str| gguf.piece_to_id(p).unwrap();
    assert_eq!(gguf.encode(" is", true).unwrap(), [id("▁is")]);
    assert_eq!(hf.encode(" is", true).unwrap(), [id("▁"), id("is")]);
}

#[test]
fn both_sources_decode_back_to_the_text() {
    let (hf, gguf) = both();
    for text in TEXTS {
        let ids = gguf.encode(text, true).unwrap();
        let a = hf.decode(&ids, false).unwrap();
        let b = gguf.decode(&ids, false).unwrap();
        assert_eq!(a, b, "{text:?}");
        // The decoder strips the one leading space that encoding may prepend, so only text not
        // starting with a space comes back verbatim.
        if !text.starts_with(' ') {
            assert_eq!(b, *text);
        }
    }
}

#[test]
fn words_that_are_pieces_encode_to_those_pieces() {
    let (_, gguf) = both();
    let id = |p: &str| gguf.piece_to_id(p).unwrap();
    assert_eq!(
        gguf.encode("What is the capital of France?", true).unwrap(),
        [
            id("▁What"),
            id("▁is"),
            id("▁the"),
            id("▁capital"),
            id("▁of"),
            id("▁France"),
            id("?")
        ]
    );
    // After a special token no `▁` is prepended (Metaspace "first").
    assert_eq!(
        gguf.encode("<_user>What is<_bot>", true).unwrap(),
        [4, id("What"), id("▁is"), 5]
    );
    // A character outside the vocabulary falls back to its UTF-8 bytes (ids 140 + byte).
    assert_eq!(
        gguf.encode("é", true).unwrap(),
        [id("▁"), 140 + 0xC3, 140 + 0xA9]
    );
    assert_eq!(gguf.encode("\n", true).unwrap(), [id("▁"), 140 + 0x0A]);
}

#[test]
fn special_token_text_is_plain_text_without_parse_special() {
    let (hf, gguf) = both();
    for tok in [&hf, &gguf] {
        assert_eq!(tok.encode("<_bot>", true).unwrap(), [5]);
        let literal = tok.encode("<_bot>", false).unwrap();
        assert!(!literal.contains(&5), "{literal:?}");
        assert_eq!(tok.decode(&literal, false).unwrap(), "<_bot>");
    }
}

#[test]
fn special_ids_and_flags_follow_the_layout() {
    let (_, gguf) = both();
    assert_eq!(gguf.bos_id(), Some(1));
    assert_eq!(gguf.eos_id(), Some(2));
    assert_eq!(gguf.vocab_size(), vocab().tokens.len());
    assert_eq!(gguf.piece_to_id("<think>"), Some(9));
    assert_eq!(gguf.token_to_piece(10).as_deref(), Some("</think>"));
    assert_eq!(gguf.token_to_piece(140 + 0x41).as_deref(), Some("<0x41>"));
    assert!(gguf.is_special(2) && gguf.is_special(7) && gguf.is_special(0));
    assert!(!gguf.is_special(140) && !gguf.is_special(gguf.piece_to_id("▁the").unwrap()));
    let (hf, _) = both();
    assert!(hf.is_special(5) && !hf.is_special(hf.piece_to_id("▁the").unwrap()));
}

#[test]
fn skip_special_drops_control_tokens_from_decoded_text() {
    let (hf, gguf) = both();
    for tok in [&hf, &gguf] {
        let ids = tok.encode("<_user>Hello world<_end>", true).unwrap();
        assert_eq!(tok.decode(&ids, true).unwrap(), "Hello world");
        assert_eq!(tok.decode(&ids, false).unwrap(), "<_user>Hello world<_end>");
    }
}

#[test]
fn decoding_an_id_outside_the_vocabulary_is_an_error_naming_it() {
    let (hf, gguf) = both();
    for tok in [&hf, &gguf] {
        let e = tok.decode(&[4, 99_999], false).unwrap_err();
        assert!(
            matches!(e, TokenizerError::UnknownId { id: 99_999, .. }),
            "{e}"
        );
        assert!(StreamDecoder::new(tok, false).push(99_999).is_err());
    }
}

#[test]
fn stream_decoder_holds_back_partial_utf8_and_matches_full_decode() {
    let (hf, gguf) = both();
    for tok in [&hf, &gguf] {
        let text = "naïve 🙂 世界! Hello world";
        let ids = tok.encode(text, true).unwrap();
        let mut dec = StreamDecoder::new(tok, false);
        let mut chunks = vec![];
        for &id in &ids {
            chunks.push(dec.push(id).unwrap());
        }
        chunks.push(dec.finish());
        assert!(chunks.iter().all(|c| !c.contains('\u{FFFD}')), "{chunks:?}");
        assert_eq!(chunks.concat(), tok.decode(&ids, false).unwrap());
        assert_eq!(chunks.concat(), text);

        // The emoji is four byte pieces: nothing comes out until the fourth.
        let mut dec = StreamDecoder::new(tok, false);
        let emoji: Vec<u32> = "🙂".bytes().map(|b| 140 + b as u32).collect();
        let out: Vec<String> = emoji.iter().map(|&id| dec.push(id).unwrap()).collect();
        assert_eq!(out, ["", "", "", "🙂"]);
    }
}

#[test]
fn stream_decoder_keeps_spaces_between_pieces_and_skips_specials() {
    let (_, gguf) = both();
    let ids = gguf.encode("<_bot>Hello world<_end>", true).unwrap();
    let mut dec = StreamDecoder::new(&gguf, true);
    let out: Vec<String> = ids.iter().map(|&id| dec.push(id).unwrap()).collect();
    assert_eq!(out.concat() + &dec.finish(), "Hello world");
    assert!(out.contains(&" world".to_string()), "{out:?}");
}

#[test]
fn an_incomplete_sequence_is_flushed_by_finish() {
    let (_, gguf) = both();
    let mut dec = StreamDecoder::new(&gguf, false);
    assert_eq!(dec.push(140 + 0xE4).unwrap(), "");
    assert_eq!(dec.finish(), "\u{FFFD}");
}

#[test]
fn gguf_vocabulary_errors_name_the_key() {
    let v = vocab();
    let mut m = metadata(&v);
    m.insert(
        "tokenizer.ggml.scores",
        Value::Array(ValueType::F32, vec![Value::F32(0.0); 3]),
    );
    let e = Tokenizer::from_gguf(&m).unwrap_err().to_string();
    assert!(
        e.contains("tokenizer.ggml.scores") && e.contains('3'),
        "{e}"
    );

    let mut m = metadata(&v);
    let mut types: Vec<Value> = v.types.iter().map(|&t| Value::I32(t)).collect();
    types[500] = Value::I32(9);
    m.insert(
        "tokenizer.ggml.token_type",
        Value::Array(ValueType::I32, types),
    );
    let e = Tokenizer::from_gguf(&m).unwrap_err().to_string();
    assert!(
        e.contains("tokenizer.ggml.token_type") && e.contains("500"),
        "{e}"
    );

    let mut m = metadata(&v);
    m.insert("tokenizer.ggml.eos_token_id", Value::U32(1 << 20));
    let e = Tokenizer::from_gguf(&m).unwrap_err().to_string();
    assert!(e.contains("tokenizer.ggml.eos_token_id"), "{e}");

    let mut m = metadata(&v);
    m.insert("tokenizer.ggml.model", Value::String("bert".into()));
    let e = Tokenizer::from_gguf(&m).unwrap_err();
    assert!(
        matches!(e, TokenizerError::UnsupportedModel { ref model } if model == "bert"),
        "{e}"
    );

    let mut m = metadata(&v);
    m.insert("tokenizer.ggml.tokens", Value::U32(1));
    let e = Tokenizer::from_gguf(&m).unwrap_err().to_string();
    assert!(e.contains("tokenizer.ggml.tokens"), "{e}");
}
