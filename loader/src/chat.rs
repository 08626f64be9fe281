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
    /// An assistant turn's calls, as OpenAI's API has them: `{"id", "type": "function",
    /// "function": {"name", "arguments"}}`, `arguments` parsed to JSON where it parses (what
    /// Hugging Face templates expect).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A tool turn's answer to this call id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A tool turn's function name, where the client gave one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            ..ChatMessage::default()
        }
    }
}

/// JSON as Python's `json.dumps(value, ensure_ascii=False)` writes it (`", "` and `": "`
/// separators, no HTML escaping): the `tojson` that Hugging Face's `apply_chat_template`
/// installs, so a template renders tools as the model was trained to read them.
pub fn python_json(value: &serde_json::Value) -> String {
    struct PythonStyle;
    impl serde_json::ser::Formatter for PythonStyle {
        fn begin_array_value<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
            first: bool,
        ) -> std::io::Result<()> {
            if first { Ok(()) } else { w.write_all(b", ") }
        }
        fn begin_object_key<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
            first: bool,
        ) -> std::io::Result<()> {
            if first { Ok(()) } else { w.write_all(b", ") }
        }
        fn begin_object_value<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
        ) -> std::io::Result<()> {
            w.write_all(b": ")
        }
    }
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonStyle);
    // Writing a `Value` into memory cannot fail.
    let _ = serde::Serialize::serialize(value, &mut ser);
    String::from_utf8(out).unwrap_or_default()
}

fn tojson(value: Value) -> Result<Value, JinjaError> {
    let json = serde_json::to_value(&value)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(Value::from_safe_string(python_json(&json)))
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
        env.add_filter("tojson", tojson);
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

/// Swaps every occurrence of a marker (leftmost, longest first) in the strings a request
/// supplies (messages, tool definitions, call arguments) for a placeholder, keeping the
/// swapped strings: placeholder `i` stands for entry `i` of [`MarkerGuard::into_literals`].
pub struct MarkerGuard {
    /// Longest first, then in byte order.
    sorted: Vec<String>,
    literals: Vec<String>,
}

impl MarkerGuard {
    /// `markers` are the strings the tokenizer parses as tokens.
    pub fn new(markers: &[String]) -> MarkerGuard {
        let mut sorted: Vec<String> = markers.iter().filter(|m| !m.is_empty()).cloned().collect();
        sorted.extend([OPEN.to_string(), CLOSE.to_string()]);
        sorted.sort_by(|a, b| b.len().cmp(&a.len()).then(a.cmp(b)));
        sorted.dedup();
        MarkerGuard {
            sorted,
            literals: Vec::new(),
        }
    }

    pub fn text(&mut self, text: &mut String) {
        if !self.sorted.iter().any(|m| text.contains(m.as_str())) {
            return;
        }
        let mut out = String::with_capacity(text.len());
        let mut rest = text.as_str();
        while !rest.is_empty() {
            match self.sorted.iter().find(|m| rest.starts_with(m.as_str())) {
                Some(m) => {
                    out.push(OPEN);
                    out.push_str(&self.literals.len().to_string());
                    out.push(CLOSE);
                    self.literals.push(m.clone());
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
    }

    /// Every string of `value`, object keys included.
    pub fn json(&mut self, value: &mut serde_json::Value) {
        match value {
            serde_json::Value::String(s) => self.text(s),
            serde_json::Value::Array(a) => a.iter_mut().for_each(|v| self.json(v)),
            serde_json::Value::Object(m) => {
                let entries = std::mem::take(m);
                for (mut k, mut v) in entries {
                    self.text(&mut k);
                    self.json(&mut v);
                    m.insert(k, v);
                }
            }
            _ => {}
        }
    }

    pub fn messages(&mut self, messages: &mut [ChatMessage]) {
        for m in messages.iter_mut() {
            self.text(&mut m.content);
            for s in [&mut m.reasoning_content, &mut m.tool_call_id, &mut m.name]
                .into_iter()
                .flatten()
            {
                self.text(s);
            }
            for call in m.tool_calls.iter_mut().flatten() {
                self.json(call);
            }
        }
    }

    pub fn into_literals(self) -> Vec<String> {
        self.literals
    }
}

/// [`MarkerGuard`] over the messages alone.
pub fn guard_markers(messages: &mut [ChatMessage], markers: &[String]) -> Vec<String> {
    let mut guard = MarkerGuard::new(markers);
    guard.messages(messages);
    guard.into_literals()
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
/// reasoning is not replayed. The released template's tool layout is unknown; ours (spec §8.1's
/// output form): declared `tools` go in the system turn as JSON signatures with the call format,
/// a past answer's calls follow its text as `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>`
/// blocks, and tool results are `<tool_response>` blocks of one user turn.
pub const XING4_CHAT_TEMPLATE: &str = r#"{%- if messages and messages[0].role == "system" -%}
<_system>{{ messages[0].content }}
{%- set turns = messages[1:] -%}
{%- else -%}
<_system>
{%- set turns = messages -%}
{%- endif -%}
{%- if tools -%}
{%- if messages and messages[0].role == "system" and messages[0].content -%}{{ "\n\n" }}{%- endif -%}
# Tools{{ "\n\n" }}You may call one or more functions to help with the user's request. Their signatures:{{ "\n" }}<tools>{{ "\n" }}
{%- for t in tools -%}
{{ (t.function if t.function is defined else t) | tojson }}{{ "\n" }}
{%- endfor -%}
</tools>{{ "\n\n" }}To call a function, answer with one block per call:{{ "\n" }}<tool_call>{{ "\n" }}{"name": <function name>, "arguments": <arguments as a JSON object>}{{ "\n" }}</tool_call>
{%- endif -%}
{%- for m in turns -%}
{%- if m.role == "user" -%}
<_user>{{ m.content }}
{%- elif m.role == "assistant" -%}
<_bot></think>{{ m.content }}
{%- for tc in (m.tool_calls or []) -%}
{%- set f = tc.function if tc.function is defined else tc -%}
{%- if m.content or not loop.first -%}{{ "\n" }}{%- endif -%}
<tool_call>{{ "\n" }}{"name": {{ f.name | tojson }}, "arguments": {{ f.arguments | tojson }}}{{ "\n" }}</tool_call>
{%- endfor -%}
<_end>{{ "\n" }}
{%- elif m.role == "tool" -%}
{%- if loop.first or turns[loop.index0 - 1].role != "tool" -%}<_user>{%- else -%}{{ "\n" }}{%- endif -%}
<tool_response>{{ "\n" }}{{ m.content }}{{ "\n" }}</tool_response>
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
