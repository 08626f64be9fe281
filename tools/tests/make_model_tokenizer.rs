//! The synthetic vocabulary at sizes where synthetic merges dominate: tokenizer.json (through
//! the `tokenizers` crate) and the GGUF keys (through loader's SentencePiece-style merger)
//! must encode every text alike.

use loader::gguf::Metadata;
use models::synth::rng::SplitMix64;
use models::synth::tokenizer::{MIN_VOCAB, build_vocab};

fn texts(n: usize, seed: u64) -> Vec<String> {
    let words = [
        "the",
        "model",
        "token",
        "Hello",
        "world",
        "water",
        "people",
        "a",
        "thought",
        "x",
        "qz",
        "42",
        "3.14",
        "don't",
        "über",
        "naïve",
        "日本",
        "emoji🙂",
        "tab\there",
        "line\nbreak",
    ];
    let mut rng = SplitMix64::new(seed);
    (0..n)
        .map(|_| {
            let mut s = String::new();
            for i in 0..rng.below(12) + 1 {
                if i > 0 {
                    s.push_str([" ", "  ", ", ", ". ", "-"][rng.below(5)]);
                }
                let w = words[rng.below(words.len())];
                if rng.below(4) == 0 {
                    // A random printable ASCII run: exercises the synthetic merges.
                    for _ in 0..rng.below(8) + 1 {
                        s.push((0x21 + rng.below(94) as u8) as char);
                    }
                } else {
                    s.push_str(w);
                }
            }
            s
        })
        .collect()
}

#[test]
fn hf_and_gguf_encoders_agree_on_large_synthetic_vocabularies() {
    for (n_vocab, seed) in [(MIN_VOCAB, 1), (4096, 2), (40000, 3)] {
        let v = build_vocab(n_vocab, seed);
        assert_eq!(v.pieces.len(), n_vocab);
        let json = serde_json::to_string(&v.to_tokenizer_json()).unwrap();
        let hf: tokenizers::Tokenizer = json.parse().unwrap();
        let mut meta = Metadata::new();
        v.to_metadata(&mut meta, "");
        let spm = loader::tokenizer::Tokenizer::from_gguf(&meta).unwrap();
        for text in texts(300, seed) {
            let a = hf.encode(text.as_str(), false).unwrap().get_ids().to_vec();
            let b = spm.encode(&text, true).unwrap();
            assert_eq!(a, b, "vocab {n_vocab}: {text:?}");
            assert!(!a.contains(&0), "vocab {n_vocab}: <_unk> in {text:?}");
            assert_eq!(hf.decode(&a, false).unwrap(), text, "vocab {n_vocab}");
        }
    }
}

#[test]
fn merged_pieces_shorten_encodings_of_seed_words() {
    let v = build_vocab(4096, 1);
    let json = serde_json::to_string(&v.to_tokenizer_json()).unwrap();
    let hf: tokenizers::Tokenizer = json.parse().unwrap();
    // Frequent seed words are whole pieces (with their leading ▁) at this size.
    for w in ["the", "people", "water"] {
        let ids = hf.encode(w, false).unwrap().get_ids().to_vec();
        assert_eq!(
            ids.len(),
            1,
            "{w}: {:?}",
            hf.encode(w, false).unwrap().get_tokens()
        );
    }
}
