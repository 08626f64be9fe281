//! A request body as serve reads it: JSON messages rendered through the project's chat template
//! with the markers typed inside them guarded, cut into pieces and tokenized by the tiny
//! checkpoint's tokenizer (`XING4_FUZZ_TOKENIZER`, scripts/fuzz makes it). Checks that no input
//! panics and that a message's text never yields more marker tokens than the template itself
//! puts there.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use loader::chat::{ChatMessage, ChatTemplate, XING4_CHAT_TEMPLATE, guard_markers, prompt_pieces};
use loader::tokenizer::Tokenizer;
use serde_json::Value;

struct Fixture {
    tok: Tokenizer,
    template: ChatTemplate,
    markers: Vec<String>,
    end: Option<u32>,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let path = std::env::var("XING4_FUZZ_TOKENIZER")
            .expect("XING4_FUZZ_TOKENIZER: a tokenizer.json (scripts/fuzz sets it)");
        let tok = Tokenizer::from_file(path.as_ref()).expect("the tokenizer loads");
        let markers = tok.marker_strings();
        let end = tok.piece_to_id("<_end>");
        Fixture {
            tok,
            template: ChatTemplate::new(XING4_CHAT_TEMPLATE).expect("the template compiles"),
            markers,
            end,
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let f = fixture();
    let Ok(Value::Array(items)) = serde_json::from_slice::<Value>(data) else {
        return;
    };
    let mut messages: Vec<ChatMessage> = items
        .iter()
        .filter_map(|m| {
            Some(ChatMessage::new(
                m.get("role")?.as_str()?,
                m.get("content")?.as_str()?,
            ))
        })
        .collect();
    // Assistant turns are what the template wraps in `<_end>`: its own marker count.
    let own_ends = messages.iter().filter(|m| m.role == "assistant").count();
    let literals = guard_markers(&mut messages, &f.markers);
    let Ok(rendered) = f.template.render(&messages, true, true, None) else {
        return;
    };
    let pieces = prompt_pieces(&rendered, &literals);
    let joined: String = pieces.iter().map(|(s, _)| *s).collect();
    let ids = f.tok.encode_prompt(&pieces).expect("every text tokenizes");
    if let Some(end) = f.end {
        let n = ids.iter().filter(|&&i| i == end).count();
        assert!(
            n <= own_ends,
            "{n} <_end> tokens from {own_ends} assistant turns: {joined:?}"
        );
    }
});
