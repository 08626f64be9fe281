//! Tokenizers: one type over two sources — a Hugging Face `tokenizer.json` (through the `tokenizers`
//! crate) and the `tokenizer.ggml.*` keys of a GGUF header (SentencePiece-style `llama` vocabularies
//! with our own merge loop; byte-level `gpt2` vocabularies rebuilt as a `tokenizers` BPE).

mod gpt2;
mod special;
mod spm;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::gguf::{Metadata, MetadataError};

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp `llama_token_type`).
pub mod token_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot load tokenizer {path}: {message}")]
    Load { path: PathBuf, message: String },
    #[error(transparent)]
    Metadata(#[from] MetadataError),
    #[error("metadata key `{key}`: {message}")]
    Invalid { key: String, message: String },
    #[error(
        "`tokenizer.ggml.model` is {model:?}; supported: \"llama\" (SentencePiece) and \"gpt2\" (byte-level BPE)"
    )]
    UnsupportedModel { model: String },
    #[error(
        "`tokenizer.ggml.pre` is {pre:?}; only the GPT-2 pre-tokenizer (\"default\", \"gpt-2\") is built from GGUF keys — use the release's tokenizer.json"
    )]
    UnsupportedPre { pre: String },
    #[error(
        "character {ch:?} has no piece, no byte-fallback pieces and the vocabulary has no unknown token"
    )]
    Unencodable { ch: char },
    #[error("token id {id} is outside the vocabulary ({vocab_size} tokens)")]
    UnknownId { id: u32, vocab_size: usize },
    #[error("encoding failed: {0}")]
    Encode(String),
    #[error("decoding failed: {0}")]
    Decode(String),
}

enum Backend {
    Hf {
        tok: Box<tokenizers::Tokenizer>,
        /// Same tokenizer with special added tokens encoded as plain text (for `parse_special = false`);
        /// built on first use because most callers never need it.
        literal: OnceLock<Box<tokenizers::Tokenizer>>,
        vocab_size: usize,
    },
    Spm(Box<spm::Spm>),
}

pub struct Tokenizer {
    backend: Backend,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: Option<bool>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.backend {
            Backend::Hf { .. } => "tokenizers",
            Backend::Spm(_) => "gguf-llama",
        };
        f.debug_struct("Tokenizer")
            .field("kind", &kind)
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish()
    }
}

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json`. BOS/EOS and `add_bos_token` come from a
    /// `tokenizer_config.json` beside it when there is one (the tokenizer file itself does not say).
    pub fn from_file(path: &Path) -> Result<Tokenizer, TokenizerError> {
        let load_err = |message: String| TokenizerError::Load {
            path: path.to_path_buf(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|e| load_err(e.to_string()))?;
        let tok: tokenizers::Tokenizer = text.parse().map_err(|e| load_err(format!("{e}")))?;
        let mut out = Self::from_hf(tok);
        if let Some(dir) = path.parent() {
            out.read_tokenizer_config(&dir.join("tokenizer_config.json"))?;
        }
        Ok(out)
    }

    /// Builds the tokenizer from the `tokenizer.ggml.*` keys alone.
    pub fn from_gguf(meta: &Metadata) -> Result<Tokenizer, TokenizerError> {
        let model = meta.get_str("tokenizer.ggml.model")?;
        let n_tokens = meta.get_array("tokenizer.ggml.tokens")?.1.len();
        let special_id = |key: &str| -> Result<Option<u32>, TokenizerError> {
            if !meta.contains(key) {
                return Ok(None);
            }
            let id = meta.get_u32(key)?;
            if id as usize >= n_tokens {
                return Err(TokenizerError::Invalid {
                    key: key.to_string(),
                    message: format!("id {id} is outside the vocabulary ({n_tokens} tokens)"),
                });
            }
            Ok(Some(id))
        };
        let bos = special_id("tokenizer.ggml.bos_token_id")?;
        let eos = special_id("tokenizer.ggml.eos_token_id")?;
        let add_bos = match meta.contains("tokenizer.ggml.add_bos_token") {
            true => Some(meta.get_bool("tokenizer.ggml.add_bos_token")?),
            false => None,
        };
        let backend = match model {
            "llama" => Backend::Spm(Box::new(spm::Spm::from_gguf(meta)?)),
            "gpt2" => {
                let tok = gpt2::from_gguf(meta)?;
                Self::from_hf(tok).backend
            }
            other => {
                return Err(TokenizerError::UnsupportedModel {
                    model: other.to_string(),
                });
            }
        };
        Ok(Tokenizer {
            backend,
            bos,
            eos,
            add_bos,
        })
    }

    fn from_hf(tok: tokenizers::Tokenizer) -> Tokenizer {
        // `get_vocab_size(true)` double-counts added tokens that are also model pieces.
        let vocab_size = tok
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&m| m as usize + 1);
        Tokenizer {
            backend: Backend::Hf {
                tok: Box::new(tok),
                literal: OnceLock::new(),
                vocab_size,
            },
            bos: None,
            eos: None,
            add_bos: None,
        }
    }

    fn read_tokenizer_config(&mut self, path: &Path) -> Result<(), TokenizerError> {
        let Ok(text) = std::fs::read_to_string(path) else {
            return Ok(());
        };
        let cfg: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| TokenizerError::Load {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
        let token_id = |field: &str| -> Option<u32> {
            let v = cfg.get(field)?;
            let s = v
                .as_str()
                .or_else(|| v.get("content").and_then(|c| c.as_str()))?;
            self.piece_to_id(s)
        };
        let (bos, eos) = (token_id("bos_token"), token_id("eos_token"));
        self.bos = bos;
        self.eos = eos;
        self.add_bos = cfg.get("add_bos_token").and_then(|v| v.as_bool());
        Ok(())
    }

    /// Overrides BOS/EOS, e.g. with the ids of the release's `config.json`.
    pub fn with_bos_eos(mut self, bos: Option<u32>, eos: Option<u32>) -> Tokenizer {
        self.bos = bos;
        self.eos = eos;
        self
    }

    /// Encodes without adding BOS/EOS. With `parse_special`, the text of a control/special token
    /// becomes that token; without, it is tokenized as ordinary text (user-defined tokens still match).
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        match &self.backend {
            Backend::Spm(spm) => spm.encode(text, parse_special),
            Backend::Hf { tok, literal, .. } => {
                let tok = if parse_special {
                    tok
                } else {
                    literal.get_or_init(|| {
                        let mut t = tok.clone();
                        t.set_encode_special_tokens(true);
                        t
                    })
                };
                let enc = tok
                    .encode(text, false)
                    .map_err(|e| TokenizerError::Encode(e.to_string()))?;
                Ok(enc.get_ids().to_vec())
            }
        }
    }

    /// The strings `encode` with `parse_special` turns into single tokens: added tokens of a
    /// tokenizer.json (special or not), control, unknown and user-defined pieces of a GGUF
    /// vocabulary.
    pub fn marker_strings(&self) -> Vec<String> {
        match &self.backend {
            Backend::Spm(spm) => spm.marker_pieces(),
            Backend::Hf { tok, .. } => tok
                .get_added_tokens_decoder()
                .into_values()
                .map(|t| t.content)
                .filter(|c| !c.is_empty())
                .collect(),
        }
    }

    /// Encodes `pieces` (text, literal) as one prompt: a piece that is not literal has its
    /// marker strings parsed as tokens (`encode` with `parse_special`); a literal piece, text a
    /// user typed, becomes ordinary pieces only, even where it spells a marker. With a
    /// tokenizer.json each piece is encoded on its own, and a literal's first character apart
    /// from the rest, so that no added token (which the `tokenizers` crate matches even when
    /// not special) can form inside it.
    pub fn encode_prompt(&self, pieces: &[(&str, bool)]) -> Result<Vec<u32>, TokenizerError> {
        match &self.backend {
            Backend::Spm(spm) => spm.encode_pieces(pieces),
            Backend::Hf { .. } => {
                let mut out = Vec::new();
                for &(text, literal) in pieces {
                    if !literal {
                        out.extend(self.encode(text, true)?);
                        continue;
                    }
                    let mut rest = text;
                    // Character by character where a marker could still form.
                    while let Some(c) = rest.chars().next() {
                        let (head, tail) = rest.split_at(c.len_utf8());
                        out.extend(self.encode(head, false)?);
                        let ids = self.encode(tail, false)?;
                        if ids.iter().any(|&id| self.is_added(id)) {
                            rest = tail;
                            continue;
                        }
                        out.extend(ids);
                        break;
                    }
                }
                Ok(out)
            }
        }
    }

    /// Whether `id` is an added token of a tokenizer.json (a control or user-defined piece of a
    /// GGUF vocabulary).
    fn is_added(&self, id: u32) -> bool {
        match &self.backend {
            Backend::Spm(spm) => spm.is_special(id),
            Backend::Hf { tok, .. } => tok.get_added_vocabulary().simple_id_to_token(id).is_some(),
        }
    }

    /// Decodes `ids`; with `skip_special`, control/special tokens produce no text.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        let vocab_size = self.vocab_size();
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab_size) {
            return Err(TokenizerError::UnknownId { id, vocab_size });
        }
        match &self.backend {
            Backend::Spm(spm) => Ok(spm.decode(ids, skip_special)),
            Backend::Hf { tok, .. } => {
                // The tokenizers crate drops ids it cannot map; a hole in the vocabulary is an error here.
                if let Some(&id) = ids.iter().find(|&&id| tok.id_to_token(id).is_none()) {
                    return Err(TokenizerError::UnknownId { id, vocab_size });
                }
                tok.decode(ids, skip_special)
                    .map_err(|e| TokenizerError::Decode(e.to_string()))
            }
        }
    }

    /// The bytes token `id` adds to a text, as a grammar over bytes sees it: a SentencePiece
    /// piece with `▁` as a space, a byte piece as its byte, a byte-level (GPT-2) piece through
    /// the byte alphabet. `None` for a special token (control, unknown, added special), which
    /// is no text.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        if self.is_special(id) {
            return None;
        }
        let piece = self.token_to_piece(id)?;
        let byte_level = match &self.backend {
            Backend::Spm(_) => false,
            Backend::Hf { tok, .. } => matches!(
                tok.get_decoder(),
                Some(tokenizers::DecoderWrapper::ByteLevel(_))
            ),
        };
        if byte_level {
            return piece.chars().map(byte_of_char).collect();
        }
        if let Some(hex) = piece.strip_prefix("<0x").and_then(|r| r.strip_suffix('>'))
            && hex.len() == 2
            && let Ok(b) = u8::from_str_radix(hex, 16)
        {
            return Some(vec![b]);
        }
        Some(piece.replace('\u{2581}', " ").into_bytes())
    }

    /// The vocabulary piece of `id` as stored (`▁Hello`, `<0x0A>`, `<_user>`).
    pub fn token_to_piece(&self, id: u32) -> Option<String> {
        match &self.backend {
            Backend::Spm(spm) => spm.piece(id).map(str::to_string),
            Backend::Hf { tok, .. } => tok.id_to_token(id),
        }
    }

    pub fn piece_to_id(&self, piece: &str) -> Option<u32> {
        match &self.backend {
            Backend::Spm(spm) => spm.piece_to_id(piece),
            Backend::Hf { tok, .. } => tok.token_to_id(piece),
        }
    }

    /// One more than the largest token id.
    pub fn vocab_size(&self) -> usize {
        match &self.backend {
            Backend::Spm(spm) => spm.len(),
            Backend::Hf { vocab_size, .. } => *vocab_size,
        }
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// Whether the source asks for BOS to be prepended (`tokenizer.ggml.add_bos_token`, or
    /// `add_bos_token` in `tokenizer_config.json`); `None` when it does not say.
    pub fn add_bos_token(&self) -> Option<bool> {
        self.add_bos
    }

    /// Control and unknown pieces of a GGUF vocabulary; added tokens marked `special` of a tokenizer.json.
    pub fn is_special(&self, id: u32) -> bool {
        match &self.backend {
            Backend::Spm(spm) => spm.is_special(id),
            Backend::Hf { tok, .. } => tok
                .get_added_vocabulary()
                .simple_id_to_token(id)
                .is_some_and(|t| tok.get_added_vocabulary().is_special_token(&t)),
        }
    }
}

/// Incremental detokenizer for streaming. Each `push` returns the text that became final with that
/// id; text that still ends in an incomplete UTF-8 sequence (a byte-fallback piece waiting for its
/// continuation bytes) is held back. The concatenation of all returned text plus `finish()` equals
/// `decode` of all ids. `T` is how the tokenizer is held: `&Tokenizer`, or an `Arc` for a
/// decoder that outlives the caller's borrow (one per sequence of a batch).
pub struct StreamDecoder<T: std::ops::Deref<Target = Tokenizer>> {
    tok: T,
    skip_special: bool,
    ids: Vec<u32>,
    /// `ids[..read]` has been emitted; `ids[prefix..read]` is decoded again as left context so
    /// that decoders that look at neighbours (leading-space stripping, byte runs) stay consistent.
    prefix: usize,
    read: usize,
}

impl<T: std::ops::Deref<Target = Tokenizer>> StreamDecoder<T> {
    pub fn new(tok: T, skip_special: bool) -> Self {
        StreamDecoder {
            tok,
            skip_special,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }

    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        let vocab_size = self.tok.vocab_size();
        if id as usize >= vocab_size {
            return Err(TokenizerError::UnknownId { id, vocab_size });
        }
        self.ids.push(id);
        let (before, now) = self.window()?;
        if now.len() <= before.len() || now.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let fresh = new_suffix(&before, &now);
        // Only the last emitted id is needed as context from here on.
        self.ids.drain(..self.read);
        self.prefix = 0;
        self.read = self.ids.len();
        Ok(fresh)
    }

    /// Flushes whatever is held back (an incomplete sequence decodes to U+FFFD) and resets.
    pub fn finish(&mut self) -> String {
        let fresh = match self.window() {
            Ok((before, now)) => new_suffix(&before, &now),
            Err(_) => String::new(),
        };
        self.ids.clear();
        self.prefix = 0;
        self.read = 0;
        fresh
    }

    fn window(&self) -> Result<(String, String), TokenizerError> {
        let before = self
            .tok
            .decode(&self.ids[self.prefix..self.read], self.skip_special)?;
        let now = self
            .tok
            .decode(&self.ids[self.prefix..], self.skip_special)?;
        Ok((before, now))
    }
}

/// The byte a GPT-2 byte-level character stands for: printable Latin-1 bytes are themselves,
/// the other 68 bytes are U+0100 onwards in byte order.
fn byte_of_char(c: char) -> Option<u8> {
    let printable = |b: u32| {
        (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    let c = c as u32;
    if c < 0x100 {
        return printable(c).then_some(c as u8);
    }
    (0u32..256)
        .filter(|&b| !printable(b))
        .nth((c - 0x100) as usize)
        .map(|b| b as u8)
}

fn new_suffix(before: &str, now: &str) -> String {
    match now.strip_prefix(before) {
        Some(rest) => rest.to_string(),
        None => {
            let common = before
                .char_indices()
                .zip(now.chars())
                .find(|((_, a), b)| a != b)
                .map_or(before.len().min(now.len()), |((i, _), _)| i);
            now.get(common..).unwrap_or_default().to_string()
        }
    }
}

/// The merge list under which a tokenizer.json BPE model (rank order) tokenizes exactly like
/// `from_gguf` does for a `llama` vocabulary (score order): every split of every normal piece into two
/// normal pieces, ordered by the merged piece's score (best first), then id, then split position.
/// A list with only one merge per piece disagrees with score-greedy merging (e.g. `▁is` from
/// `▁i`+`s` when `i`+`s` ranks earlier).
pub fn sentencepiece_merges(
    tokens: &[String],
    scores: &[f32],
    types: &[i32],
) -> Vec<(String, String)> {
    let normal: std::collections::HashSet<&str> = tokens
        .iter()
        .zip(types)
        .filter(|(_, t)| **t == token_type::NORMAL)
        .map(|(p, _)| p.as_str())
        .collect();
    let mut found: Vec<(f32, usize, usize, &str, &str)> = Vec::new();
    for (id, ((piece, &ty), &score)) in tokens.iter().zip(types).zip(scores).enumerate() {
        if ty != token_type::NORMAL {
            continue;
        }
        for (cut, _) in piece.char_indices().skip(1) {
            let (a, b) = piece.split_at(cut);
            if normal.contains(a) && normal.contains(b) {
                found.push((score, id, cut, a, b));
            }
        }
    }
    found.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
    found
        .into_iter()
        .map(|(_, _, _, a, b)| (a.to_string(), b.to_string()))
        .collect()
}
