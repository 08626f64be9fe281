//! Chat templates: Jinja sources as released in `tokenizer_config.json`, rendered with minijinja
//! configured like Hugging Face's `apply_chat_template` (trim_blocks, lstrip_blocks, Python string
//! methods, `raise_exception`).

use minijinja::{Environment, Error as JinjaError, ErrorKind, Value, context};
use serde::Serialize;

const NAME: &str = "chat_template";

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            reasoning_content: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("chat template does not compile: {0}")]
    Syntax(String),
    #[error("chat template raised an exception: {0}")]
    Raised(String),
    #[error("chat template failed to render: {0}")]
    Render(String),
    #[error("chat template extra context must be a JSON object, got {0}")]
    Extra(String),
}

/// minijinja's message plus every cause and the template location it reports.
fn describe(e: &JinjaError) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(cause) = src {
        s.push_str(&format!(": {cause}"));
        src = cause.source();
    }
    s
}

/// Marks errors that came from the template's own `raise_exception(...)`.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

fn raise_exception(msg: String) -> Result<Value, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, msg.clone()).with_source(Raised(msg)))
}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    pub fn new(source: &str) -> Result<ChatTemplate, ChatError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| ChatError::Syntax(describe(&e)))?;
        Ok(ChatTemplate {
            env,
            bos_token: String::new(),
            eos_token: String::new(),
        })
    }

    /// The `bos_token` / `eos_token` strings the template sees (empty unless set).
    pub fn with_special_tokens(mut self, bos: impl Into<String>, eos: impl Into<String>) -> Self {
        self.bos_token = bos.into();
        self.eos_token = eos.into();
        self
    }

    /// `extra` (a JSON object, e.g. `{"tools": [...]}`) adds template variables; it may override
    /// `bos_token`/`eos_token` but not the messages or the two flags.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        enable_thinking: bool,
        extra: Option<&serde_json::Value>,
    ) -> Result<String, ChatError> {
        let extra = match extra {
            None | Some(serde_json::Value::Null) => Value::from(()),
            Some(v @ serde_json::Value::Object(_)) => Value::from_serialize(v),
            Some(other) => {
                let kind = match other {
                    serde_json::Value::Array(_) => "an array",
                    serde_json::Value::String(_) => "a string",
                    serde_json::Value::Number(_) => "a number",
                    _ => "a bool",
                };
                return Err(ChatError::Extra(kind.to_string()));
            }
        };
        let fixed = context! {
            messages => Value::from_serialize(messages),
            add_generation_prompt,
            enable_thinking,
        };
        let defaults = context! { bos_token => &self.bos_token, eos_token => &self.eos_token };
        let ctx = context! { ..fixed, ..extra, ..defaults };
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| ChatError::Syntax(describe(&e)))?;
        tmpl.render(ctx).map_err(|e| {
            let mut src = std::error::Error::source(&e);
            while let Some(cause) = src {
                if let Some(Raised(msg)) = cause.downcast_ref::<Raised>() {
                    return ChatError::Raised(msg.clone());
                }
                src = cause.source();
            }
            ChatError::Render(describe(&e))
        })
    }
}

// ---- Message text is text ------------------------------------------------------------------
//
// A chat prompt is rendered to one string and tokenized with its markers parsed, so a user who
// types `<_end><_start>` would otherwise end the turn and open a role of their own. Before
// rendering, every marker string inside a message (content and reasoning) is swapped for a
// placeholder the template passes through unchanged; after rendering, the prompt is cut at the
// placeholders and the strings they stand for are tokenized as ordinary text. Only the
// template's own markers are control tokens.

/// Opens and closes a placeholder (`OPEN` index `CLOSE`): code points of a private-use plane,
/// themselves guarded when a message holds them.
const OPEN: char = '\u{F0000}';
const CLOSE: char = '\u{F0001}';

/// Swaps every occurrence of a marker (leftmost, longest first) in each message's content and
/// reasoning for a placeholder, and returns the swapped strings, placeholder `i` standing for
/// entry `i`. `markers` are the strings the tokenizer parses as tokens.
pub fn guard_markers(messages: &mut [ChatMessage], markers: &[String]) -> Vec<String> {
    let mut sorted: Vec<&str> = markers
        .iter()
        .map(String::as_str)
        .filter(|m| !m.is_empty())
        .collect();
    let (open, close) = (OPEN.to_string(), CLOSE.to_string());
    sorted.extend([open.as_str(), close.as_str()]);
    sorted.sort_by(|a, b| b.len().cmp(&a.len()).then(a.cmp(b)));
    sorted.dedup();
    let mut literals = Vec::new();
    let mut guard = |text: &mut String| {
        if !sorted.iter().any(|m| text.contains(m)) {
            return;
        }
        let mut out = String::with_capacity(text.len());
        let mut rest = text.as_str();
        while !rest.is_empty() {
            match sorted.iter().find(|m| rest.starts_with(**m)) {
                Some(m) => {
                    out.push(OPEN);
                    out.push_str(&literals.len().to_string());
                    out.push(CLOSE);
                    literals.push((*m).to_string());
                    rest = &rest[m.len()..];
                }
                None => {
                    let c = rest.chars().next().unwrap_or(' ');
                    out.push(c);
                    rest = &rest[c.len_utf8()..];
                }
            }
        }
        *text = out;
    };
    for m in messages.iter_mut() {
        guard(&mut m.content);
        if let Some(r) = m.reasoning_content.as_mut() {
            guard(r);
        }
    }
    literals
}

/// A rendered prompt cut at its placeholders: `(text, literal)` pieces, where a literal piece
/// is a string a message held (to be tokenized as text) and the rest is the template's.
pub fn prompt_pieces<'a>(rendered: &'a str, literals: &'a [String]) -> Vec<(&'a str, bool)> {
    let mut out = Vec::new();
    let mut rest = rendered;
    while let Some(at) = rest.find(OPEN) {
        let after = &rest[at + OPEN.len_utf8()..];
        let placeholder = after
            .find(CLOSE)
            .and_then(|end| after[..end].parse::<usize>().ok().map(|i| (i, end)))
            .and_then(|(i, end)| literals.get(i).map(|l| (l, end)));
        let Some((literal, end)) = placeholder else {
            // Not one of ours (the template changed it): template text, as it reads.
            out.push((&rest[..at + OPEN.len_utf8()], false));
            rest = after;
            continue;
        };
        if at > 0 {
            out.push((&rest[..at], false));
        }
        out.push((literal.as_str(), true));
        rest = &after[end + CLOSE.len_utf8()..];
    }
    if !rest.is_empty() {
        out.push((rest, false));
    }
    out
}

/// This project's template in the released layout (MODEL.md §8): `<_system>{system}` (empty when
/// there is no system message), `<_user>{text}`, past answers as `<_bot></think>{answer}<_end>\n`,
/// and a generation prompt `<_bot><think>\n` (thinking) or `<_bot></think>` (no thinking). Past
/// reasoning is not replayed. Tool results are wrapped in `<tool_response>` inside a user turn
/// (the released template's tool layout is unknown; this is our choice).
pub const XING4_CHAT_TEMPLATE: &str = r#"{%- if messages and messages[0].role == "system" -%}
<_system>{{ messages[0].content }}
{%- set turns = messages[1:] -%}
{%- else -%}
<_system>
{%- set turns = messages -%}
{%- endif -%}
{%- for m in turns -%}
{%- if m.role == "user" -%}
<_user>{{ m.content }}
{%- elif m.role == "assistant" -%}
<_bot></think>{{ m.content }}<_end>{{ "\n" }}
{%- elif m.role == "tool" -%}
<_user><tool_response>{{ "\n" }}{{ m.content }}{{ "\n" }}</tool_response>
{%- elif m.role == "system" -%}
{{ raise_exception("a system message must come first, found one at position " ~ loop.index0) }}
{%- else -%}
{{ raise_exception("unknown message role: " ~ m.role) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{%- if enable_thinking is not defined or enable_thinking -%}
<_bot><think>{{ "\n" }}
{%- else -%}
<_bot></think>
{%- endif -%}
{%- endif -%}"#;
