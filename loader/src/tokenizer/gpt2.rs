//! Byte-level BPE vocabularies from GGUF (`tokenizer.ggml.model = "gpt2"`), rebuilt as a
//! `tokenizers` BPE so that encoding follows the crate's byte-level pipeline exactly.

use serde_json::{Map, Value as Json, json};

use super::TokenizerError;
use super::token_type as tt;
use crate::gguf::Metadata;

pub(super) fn from_gguf(meta: &Metadata) -> Result<tokenizers::Tokenizer, TokenizerError> {
    const TOKENS: &str = "tokenizer.ggml.tokens";
    const TYPES: &str = "tokenizer.ggml.token_type";
    const MERGES: &str = "tokenizer.ggml.merges";
    let invalid = |key: &str, message: String| TokenizerError::Invalid {
        key: key.to_string(),
        message,
    };

    // llama.cpp knows many pre-tokenizer regexes by name; only the GPT-2 one is reproduced here.
    if meta.contains("tokenizer.ggml.pre") {
        let pre = meta.get_str("tokenizer.ggml.pre")?;
        if !matches!(pre, "default" | "gpt-2" | "gpt2") {
            return Err(TokenizerError::UnsupportedPre {
                pre: pre.to_string(),
            });
        }
    }

    let tokens = meta.get_string_array(TOKENS)?;
    let types = if meta.contains(TYPES) {
        let t = meta.get_i64_array(TYPES)?;
        if t.len() != tokens.len() {
            return Err(invalid(
                TYPES,
                format!("has {} entries but {TOKENS} has {}", t.len(), tokens.len()),
            ));
        }
        t
    } else {
        vec![tt::NORMAL as i64; tokens.len()]
    };

    let mut vocab = Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, (&tok, &ty)) in tokens.iter().zip(&types).enumerate() {
        vocab.insert(tok.to_string(), json!(id));
        let special = match ty as i32 {
            tt::CONTROL | tt::UNKNOWN => true,
            tt::USER_DEFINED => false,
            _ => continue,
        };
        added.push(json!({
            "id": id, "content": tok, "single_word": false, "lstrip": false, "rstrip": false,
            "normalized": false, "special": special,
        }));
    }

    let merges = meta
        .get_string_array(MERGES)?
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            m.split_once(' ')
                .map(|(a, b)| json!([a, b]))
                .ok_or_else(|| invalid(MERGES, format!("entry {i} {m:?} is not \"left right\"")))
        })
        .collect::<Result<Vec<_>, _>>()?;

    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let doc = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": Json::Object(vocab), "merges": merges,
        },
    });
    serde_json::from_value(doc).map_err(|e| invalid(MERGES, format!("vocabulary rejected: {e}")))
}
