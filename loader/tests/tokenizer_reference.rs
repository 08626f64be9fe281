//! The deepseek2-tiny reference tokenizer (HF byte-level BPE, /work/shared/reference/deepseek2-tiny)
//! and the GGUF `gpt2` path built from the same vocabulary and merges.

use std::path::{Path, PathBuf};

use loader::gguf::{Metadata, Value, ValueType};
use loader::tokenizer::{StreamDecoder, Tokenizer, TokenizerError};

fn reference_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/reference/deepseek2-tiny")
}

fn reference() -> Tokenizer {
    Tokenizer::from_file(&reference_dir().join("tokenizer.json")).unwrap()
}

const BOS: &str = "<｜begin▁of▁sentence｜>";
const EOS: &str = "<｜end▁of▁sentence｜>";

const TEXTS: &[&str] = &[
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "  two leading spaces, tabs\tand\nnewlines\n\n",
    "numbers 12345 and it's they're we'll",
    "unicode: naïve café 世界 🙂",
    "<｜begin▁of▁sentence｜>with a special<｜end▁of▁sentence｜>",
    "",
];

/// The GGUF keys a converter writes for this vocabulary (types: the two added tokens are control).
fn gguf_metadata() -> Metadata {
    let text = std::fs::read_to_string(reference_dir().join("tokenizer.json")).unwrap();
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    let vocab = doc["model"]["vocab"].as_object().unwrap();
    let mut tokens = vec![String::new(); vocab.len()];
    for (piece, id) in vocab {
        tokens[id.as_u64().unwrap() as usize] = piece.clone();
    }
    let added: Vec<u64> = doc["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_u64().unwrap())
        .collect();
    let merges: Vec<Value> = doc["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            serde_json::Value::String(s) => Value::String(s.clone()),
            pair => Value::String(format!(
                "{} {}",
                pair[0].as_str().unwrap(),
                pair[1].as_str().unwrap()
            )),
        })
        .collect();
    let mut m = Metadata::new();
    m.insert("tokenizer.ggml.model", Value::String("gpt2".into()));
    m.insert("tokenizer.ggml.pre", Value::String("gpt-2".into()));
    m.insert(
        "tokenizer.ggml.tokens",
        Value::Array(
            ValueType::String,
            tokens.into_iter().map(Value::String).collect(),
        ),
    );
    m.insert(
        "tokenizer.ggml.token_type",
        Value::Array(
            ValueType::I32,
            (0..vocab.len() as u64)
                .map(|i| Value::I32(if added.contains(&i) { 3 } else { 1 }))
                .collect(),
        ),
    );
    m.insert(
        "tokenizer.ggml.merges",
        Value::Array(ValueType::String, merges),
    );
    m.insert("tokenizer.ggml.bos_token_id", Value::U32(0));
    m.insert("tokenizer.ggml.eos_token_id", Value::U32(1));
    m.insert("tokenizer.ggml.add_bos_token", Value::Bool(true));
    m
}

#[test]
fn reference_tokenizer_json_loads_and_round_trips_text() {
    let tok = reference();
    // README: 512 tokens (2 added specials, 256 bytes, 254 merges).
    assert_eq!(tok.vocab_size(), 512);
    assert_eq!(tok.piece_to_id(BOS), Some(0));
    assert_eq!(tok.piece_to_id(EOS), Some(1));
    for text in TEXTS {
        let ids = tok.encode(text, true).unwrap();
        assert!(ids.iter().all(|&i| i < 512));
        assert_eq!(tok.decode(&ids, false).unwrap(), *text, "{ids:?}");
    }
    let ids = tok.encode("Hello world", true).unwrap();
    assert!(
        ids.len() < "Hello world".len(),
        "merges were applied: {ids:?}"
    );
    assert_eq!(tok.encode(&format!("{BOS}Hi"), true).unwrap()[0], 0);
    assert!(tok.is_special(0) && tok.is_special(1) && !tok.is_special(ids[0]));
    let with_special = tok.encode(&format!("{BOS}Hi{EOS}"), true).unwrap();
    assert_eq!(tok.decode(&with_special, true).unwrap(), "Hi");
}

#[test]
fn gguf_gpt2_keys_encode_like_the_reference_tokenizer_json() {
    let hf = reference();
    let gguf = Tokenizer::from_gguf(&gguf_metadata()).unwrap();
    assert_eq!(gguf.vocab_size(), 512);
    assert_eq!(
        (gguf.bos_id(), gguf.eos_id(), gguf.add_bos_token()),
        (Some(0), Some(1), Some(true))
    );
    for text in TEXTS {
        for parse_special in [true, false] {
            let a = hf.encode(text, parse_special).unwrap();
            assert_eq!(gguf.encode(text, parse_special).unwrap(), a, "{text:?}");
            assert_eq!(
                gguf.decode(&a, false).unwrap(),
                hf.decode(&a, false).unwrap()
            );
        }
    }
    assert!(!gguf.encode(BOS, false).unwrap().contains(&0));
}

#[test]
fn byte_level_stream_decoding_equals_full_decoding() {
    let tok = reference();
    let text = "unicode: naïve café 世界 🙂 done";
    let ids = tok.encode(text, true).unwrap();
    let mut dec = StreamDecoder::new(&tok, false);
    let mut out = String::new();
    for &id in &ids {
        let chunk = dec.push(id).unwrap();
        assert!(!chunk.contains('\u{FFFD}'), "{chunk:?}");
        out += &chunk;
    }
    out += &dec.finish();
    assert_eq!(out, text);
}

#[test]
fn unknown_gpt2_pre_tokenizer_and_malformed_merges_are_errors() {
    let mut m = gguf_metadata();
    m.insert("tokenizer.ggml.pre", Value::String("qwen2".into()));
    let e = Tokenizer::from_gguf(&m).unwrap_err();
    assert!(
        matches!(e, TokenizerError::UnsupportedPre { ref pre } if pre == "qwen2"),
        "{e}"
    );

    let mut m = gguf_metadata();
    m.insert(
        "tokenizer.ggml.merges",
        Value::Array(ValueType::String, vec![Value::String("nospace".into())]),
    );
    let e = Tokenizer::from_gguf(&m).unwrap_err().to_string();
    assert!(
        e.contains("tokenizer.ggml.merges") && e.contains("nospace"),
        "{e}"
    );
}

#[test]
fn a_missing_tokenizer_file_is_an_error_naming_the_path() {
    let p = reference_dir().join("no-such-tokenizer.json");
    let e = Tokenizer::from_file(&p).unwrap_err().to_string();
    assert!(e.contains("no-such-tokenizer.json"), "{e}");
}

#[test]
fn the_reference_gguf_header_tokenizes_like_its_tokenizer_json() {
    let file = loader::gguf::GgufFile::open(&reference_dir().join("model.gguf")).unwrap();
    let gguf = Tokenizer::from_gguf(&file.metadata).unwrap();
    let hf = reference();
    assert_eq!(gguf.vocab_size(), 512);
    assert_eq!((gguf.bos_id(), gguf.eos_id()), (Some(0), Some(1)));
    for text in TEXTS {
        let ids = hf.encode(text, true).unwrap();
        assert_eq!(gguf.encode(text, true).unwrap(), ids, "{text:?}");
        assert_eq!(gguf.decode(&ids, false).unwrap(), *text);
    }
}
