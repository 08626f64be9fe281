//! SentencePiece-style vocabularies from GGUF (`tokenizer.ggml.model = "llama"`): pieces with
//! scores, merged greedily by the score of the merged piece (llama.cpp's SPM tokenizer).
//!
//! Two choices follow the Hugging Face tokenizer.json of the same vocabulary (a BPE model with
//! byte fallback and a Metaspace pre-tokenizer with `prepend_scheme: "first"`) rather than llama.cpp,
//! so both sources give the same ids: `▁` is prepended only at the very start of the input (llama.cpp
//! also prepends after every special token), and a character that is not a piece becomes byte
//! pieces that take part in no merge (llama.cpp may still merge it into a longer piece).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use super::TokenizerError;
use super::special::{Fragment, Matcher};
use super::token_type as tt;
use crate::gguf::Metadata;

const SPACE: char = '\u{2581}';

pub(super) struct Spm {
    pieces: Vec<String>,
    types: Vec<i32>,
    scores: Vec<f32>,
    /// Normal pieces: the only ones a merge may produce or start from.
    normal: HashMap<String, u32>,
    /// Every piece, first id wins (for `piece_to_id`).
    all: HashMap<String, u32>,
    byte_ids: [Option<u32>; 256],
    unk: Option<u32>,
    add_space_prefix: bool,
    /// Control, unknown and user-defined pieces (`parse_special`).
    specials: Matcher,
    /// User-defined pieces only (matched even without `parse_special`).
    user_defined: Matcher,
}

/// `<0xAB>` → 0xAB.
fn byte_piece(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

impl Spm {
    pub(super) fn from_gguf(meta: &Metadata) -> Result<Spm, TokenizerError> {
        const TOKENS: &str = "tokenizer.ggml.tokens";
        const SCORES: &str = "tokenizer.ggml.scores";
        const TYPES: &str = "tokenizer.ggml.token_type";
        let invalid = |key: &str, message: String| TokenizerError::Invalid {
            key: key.to_string(),
            message,
        };
        let pieces: Vec<String> = meta
            .get_string_array(TOKENS)?
            .into_iter()
            .map(str::to_string)
            .collect();
        let n = pieces.len();
        if n == 0 || n > u32::MAX as usize {
            return Err(invalid(TOKENS, format!("holds {n} tokens")));
        }
        let scores = meta.get_f32_array(SCORES)?;
        if scores.len() != n {
            return Err(invalid(
                SCORES,
                format!("has {} entries but {TOKENS} has {n}", scores.len()),
            ));
        }
        let types: Vec<i32> = if meta.contains(TYPES) {
            let raw = meta.get_i64_array(TYPES)?;
            if raw.len() != n {
                return Err(invalid(
                    TYPES,
                    format!("has {} entries but {TOKENS} has {n}", raw.len()),
                ));
            }
            raw.iter()
                .enumerate()
                .map(|(i, &t)| match t {
                    1..=6 => Ok(t as i32),
                    _ => Err(invalid(
                        TYPES,
                        format!("entry {i} is {t}; expected 1..=6 (normal, unknown, control, user-defined, unused, byte)"),
                    )),
                })
                .collect::<Result<_, _>>()?
        } else {
            // Without types, byte pieces are still recognisable by their spelling.
            pieces
                .iter()
                .map(|p| match byte_piece(p) {
                    Some(_) => tt::BYTE,
                    None => tt::NORMAL,
                })
                .collect()
        };

        let mut normal = HashMap::new();
        let mut all = HashMap::with_capacity(n);
        let mut byte_ids = [None; 256];
        for (id, (piece, &ty)) in pieces.iter().zip(&types).enumerate() {
            let id = id as u32;
            all.entry(piece.clone()).or_insert(id);
            match ty {
                tt::NORMAL => {
                    normal.entry(piece.clone()).or_insert(id);
                }
                tt::BYTE => {
                    let b = byte_piece(piece).ok_or_else(|| {
                        invalid(
                            TYPES,
                            format!("token {id} {piece:?} has type byte but is not spelled <0xHH>"),
                        )
                    })?;
                    byte_ids[b as usize].get_or_insert(id);
                }
                _ => {}
            }
        }

        let unk = if meta.contains("tokenizer.ggml.unknown_token_id") {
            let id = meta.get_u32("tokenizer.ggml.unknown_token_id")?;
            if id as usize >= n {
                return Err(invalid(
                    "tokenizer.ggml.unknown_token_id",
                    format!("id {id} is outside the vocabulary ({n} tokens)"),
                ));
            }
            Some(id)
        } else {
            types
                .iter()
                .position(|&t| t == tt::UNKNOWN)
                .map(|i| i as u32)
        };
        let add_space_prefix = match meta.contains("tokenizer.ggml.add_space_prefix") {
            true => meta.get_bool("tokenizer.ggml.add_space_prefix")?,
            false => true,
        };

        let with_types = |wanted: &[i32]| {
            Matcher::new(
                pieces
                    .iter()
                    .zip(&types)
                    .enumerate()
                    .filter(|(_, (_, t))| wanted.contains(t))
                    .map(|(id, (p, _))| (p.as_str(), id as u32)),
            )
        };
        let specials = with_types(&[tt::CONTROL, tt::UNKNOWN, tt::USER_DEFINED]);
        let user_defined = with_types(&[tt::USER_DEFINED]);

        Ok(Spm {
            pieces,
            types,
            scores,
            normal,
            all,
            byte_ids,
            unk,
            add_space_prefix,
            specials,
            user_defined,
        })
    }

    pub(super) fn len(&self) -> usize {
        self.pieces.len()
    }

    pub(super) fn piece(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(String::as_str)
    }

    pub(super) fn piece_to_id(&self, piece: &str) -> Option<u32> {
        self.all.get(piece).copied()
    }

    pub(super) fn is_special(&self, id: u32) -> bool {
        matches!(
            self.types.get(id as usize),
            Some(&tt::CONTROL | &tt::UNKNOWN)
        )
    }

    /// The strings `encode` with `parse_special` turns into single tokens.
    pub(super) fn marker_pieces(&self) -> Vec<String> {
        self.pieces
            .iter()
            .zip(&self.types)
            .filter(|(_, t)| matches!(**t, tt::CONTROL | tt::UNKNOWN | tt::USER_DEFINED))
            .map(|(p, _)| p.clone())
            .collect()
    }

    pub(super) fn encode(
        &self,
        text: &str,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let matcher = if parse_special {
            &self.specials
        } else {
            &self.user_defined
        };
        self.encode_fragments(matcher.split(text))
    }

    /// `pieces` as one text: template pieces with their markers as tokens, literal pieces as
    /// ordinary pieces only (no marker of any type is matched inside them). Offsets stay those
    /// of the whole text, so the space prefix goes where `encode` of the whole would put it.
    pub(super) fn encode_pieces(
        &self,
        pieces: &[(&str, bool)],
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut fragments = Vec::new();
        let mut offset = 0;
        for &(text, literal) in pieces {
            if literal {
                if !text.is_empty() {
                    fragments.push(Fragment::Text(offset, text));
                }
            } else {
                for f in self.specials.split(text) {
                    fragments.push(match f {
                        Fragment::Text(o, t) => Fragment::Text(offset + o, t),
                        token => token,
                    });
                }
            }
            offset += text.len();
        }
        self.encode_fragments(fragments)
    }

    fn encode_fragments(&self, fragments: Vec<Fragment<'_>>) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::new();
        for fragment in fragments {
            match fragment {
                Fragment::Token(id) => out.push(id),
                Fragment::Text(offset, s) => {
                    let mut seg = String::with_capacity(s.len() + 3);
                    if self.add_space_prefix
                        && offset == 0
                        && !s.starts_with(' ')
                        && !s.starts_with(SPACE)
                    {
                        seg.push(SPACE);
                    }
                    seg.extend(s.chars().map(|c| if c == ' ' { SPACE } else { c }));
                    self.encode_segment(&seg, &mut out)?;
                }
            }
        }
        Ok(out)
    }

    fn encode_segment(&self, seg: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        let mut syms: Vec<Symbol> = Vec::with_capacity(seg.len());
        for (start, ch) in seg.char_indices() {
            let i = syms.len() as isize;
            syms.push(Symbol {
                start,
                len: ch.len_utf8(),
                prev: i - 1,
                next: i + 1,
                known: self.normal.contains_key(&seg[start..start + ch.len_utf8()]),
            });
        }
        if let Some(last) = syms.last_mut() {
            last.next = -1;
        }

        let mut queue = BinaryHeap::new();
        for left in 0..syms.len().saturating_sub(1) {
            self.push_pair(seg, &syms, left, left + 1, &mut queue);
        }
        while let Some(pair) = queue.pop() {
            let (l, r) = (pair.left, pair.right);
            // Stale entry: one side has since been merged into something else.
            if syms[l].len == 0
                || syms[r].len == 0
                || syms[l].next != r as isize
                || syms[l].len + syms[r].len != pair.size
            {
                continue;
            }
            syms[l].len += syms[r].len;
            syms[l].next = syms[r].next;
            syms[r].len = 0;
            let next = syms[l].next;
            if next >= 0 {
                syms[next as usize].prev = l as isize;
            }
            if syms[l].prev >= 0 {
                self.push_pair(seg, &syms, syms[l].prev as usize, l, &mut queue);
            }
            if syms[l].next >= 0 {
                self.push_pair(seg, &syms, l, syms[l].next as usize, &mut queue);
            }
        }

        // A run of unknown characters becomes one unknown token (`fuse_unk`).
        let mut last_was_unk = false;
        for s in syms.iter().filter(|s| s.len > 0) {
            let text = &seg[s.start..s.start + s.len];
            if let Some(&id) = self.normal.get(text).filter(|_| s.known) {
                out.push(id);
                last_was_unk = false;
                continue;
            }
            let bytes: Option<Vec<u32>> = text.bytes().map(|b| self.byte_ids[b as usize]).collect();
            match (bytes, self.unk) {
                (Some(bytes), _) => {
                    out.extend(bytes);
                    last_was_unk = false;
                }
                (None, Some(unk)) => {
                    if !last_was_unk {
                        out.push(unk);
                    }
                    last_was_unk = true;
                }
                (None, None) => {
                    return Err(TokenizerError::Unencodable {
                        ch: text.chars().next().unwrap_or_default(),
                    });
                }
            }
        }
        Ok(())
    }

    fn push_pair(
        &self,
        seg: &str,
        syms: &[Symbol],
        left: usize,
        right: usize,
        queue: &mut BinaryHeap<Pair>,
    ) {
        let (a, b) = (&syms[left], &syms[right]);
        if !a.known || !b.known {
            return;
        }
        let size = a.len + b.len;
        if let Some(&id) = self.normal.get(&seg[a.start..a.start + size]) {
            queue.push(Pair {
                score: self.scores[id as usize],
                left,
                right,
                size,
            });
        }
    }

    /// Mirrors the tokenizer.json decoder chain: `▁` → space, runs of byte pieces → UTF-8 (one U+FFFD
    /// per byte when invalid), then one leading space stripped.
    pub(super) fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut out = String::new();
        let mut bytes: Vec<u8> = Vec::new();
        let flush = |bytes: &mut Vec<u8>, out: &mut String| {
            if bytes.is_empty() {
                return;
            }
            match std::str::from_utf8(bytes) {
                Ok(s) => out.push_str(s),
                Err(_) => out.extend(std::iter::repeat_n('\u{FFFD}', bytes.len())),
            }
            bytes.clear();
        };
        for &id in ids {
            let (Some(piece), Some(&ty)) =
                (self.pieces.get(id as usize), self.types.get(id as usize))
            else {
                continue;
            };
            if skip_special && matches!(ty, tt::CONTROL | tt::UNKNOWN) {
                continue;
            }
            if ty == tt::BYTE
                && let Some(b) = byte_piece(piece)
            {
                bytes.push(b);
                continue;
            }
            flush(&mut bytes, &mut out);
            out.extend(piece.chars().map(|c| if c == SPACE { ' ' } else { c }));
        }
        flush(&mut bytes, &mut out);
        match out.strip_prefix(' ') {
            Some(rest) => rest.to_string(),
            None => out,
        }
    }
}

struct Symbol {
    start: usize,
    /// Byte length; 0 once merged into its left neighbour.
    len: usize,
    prev: isize,
    next: isize,
    /// The starting character is a normal piece (otherwise it falls back to bytes and never merges).
    known: bool,
}

struct Pair {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl Ord for Pair {
    /// Highest score first; among equal scores the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Pair {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Pair {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Pair {}
