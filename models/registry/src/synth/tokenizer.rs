//! A synthetic SentencePiece-style vocabulary in the release's layout (spec §8), written both as
//! GGUF `tokenizer.ggml.*` keys and as a Hugging Face `tokenizer.json` that encode alike.
//!
//! Layout: ids 0..24 the named specials, 24..140 `<_unused{i}>` control pieces, 140..396 the
//! byte pieces `<0x00>`..`<0xFF>`, 396 `▁`, then the 94 printable ASCII characters, then merged
//! pieces in merge-rank order.
//!
//! Why the two encoders agree: llama.cpp-style SPM merges any adjacent pair whose concatenation
//! is a piece, highest piece score first; HF BPE applies listed merges, lowest rank first. The
//! merge list here holds *every* split `(a, b)` of every merged piece into two normal pieces,
//! ordered by the merged piece's rank, and a piece's score is minus its rank, so both pick the
//! same merge at every step. `▁` only ever begins a piece, so nothing merges across words.
//!
//! Spaces: `add_space_prefix = true` in GGUF and a Metaspace pre-tokenizer with
//! `prepend_scheme: "first"` in tokenizer.json (a `▁` is prepended only at the very start of the
//! input, not after special tokens); the decoder strips that one leading space.

use std::collections::{HashMap, HashSet};

use loader::gguf::{Metadata, Value, ValueType};
use serde_json::{Value as Json, json};

use super::rng::SplitMix64;

pub const SPACE: char = '\u{2581}';

/// The named special and control pieces, ids 0..24.
pub const SPECIALS: [&str; 24] = [
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
pub const UNK_ID: u32 = 0;
pub const BOS_ID: u32 = 1;
pub const EOS_ID: u32 = 2;
pub const PAD_ID: u32 = 3;
/// First byte piece; `<_unused{i}>` fills `SPECIALS.len()..FIRST_BYTE`.
pub const FIRST_BYTE: usize = 140;
/// `▁`, followed by the single characters.
pub const SPACE_ID: usize = FIRST_BYTE + 256;
const N_SINGLES: usize = 0x7F - 0x21;
/// The smallest vocabulary that holds every fixed piece.
pub const MIN_VOCAB: usize = SPACE_ID + 1 + N_SINGLES;

/// `tokenizer.ggml.token_type` values.
const TYPE_NORMAL: i32 = 1;
const TYPE_UNKNOWN: i32 = 2;
const TYPE_CONTROL: i32 = 3;
const TYPE_BYTE: i32 = 6;

/// Seed words for the BPE-style merges, in descending frequency.
const WORDS: &str = "the of and to a in is it you that he was for on are with as I his they be at \
one have this from or had by hot word but what some we can out other were all there when up use \
your how said an each she which do their time if will way about many then them write would like \
so these her long make thing see him two has look more day could go come did number sound no most \
people my over know water than call first who may down side been now find any new work part take \
get place made live where after back little only round man year came show every good me give our \
under name very through just form sentence great think say help low line differ turn cause much \
mean before move right boy old too same tell does set three want air well also play small end put \
home read hand port large spell add even land here must big high such follow act why ask men \
change went light kind off need house picture try us again animal point mother world near build \
self earth father head stand own page should country found answer school grow study still learn \
plant cover food sun four between state keep eye never last let thought city tree cross farm hard \
start might story saw far sea draw left late run while press close night real life few north open \
seem together next white children begin got walk example ease paper group always music those both \
mark often letter until mile river car feet care second book carry took science eat room friend \
began idea fish mountain stop once base hear horse cut sure watch color face wood main enough \
plain girl usual young ready above ever red list though feel talk bird soon body dog family direct \
pose leave song measure door product black short numeral class wind question happen complete ship \
area half rock order fire south problem piece told knew pass since top whole king space heard best \
hour better true during hundred five remember step early hold west ground interest reach fast verb \
sing listen six table travel less morning ten simple several vowel toward war lay against pattern \
slow center love person money serve appear road map rain rule govern pull cold notice voice unit \
power town fine certain fly fall lead cry dark machine note wait plan figure star box noun field \
rest correct able pound done beauty drive stood contain front teach week final gave green oh quick \
develop ocean warm free minute strong special mind behind clear tail produce fact street inch \
multiply nothing course stay wheel full force blue object decide surface deep moon island foot \
system busy test record boat common gold possible plane stead dry wonder laugh thousand ago ran \
check game shape equate miss brought heat snow tire bring yes distant fill east paint language \
among Hello hello world model token text code data value";

/// A synthetic vocabulary: pieces in id order with their scores, types and merges.
pub struct Vocab {
    pub pieces: Vec<String>,
    pub scores: Vec<f32>,
    pub types: Vec<i32>,
    /// Every `(left, right)` split of every merged piece, by the merged piece's rank.
    pub merges: Vec<(String, String)>,
}

/// Builds a vocabulary of exactly `n_vocab` pieces (at least [`MIN_VOCAB`]).
pub fn build_vocab(n_vocab: usize, seed: u64) -> Vocab {
    let pieces = fixed_pieces();
    let n_merged = n_vocab.saturating_sub(MIN_VOCAB);

    let mut normal: HashSet<String> = pieces[SPACE_ID..].iter().cloned().collect();
    let mut merged: Vec<String> = Vec::with_capacity(n_merged);
    let add = |p: String, normal: &mut HashSet<String>, merged: &mut Vec<String>| {
        if merged.len() < n_merged && normal.insert(p.clone()) {
            merged.push(p);
        }
    };

    // 1. BPE training over the word list: most frequent adjacent pair first (ties by the pair
    //    itself, for determinism); each word is weighted by its frequency rank.
    let words: Vec<(String, u64)> = WORDS
        .split_whitespace()
        .enumerate()
        .map(|(i, w)| (format!("{SPACE}{w}"), 1000 / (i as u64 + 10) + 1))
        .collect();
    let words: Vec<(&str, u64)> = words.iter().map(|(w, n)| (w.as_str(), *n)).collect();
    for p in bpe_merges(&words, n_merged) {
        add(p, &mut normal, &mut merged);
    }

    // 2. Every character with a leading `▁`.
    for c in 0x21u8..0x7F {
        add(format!("{SPACE}{}", c as char), &mut normal, &mut merged);
    }

    // 3. Deterministic synthetic merges until the vocabulary is full: join a random piece with
    //    a random piece that does not start with `▁`, up to 12 characters.
    let mut rng = SplitMix64::derive(seed, 0x70_6b_6e, 0);
    let mut pool: Vec<String> = pieces[SPACE_ID + 1..].to_vec();
    pool.extend(merged.iter().cloned());
    let mut tails: Vec<String> = pool
        .iter()
        .filter(|p| !p.starts_with(SPACE))
        .cloned()
        .collect();
    while merged.len() < n_merged {
        let a = &pool[rng.below(pool.len())];
        let b = &tails[rng.below(tails.len())];
        if a.chars().count() + b.chars().count() > 12 {
            continue;
        }
        let p = format!("{a}{b}");
        if normal.contains(&p) {
            continue;
        }
        add(p.clone(), &mut normal, &mut merged);
        if !p.starts_with(SPACE) {
            tails.push(p.clone());
        }
        pool.push(p);
    }
    finish(pieces, merged)
}

/// A vocabulary of exactly `n_vocab` pieces (at least [`MIN_VOCAB`]) whose merged pieces are
/// BPE-trained on `corpus`: words are its whitespace-separated runs, each with a leading `▁`,
/// counted by occurrence; a character outside the single pieces (printable ASCII) splits a
/// word, since byte-fallback pieces never merge. Fewer distinct merges than asked for (a tiny
/// corpus) leaves the vocabulary short, which is an error.
pub fn train_vocab(n_vocab: usize, corpus: &str) -> Result<Vocab, String> {
    let pieces = fixed_pieces();
    let n_merged = n_vocab.saturating_sub(MIN_VOCAB);
    let mut counts: HashMap<String, u64> = HashMap::new();
    for word in corpus.split_whitespace() {
        let mut first = true;
        for run in word.split(|c: char| !c.is_ascii_graphic()) {
            if run.is_empty() {
                first = false;
                continue;
            }
            let key = if first {
                format!("{SPACE}{run}")
            } else {
                run.to_string()
            };
            *counts.entry(key).or_default() += 1;
            first = false;
        }
    }
    // Sorted so that the training's input order, and so its result, is fixed.
    let mut words: Vec<(&str, u64)> = counts.iter().map(|(w, &n)| (w.as_str(), n)).collect();
    words.sort_unstable();
    let merged = bpe_merges(&words, n_merged);
    if merged.len() < n_merged {
        return Err(format!(
            "the corpus yields {} merged pieces; a vocabulary of {n_vocab} needs {n_merged}",
            merged.len()
        ));
    }
    Ok(finish(pieces, merged))
}

/// Ids `0..MIN_VOCAB`: specials, unused control pieces, bytes, `▁`, printable ASCII.
fn fixed_pieces() -> Vec<String> {
    let mut pieces: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
    for i in 0..FIRST_BYTE - SPECIALS.len() {
        pieces.push(format!("<_unused{i}>"));
    }
    for b in 0..=255u8 {
        pieces.push(format!("<0x{b:02X}>"));
    }
    pieces.push(SPACE.to_string());
    for c in 0x21u8..0x7F {
        pieces.push((c as char).to_string());
    }
    debug_assert_eq!(pieces.len(), MIN_VOCAB);
    pieces
}

/// Up to `n` distinct pieces from byte-pair merges over `words` (each a string and its weight;
/// every character a starting symbol): the heaviest adjacent pair first, ties to the smaller
/// pair, applied left to right within a word. Pair counts are kept up to date incrementally,
/// touching only the words that hold the merged pair.
fn bpe_merges(words: &[(&str, u64)], n: usize) -> Vec<String> {
    let mut symbols: Vec<String> = Vec::new();
    let mut ids: HashMap<String, u32> = HashMap::new();
    let mut intern = |s: String, symbols: &mut Vec<String>| -> u32 {
        *ids.entry(s.clone()).or_insert_with(|| {
            symbols.push(s);
            (symbols.len() - 1) as u32
        })
    };
    let mut seqs: Vec<Vec<u32>> = words
        .iter()
        .map(|(w, _)| {
            w.chars()
                .map(|c| intern(c.to_string(), &mut symbols))
                .collect()
        })
        .collect();
    let weight: Vec<u64> = words.iter().map(|w| w.1).collect();
    let mut pairs: HashMap<(u32, u32), u64> = HashMap::new();
    let mut holders: HashMap<(u32, u32), HashSet<usize>> = HashMap::new();
    for (i, s) in seqs.iter().enumerate() {
        for p in s.windows(2) {
            *pairs.entry((p[0], p[1])).or_default() += weight[i];
            holders.entry((p[0], p[1])).or_default().insert(i);
        }
    }
    let mut out: Vec<String> = Vec::new();
    let mut seen: HashSet<String> = HashSet::new();
    while out.len() < n {
        let best = pairs
            .iter()
            .filter(|&(_, &c)| c > 0)
            .max_by(|x, y| {
                x.1.cmp(y.1).then_with(|| {
                    let key = |p: &(u32, u32)| {
                        (symbols[p.0 as usize].clone(), symbols[p.1 as usize].clone())
                    };
                    key(y.0).cmp(&key(x.0))
                })
            })
            .map(|(p, _)| *p);
        let Some((a, b)) = best else { break };
        let joined = format!("{}{}", symbols[a as usize], symbols[b as usize]);
        let j = intern(joined.clone(), &mut symbols);
        let mut touched: Vec<usize> = holders
            .remove(&(a, b))
            .unwrap_or_default()
            .into_iter()
            .collect();
        touched.sort_unstable();
        for i in touched {
            let s = &mut seqs[i];
            for p in s.windows(2) {
                if let Some(c) = pairs.get_mut(&(p[0], p[1])) {
                    *c -= weight[i];
                }
            }
            let mut k = 0;
            while k + 1 < s.len() {
                if s[k] == a && s[k + 1] == b {
                    s[k] = j;
                    s.remove(k + 1);
                }
                k += 1;
            }
            for p in s.windows(2) {
                *pairs.entry((p[0], p[1])).or_default() += weight[i];
                holders.entry((p[0], p[1])).or_default().insert(i);
            }
        }
        pairs.remove(&(a, b));
        if seen.insert(joined.clone()) {
            out.push(joined);
        }
    }
    out
}

/// The merge list, scores and types of `fixed` followed by `merged` in rank order.
fn finish(mut pieces: Vec<String>, merged: Vec<String>) -> Vocab {
    let normal: HashSet<&str> = pieces[SPACE_ID..]
        .iter()
        .chain(merged.iter())
        .map(String::as_str)
        .collect();
    let mut merges = Vec::new();
    for p in &merged {
        for (i, _) in p.char_indices().skip(1) {
            let (l, r) = p.split_at(i);
            if normal.contains(l) && normal.contains(r) {
                merges.push((l.to_string(), r.to_string()));
            }
        }
    }

    let n_fixed = pieces.len();
    let single_score = -(merged.len() as f32) - 1.0;
    let mut scores = vec![0f32; n_fixed];
    let mut types = vec![TYPE_CONTROL; FIRST_BYTE];
    types[UNK_ID as usize] = TYPE_UNKNOWN;
    types.extend(std::iter::repeat_n(TYPE_BYTE, 256));
    types.extend(std::iter::repeat_n(TYPE_NORMAL, n_fixed - SPACE_ID));
    for s in &mut scores[SPACE_ID..] {
        *s = single_score;
    }
    for (rank, p) in merged.into_iter().enumerate() {
        pieces.push(p);
        scores.push(-(rank as f32) - 1.0);
        types.push(TYPE_NORMAL);
    }
    Vocab {
        pieces,
        scores,
        types,
        merges,
    }
}

impl Vocab {
    /// The `tokenizer.*` GGUF keys.
    pub fn to_metadata(&self, meta: &mut Metadata, chat_template: &str) {
        let strings = self
            .pieces
            .iter()
            .map(|p| Value::String(p.clone()))
            .collect();
        let scores = self.scores.iter().map(|&s| Value::F32(s)).collect();
        let types = self.types.iter().map(|&t| Value::I32(t)).collect();
        meta.insert("tokenizer.ggml.model", Value::String("llama".into()));
        meta.insert(
            "tokenizer.ggml.tokens",
            Value::Array(ValueType::String, strings),
        );
        meta.insert(
            "tokenizer.ggml.scores",
            Value::Array(ValueType::F32, scores),
        );
        meta.insert(
            "tokenizer.ggml.token_type",
            Value::Array(ValueType::I32, types),
        );
        meta.insert("tokenizer.ggml.bos_token_id", Value::U32(BOS_ID));
        meta.insert("tokenizer.ggml.eos_token_id", Value::U32(EOS_ID));
        meta.insert("tokenizer.ggml.unknown_token_id", Value::U32(UNK_ID));
        meta.insert("tokenizer.ggml.padding_token_id", Value::U32(PAD_ID));
        meta.insert("tokenizer.ggml.add_bos_token", Value::Bool(false));
        meta.insert("tokenizer.ggml.add_eos_token", Value::Bool(false));
        meta.insert("tokenizer.ggml.add_space_prefix", Value::Bool(true));
        meta.insert(
            "tokenizer.chat_template",
            Value::String(chat_template.into()),
        );
    }

    /// The Hugging Face `tokenizer.json`.
    pub fn to_tokenizer_json(&self) -> Json {
        let added: Vec<Json> = (0..FIRST_BYTE)
            .map(|id| {
                json!({
                    "id": id, "content": self.pieces[id], "single_word": false,
                    "lstrip": false, "rstrip": false, "normalized": false, "special": true,
                })
            })
            .collect();
        let vocab: serde_json::Map<String, Json> = self
            .pieces
            .iter()
            .enumerate()
            .map(|(id, p)| (p.clone(), json!(id)))
            .collect();
        let merges: Vec<Json> = self.merges.iter().map(|(a, b)| json!([a, b])).collect();
        json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": {
                "type": "Metaspace", "replacement": SPACE.to_string(),
                "prepend_scheme": "first", "split": false,
            },
            "post_processor": null,
            "decoder": {
                "type": "Sequence",
                "decoders": [
                    {"type": "Replace", "pattern": {"String": SPACE.to_string()}, "content": " "},
                    {"type": "ByteFallback"},
                    {"type": "Fuse"},
                    {"type": "Strip", "content": " ", "start": 1, "stop": 0},
                ],
            },
            "model": {
                "type": "BPE", "dropout": null, "unk_token": SPECIALS[UNK_ID as usize],
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                "vocab": vocab, "merges": merges,
            },
        })
    }

    /// `tokenizer_config.json`.
    pub fn to_tokenizer_config(&self, chat_template: &str, n_ctx: usize) -> Json {
        let decoder: serde_json::Map<String, Json> = (0..FIRST_BYTE)
            .map(|id| {
                (
                    id.to_string(),
                    json!({
                        "content": self.pieces[id], "lstrip": false, "normalized": false,
                        "rstrip": false, "single_word": false, "special": true,
                    }),
                )
            })
            .collect();
        json!({
            "add_bos_token": false,
            "add_eos_token": false,
            "added_tokens_decoder": decoder,
            "bos_token": SPECIALS[BOS_ID as usize],
            "eos_token": SPECIALS[EOS_ID as usize],
            "pad_token": SPECIALS[PAD_ID as usize],
            "unk_token": SPECIALS[UNK_ID as usize],
            "chat_template": chat_template,
            "clean_up_tokenization_spaces": false,
            "model_max_length": n_ctx,
            "tokenizer_class": "PreTrainedTokenizerFast",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_ids_follow_the_release_layout() {
        let v = build_vocab(MIN_VOCAB + 50, 1);
        assert_eq!(v.pieces.len(), MIN_VOCAB + 50);
        assert_eq!(v.pieces[0], "<_unk>");
        assert_eq!(v.pieces[2], "<_end>");
        assert_eq!(v.pieces[10], "</think>");
        assert_eq!(v.pieces[23], "<_control9>");
        assert_eq!(v.pieces[24], "<_unused0>");
        assert_eq!(v.pieces[139], "<_unused115>");
        assert_eq!(v.pieces[140], "<0x00>");
        assert_eq!(v.pieces[395], "<0xFF>");
        assert_eq!(v.pieces[396], "\u{2581}");
        assert_eq!(v.pieces[397], "!");
        assert_eq!(v.types[0], TYPE_UNKNOWN);
        assert_eq!(v.types[139], TYPE_CONTROL);
        assert_eq!(v.types[140], TYPE_BYTE);
        assert_eq!(v.types[396], TYPE_NORMAL);
    }

    #[test]
    fn every_piece_is_unique_and_every_merge_joins_two_pieces_into_a_piece() {
        for n in [MIN_VOCAB, 512, 5000] {
            let v = build_vocab(n, 9);
            assert_eq!(v.pieces.len(), n);
            let set: HashSet<&str> = v.pieces.iter().map(String::as_str).collect();
            assert_eq!(set.len(), n, "duplicate pieces at vocab {n}");
            for (a, b) in &v.merges {
                assert!(set.contains(a.as_str()) && set.contains(b.as_str()));
                assert!(set.contains(format!("{a}{b}").as_str()));
                assert!(!b.starts_with(SPACE), "`▁` inside a piece: {a}{b}");
            }
            // Scores strictly decrease along the merged pieces.
            assert!(v.scores[MIN_VOCAB..].windows(2).all(|w| w[0] > w[1]));
        }
    }
}
