//! The answer's tool-call parser (`loader::toolcall`): any text, cut into any chunks, parses as
//! it does whole; every call it returns names a declared function and has a JSON object for
//! arguments. The first bytes choose the chunk sizes, the rest is the text.

#![no_main]

use libfuzzer_sys::fuzz_target;
use loader::toolcall::{CallParser, Piece};

/// Text pieces merged, calls as they are: the form two runs are compared in.
fn run(text: &str, cuts: &[usize]) -> Vec<Piece> {
    let mut p = CallParser::new(vec!["f".into(), "get_weather".into()], "x".into());
    let mut pieces = Vec::new();
    let mut rest = text;
    for &n in cuts.iter().cycle().take(text.len() + 1) {
        if rest.is_empty() {
            break;
        }
        let mut at = n.clamp(1, rest.len());
        while !rest.is_char_boundary(at) {
            at += 1;
        }
        pieces.extend(p.push(&rest[..at]));
        rest = &rest[at..];
    }
    if !rest.is_empty() {
        pieces.extend(p.push(rest));
    }
    pieces.extend(p.finish());
    let mut merged: Vec<Piece> = Vec::new();
    for piece in pieces {
        match (merged.last_mut(), piece) {
            (Some(Piece::Text(a)), Piece::Text(b)) => a.push_str(&b),
            (_, p) => merged.push(p),
        }
    }
    merged
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    let cuts: Vec<usize> = data[..4].iter().map(|&b| 1 + b as usize % 17).collect();
    let Ok(text) = std::str::from_utf8(&data[4..]) else {
        return;
    };
    let whole = run(text, &[usize::MAX]);
    let chunked = run(text, &cuts);
    assert_eq!(whole, chunked, "chunking changed the parse of {text:?} (cuts {cuts:?})");
    for p in &whole {
        if let Piece::Call(c) = p {
            assert!(c.name == "f" || c.name == "get_weather", "{c:?}");
            let args: serde_json::Value = serde_json::from_str(&c.arguments).expect("arguments are JSON");
            assert!(args.is_object(), "{c:?}");
        }
    }
});
