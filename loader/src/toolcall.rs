//! Tool calls in a generated answer (spec §8.1): `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>`
//! blocks, several back to back, or a key/value-tag body `name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>`
//! as some ports of this model write it. The parser reads the answer as it streams.

use serde_json::{Map, Value};

pub const CALL_OPEN: &str = "<tool_call>";
pub const CALL_CLOSE: &str = "</tool_call>";

/// A function name as OpenAI's API allows it.
pub fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

/// One call found in the answer.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    /// Its place among the choice's calls.
    pub index: usize,
    pub id: String,
    pub name: String,
    /// A JSON object, as a string (OpenAI's `function.arguments`).
    pub arguments: String,
}

/// A piece of the answer: text, a whole call, or a call in parts as it is generated.
#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    Text(String),
    /// A call decided when its block closed.
    Call(ToolCall),
    /// A streamed call's start (its form is guaranteed by a grammar, so it is not held):
    /// its id and name, then its arguments in [`Piece::CallArguments`] pieces.
    CallStart {
        index: usize,
        id: String,
        name: String,
    },
    CallArguments {
        index: usize,
        text: String,
    },
}

/// How far a block's body matches the form the call grammar writes,
/// `{"name": "f", "arguments": …}`.
enum Head<'a> {
    Undecided,
    Other,
    /// The name, and the byte offset of the arguments in the body.
    Canonical(&'a str, usize),
}

fn canonical_head(body: &str) -> Head<'_> {
    const NAME: &str = "{\"name\": \"";
    const ARGS: &str = ", \"arguments\": ";
    let t = body.trim_start();
    let lead = body.len() - t.len();
    let Some(rest) = t.strip_prefix(NAME) else {
        return if NAME.starts_with(t) {
            Head::Undecided
        } else {
            Head::Other
        };
    };
    let Some(q) = rest.find('"') else {
        return if rest
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b))
        {
            Head::Undecided
        } else {
            Head::Other
        };
    };
    let after = &rest[q + 1..];
    if !after.starts_with(ARGS) {
        return if ARGS.starts_with(after) {
            Head::Undecided
        } else {
            Head::Other
        };
    }
    Head::Canonical(&rest[..q], lead + NAME.len() + q + 1 + ARGS.len())
}

/// Where the arguments of a body (its text from their start) end: before the body's closing
/// brace and the whitespace around it.
fn arguments_end(body: &str) -> usize {
    let t = body.trim_end();
    t.strip_suffix('}').unwrap_or(t).trim_end().len()
}

/// Finds call blocks in streamed content. Text that may start a block marker is held back
/// until decided; a block is held until it closes, then returned as a call when its body
/// parses and names a declared function, else as the text it was. Whitespace around calls is
/// dropped (it is structure, not content).
pub struct CallParser {
    functions: Vec<String>,
    /// Call ids are `call_{prefix}{index}`.
    id_prefix: String,
    buf: String,
    in_block: bool,
    /// Trailing whitespace, held until text follows it (a call or the end of an answer with
    /// calls drops it).
    held_space: String,
    /// No text since the last call: the whitespace that follows it is dropped.
    after_call: bool,
    calls: usize,
    /// Stream calls of the canonical form as they are generated.
    stream: bool,
    /// The open block's call being streamed: its index and the bytes of `buf` sent.
    streaming: Option<(usize, usize)>,
    /// The open block is not of the canonical form (or names no declared function): held.
    held_block: bool,
}

impl CallParser {
    /// `functions`: the declared names (a call to another is text).
    pub fn new(functions: Vec<String>, id_prefix: String) -> CallParser {
        CallParser {
            functions,
            id_prefix,
            buf: String::new(),
            in_block: false,
            held_space: String::new(),
            after_call: false,
            calls: 0,
            stream: false,
            streaming: None,
            held_block: false,
        }
    }

    /// Streams the calls whose form a grammar guarantees (a required call): the name once it
    /// is known, the arguments as they come. Any other block is still held until it closes.
    pub fn streaming(mut self, on: bool) -> CallParser {
        self.stream = on;
        self
    }

    pub fn calls(&self) -> usize {
        self.calls
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.in_block {
                if self.stream && self.streaming.is_none() && !self.held_block {
                    match canonical_head(&self.buf) {
                        Head::Undecided => {}
                        Head::Canonical(name, at) if self.functions.iter().any(|f| f == name) => {
                            let index = self.calls;
                            self.calls += 1;
                            self.held_space.clear();
                            out.push(Piece::CallStart {
                                index,
                                id: format!("call_{}{index}", self.id_prefix),
                                name: name.to_string(),
                            });
                            self.streaming = Some((index, at));
                        }
                        _ => self.held_block = true,
                    }
                }
                let close = self.buf.find(CALL_CLOSE);
                if let Some((index, sent)) = self.streaming {
                    let end = match close {
                        Some(at) => arguments_end(&self.buf[..at]),
                        None => {
                            let end = self.buf.len() - partial_suffix(&self.buf, CALL_CLOSE);
                            let t = self.buf[..end].trim_end();
                            t.strip_suffix('}').unwrap_or(t).len()
                        }
                    };
                    if end > sent {
                        out.push(Piece::CallArguments {
                            index,
                            text: self.buf[sent..end].to_string(),
                        });
                        self.streaming = Some((index, end));
                    }
                }
                let Some(at) = close else {
                    break;
                };
                let body = self.buf[..at].to_string();
                self.buf.drain(..at + CALL_CLOSE.len());
                self.in_block = false;
                self.held_block = false;
                if self.streaming.take().is_some() {
                    self.after_call = true;
                    continue;
                }
                match self.parse_body(&body) {
                    Some(call) => {
                        self.held_space.clear();
                        self.after_call = true;
                        out.push(Piece::Call(call));
                    }
                    None => self.text(format!("{CALL_OPEN}{body}{CALL_CLOSE}"), &mut out),
                }
                continue;
            }
            match self.buf.find(CALL_OPEN) {
                Some(at) => {
                    let before: String = self.buf.drain(..at + CALL_OPEN.len()).collect();
                    self.text(before[..at].to_string(), &mut out);
                    self.in_block = true;
                }
                None => {
                    let keep = partial_suffix(&self.buf, CALL_OPEN);
                    let ready: String = self.buf.drain(..self.buf.len() - keep).collect();
                    self.text(ready, &mut out);
                    break;
                }
            }
        }
        out
    }

    /// The end of the answer: an unclosed block and held text are text.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buf);
        // A streamed call cut short keeps what was sent (its arguments end unclosed).
        let rest = if self.streaming.take().is_some() {
            self.in_block = false;
            String::new()
        } else if std::mem::take(&mut self.in_block) {
            format!("{CALL_OPEN}{rest}")
        } else {
            rest
        };
        self.text(rest, &mut out);
        if self.calls == 0 && !self.held_space.is_empty() {
            out.push(Piece::Text(std::mem::take(&mut self.held_space)));
        }
        out
    }

    /// Text of the answer. A run of whitespace next to a call (before it, after it, or at the
    /// end of an answer that has calls) is structure and dropped; the rule depends on the text
    /// alone, not on how it was cut into pieces.
    fn text(&mut self, t: String, out: &mut Vec<Piece>) {
        let body = t.trim_end();
        if body.is_empty() {
            self.held_space.push_str(&t);
            return;
        }
        let trailing = t[body.len()..].to_string();
        let s = if std::mem::take(&mut self.after_call) {
            self.held_space.clear();
            body.trim_start().to_string()
        } else {
            let mut s = std::mem::take(&mut self.held_space);
            s.push_str(body);
            s
        };
        self.held_space = trailing;
        match out.last_mut() {
            Some(Piece::Text(prev)) => prev.push_str(&s),
            _ => out.push(Piece::Text(s)),
        }
    }

    fn parse_body(&mut self, body: &str) -> Option<ToolCall> {
        let body = body.trim();
        let (name, arguments) = if body.starts_with('{') {
            let (name, args) = json_body(body)?;
            // The arguments as written where the body has the canonical form (what a
            // streamed call sends), else as parsed.
            match canonical_head(body) {
                Head::Canonical(n, at) if n == name => {
                    let raw = &body[at..arguments_end(body)];
                    match serde_json::from_str::<Value>(raw) {
                        Ok(Value::Object(_)) => (name, raw.to_string()),
                        _ => (name, args),
                    }
                }
                _ => (name, args),
            }
        } else {
            tagged_body(body)?
        };
        if !self.functions.contains(&name) {
            return None;
        }
        let index = self.calls;
        self.calls += 1;
        Some(ToolCall {
            index,
            id: format!("call_{}{index}", self.id_prefix),
            name,
            arguments,
        })
    }
}

/// `{"name": "f", "arguments": {...}}` (`parameters` is read as `arguments`; arguments given as
/// a string holding JSON are taken as that JSON).
fn json_body(body: &str) -> Option<(String, String)> {
    let Value::Object(m) = serde_json::from_str::<Value>(body).ok()? else {
        return None;
    };
    let name = m.get("name")?.as_str()?.to_string();
    let args = m.get("arguments").or_else(|| m.get("parameters"));
    let args = match args {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(v @ Value::Object(_)) => v,
            _ => return None,
        },
        Some(v @ Value::Object(_)) => v.clone(),
        Some(_) => return None,
    };
    Some((name, args.to_string()))
}

/// `name` then `<arg_key>k</arg_key>` `<arg_value>v</arg_value>` pairs; a value that parses as
/// JSON is that JSON, else a string.
fn tagged_body(body: &str) -> Option<(String, String)> {
    let (name, mut rest) = match body.find("<arg_key>") {
        Some(at) => (body[..at].trim(), &body[at..]),
        None => (body, ""),
    };
    if !valid_name(name) {
        return None;
    }
    let mut args = Map::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        let k = rest.strip_prefix("<arg_key>")?;
        let (key, after) = k.split_once("</arg_key>")?;
        let v = after.trim_start().strip_prefix("<arg_value>")?;
        let (value, after) = v.split_once("</arg_value>")?;
        let value = serde_json::from_str::<Value>(value).unwrap_or_else(|_| Value::from(value));
        args.insert(key.trim().to_string(), value);
        rest = after;
    }
    Some((name.to_string(), Value::Object(args).to_string()))
}

/// Length of the longest suffix of `text` that is a proper prefix of `marker`.
fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len())
        .rev()
        .find(|&k| {
            k <= text.len() && text.is_char_boundary(text.len() - k) && text.ends_with(&marker[..k])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn names() -> Vec<String> {
        vec!["get_weather".into(), "add".into()]
    }

    /// Feeds `pieces` one by one; returns (text, calls).
    fn run(pieces: &[&str]) -> (String, Vec<ToolCall>) {
        run_with(pieces, false).0
    }

    /// The text and calls, and how many pieces carried each call's arguments.
    fn run_with(pieces: &[&str], stream: bool) -> ((String, Vec<ToolCall>), Vec<usize>) {
        let mut p = CallParser::new(names(), "x".into()).streaming(stream);
        let mut out: Vec<Piece> = pieces.iter().flat_map(|t| p.push(t)).collect();
        out.extend(p.finish());
        let mut text = String::new();
        let mut calls: Vec<ToolCall> = Vec::new();
        let mut parts = Vec::new();
        for piece in out {
            match piece {
                Piece::Text(t) => text.push_str(&t),
                Piece::Call(c) => {
                    calls.push(c);
                    parts.push(1);
                }
                Piece::CallStart { index, id, name } => {
                    assert_eq!(index, calls.len());
                    calls.push(ToolCall {
                        index,
                        id,
                        name,
                        arguments: String::new(),
                    });
                    parts.push(0);
                }
                Piece::CallArguments { index, text } => {
                    calls[index].arguments.push_str(&text);
                    parts[index] += 1;
                }
            }
        }
        ((text, calls), parts)
    }

    #[test]
    fn a_streamed_call_sends_its_name_before_the_block_closes_then_its_arguments_in_pieces() {
        let block = "Ok.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\", \"days\": [1, 2]}}\n</tool_call>";
        let chars: Vec<String> = block.chars().map(String::from).collect();
        let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
        let (streamed, parts) = run_with(&refs, true);
        let (whole, _) = run_with(&[block], false);
        assert_eq!(streamed, whole);
        assert_eq!(whole.1[0].arguments, r#"{"city": "Rome", "days": [1, 2]}"#);
        assert!(parts[0] > 5, "the arguments came in {} pieces", parts[0]);
        // The name is out once the arguments key is, long before the block closes.
        let mut p = CallParser::new(names(), "x".into()).streaming(true);
        let head = "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\"";
        let out = p.push(head);
        assert!(
            matches!(&out[0], Piece::CallStart { name, .. } if name == "add"),
            "{out:?}"
        );
        assert_eq!(
            out[1],
            Piece::CallArguments {
                index: 0,
                text: "{\"a\"".into()
            }
        );
    }

    #[test]
    fn a_block_of_another_form_is_held_even_when_streaming() {
        let block = "<tool_call>{\"arguments\": {}, \"name\": \"add\"}</tool_call>";
        let ((text, calls), parts) = run_with(&[&block[..20], &block[20..]], true);
        assert_eq!(text, "");
        assert_eq!((calls[0].name.as_str(), parts[0]), ("add", 1));
        assert_eq!(calls[0].arguments, "{}");
    }

    #[test]
    fn two_calls_back_to_back_are_two_calls_in_order() {
        let (text, calls) = run(&[
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n",
            "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>",
        ]);
        assert_eq!(text, "");
        assert_eq!(calls.len(), 2);
        assert_eq!((calls[0].index, calls[0].name.as_str()), (0, "get_weather"));
        assert_eq!(calls[0].arguments, r#"{"city": "Paris"}"#);
        assert_eq!((calls[1].index, calls[1].name.as_str()), (1, "add"));
        assert_ne!(calls[0].id, calls[1].id);
    }

    #[test]
    fn a_call_split_over_many_deltas_is_the_same_call() {
        let whole = "Let me check.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>";
        let one = run(&[whole]);
        let chars: Vec<String> = whole.chars().map(String::from).collect();
        let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
        let many = run(&refs);
        assert_eq!(one, many);
        assert_eq!(many.0, "Let me check.");
        assert_eq!(many.1[0].arguments, r#"{"city": "Rome"}"#);
    }

    #[test]
    fn a_partial_marker_is_held_until_decided() {
        let mut p = CallParser::new(names(), "x".into());
        assert_eq!(p.push("Hello <tool_"), vec![Piece::Text("Hello".into())]);
        assert_eq!(p.push("ca"), vec![]);
        assert_eq!(p.push("t>"), vec![Piece::Text(" <tool_cat>".into())]);
    }

    #[test]
    fn malformed_json_inside_a_block_is_returned_as_content() {
        let block =
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>";
        let (text, calls) = run(&[block]);
        assert!(calls.is_empty());
        assert_eq!(text, block);
    }

    #[test]
    fn an_undeclared_function_or_an_unclosed_block_is_content() {
        let (text, calls) =
            run(&["<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>"]);
        assert!(calls.is_empty());
        assert!(text.contains("rm_rf"));
        let (text, calls) = run(&["<tool_call>\n{\"name\": \"add\""]);
        assert!(calls.is_empty());
        assert_eq!(text, "<tool_call>\n{\"name\": \"add\"");
    }

    #[test]
    fn the_key_value_tag_body_is_read_as_arguments() {
        let (_, calls) = run(&[
            "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        ]);
        assert_eq!(calls[0].name, "get_weather");
        let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
        assert_eq!(args, json!({"city": "Oslo", "days": 3}));
    }

    #[test]
    fn arguments_given_as_a_json_string_are_that_json() {
        let (_, calls) =
            run(&["<tool_call>{\"name\": \"add\", \"arguments\": \"{\\\"a\\\": 2}\"}</tool_call>"]);
        assert_eq!(calls[0].arguments, r#"{"a":2}"#);
    }

    #[test]
    fn whitespace_next_to_a_call_is_dropped_however_the_text_is_cut() {
        let text =
            "Sure:  \n<tool_call>{\"name\": \"add\", \"arguments\": {}}</tool_call>  \n then  \n";
        let whole = run(&[text]);
        assert_eq!(whole.0, "Sure:then");
        for cut in 1..text.len() {
            if text.is_char_boundary(cut) {
                assert_eq!(run(&[&text[..cut], &text[cut..]]), whole, "cut at {cut}");
            }
        }
        // Without calls, the text is returned as it was.
        assert_eq!(run(&["a  \n", " b \n"]).0, "a  \n b \n");
    }
}
