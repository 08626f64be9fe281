//! Splitting text on special-token strings before the model runs.

use std::collections::HashMap;

/// Literal token strings, matched leftmost-longest (as the `tokenizers` crate's added vocabulary does).
#[derive(Default)]
pub(super) struct Matcher {
    /// By first byte, longest first.
    by_first: HashMap<u8, Vec<(String, u32)>>,
}

pub(super) enum Fragment<'t> {
    Token(u32),
    /// Ordinary text and its byte offset in the input.
    Text(usize, &'t str),
}

impl Matcher {
    pub(super) fn new<'p>(tokens: impl IntoIterator<Item = (&'p str, u32)>) -> Matcher {
        let mut by_first: HashMap<u8, Vec<(String, u32)>> = HashMap::new();
        for (text, id) in tokens {
            if let Some(&b) = text.as_bytes().first() {
                by_first.entry(b).or_default().push((text.to_string(), id));
            }
        }
        for list in by_first.values_mut() {
            // Longest first; among equal strings the lowest id wins.
            list.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        }
        Matcher { by_first }
    }

    pub(super) fn split<'t>(&self, text: &'t str) -> Vec<Fragment<'t>> {
        let bytes = text.as_bytes();
        let mut out = Vec::new();
        let mut start = 0;
        let mut i = 0;
        while i < bytes.len() {
            let hit = self.by_first.get(&bytes[i]).and_then(|cands| {
                cands
                    .iter()
                    .find(|(s, _)| bytes[i..].starts_with(s.as_bytes()))
            });
            match hit {
                // A match begins with a UTF-8 lead byte, so `i` is a char boundary.
                Some((s, id)) => {
                    if start < i {
                        out.push(Fragment::Text(start, &text[start..i]));
                    }
                    out.push(Fragment::Token(*id));
                    i += s.len();
                    start = i;
                }
                None => i += 1,
            }
        }
        if start < bytes.len() {
            out.push(Fragment::Text(start, &text[start..]));
        }
        out
    }
}
