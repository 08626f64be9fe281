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

/// A vocabulary BPE-trained on a corpus (`make-model --corpus`) keeps the property the
/// synthetic one has: both encoders agree. Checked on a corpus made here and on the shipped
/// default model's vocabulary (trained on Austen and the King James Bible).
#[test]
fn hf_and_gguf_encoders_agree_on_corpus_trained_vocabularies() {
    let corpus = texts(3000, 7).join("\n");
    let trained = models::synth::tokenizer::train_vocab(MIN_VOCAB + 400, &corpus).unwrap();
    assert_eq!(trained.pieces.len(), MIN_VOCAB + 400);
    let json = serde_json::to_string(&trained.to_tokenizer_json()).unwrap();
    let hf: tokenizers::Tokenizer = json.parse().unwrap();
    let mut meta = Metadata::new();
    trained.to_metadata(&mut meta, "");
    let spm = loader::tokenizer::Tokenizer::from_gguf(&meta).unwrap();

    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("default-model");
    let shipped_hf = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let gguf = loader::gguf::GgufFile::open(&dir.join("model.gguf")).unwrap();
    let shipped_spm = loader::tokenizer::Tokenizer::from_gguf(&gguf.metadata).unwrap();

    let english = "It is a truth universally acknowledged, that a single man in possession \
                   of a good fortune, must be in want of a wife. And God said, Let there be light.";
    for text in texts(300, 8).iter().map(String::as_str).chain([english]) {
        for (hf, spm, which) in [
            (&hf, &spm, "made here"),
            (&shipped_hf, &shipped_spm, "shipped"),
        ] {
            let a = hf.encode(text, false).unwrap().get_ids().to_vec();
            let b = spm.encode(text, true).unwrap();
            assert_eq!(a, b, "{which}: {text:?}");
            assert_eq!(hf.decode(&a, false).unwrap(), text, "{which}");
        }
    }
    // The shipped vocabulary learned its corpus: frequent words are single pieces.
    for w in ["the", "and", "Elizabeth", "LORD"] {
        let ids = shipped_hf.encode(w, false).unwrap().get_ids().to_vec();
        assert_eq!(
            ids.len(),
            1,
            "{w}: {:?}",
            shipped_hf.encode(w, false).unwrap().get_tokens()
        );
    }
    // Too little text for the vocabulary asked for is an error, not a short vocabulary.
    let err = models::synth::tokenizer::train_vocab(MIN_VOCAB + 400, "a b a b")
        .err()
        .unwrap();
    assert!(err.contains("needs 400"), "{err}");
}
