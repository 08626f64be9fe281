//! Tool calls: the request's `tools`, `tool_choice` and `parallel_tool_calls`; the grammar that
//! enforces a call when one is required; and the parser that finds calls in the answer (spec
//! §8.1: `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>` blocks, several back to back,
//! or a key/value-tag body `name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>` as some ports
//! of this model write it).

use llguidance::api::TopLevelGrammar;
use serde_json::{Map, Value, json};

use crate::api::{self, ApiError, Obj};
use crate::structured::{compact, lark_literal};

type R<T> = Result<T, ApiError>;

pub const CALL_OPEN: &str = "<tool_call>";
/// The most calls an enforced answer (`tool_choice` required or named, parallel calls on) may
/// hold: the grammar must end somewhere, and a model that repeats itself would otherwise fill
/// `max_tokens` with calls.
pub const MAX_REQUIRED_CALLS: usize = 8;
pub const CALL_CLOSE: &str = "</tool_call>";

#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// The request's tools.
#[derive(Clone, Debug)]
pub struct Tools {
    /// As the client sent them, for the chat template's `tools` variable.
    pub defs: Vec<Value>,
    /// Each function's name and parameter schema, in order.
    pub functions: Vec<(String, Value)>,
    pub choice: ToolChoice,
    pub parallel: bool,
}

impl Tools {
    /// Whether the answer is searched for calls (tools declared and not switched off).
    pub fn parse_calls(&self) -> bool {
        self.choice != ToolChoice::None
    }

    fn names(&self) -> Vec<String> {
        self.functions.iter().map(|(n, _)| n.clone()).collect()
    }
}

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

/// `tools`, `tool_choice` and `parallel_tool_calls`; `None` when no tools are declared.
pub fn parse(o: &Obj) -> R<Option<Tools>> {
    for key in ["functions", "function_call"] {
        if o.get(key).is_some_and(|v| !v.is_null()) {
            return Err(ApiError::invalid(
                key,
                format!("`{key}` is OpenAI's deprecated form; send `tools` and `tool_choice`"),
            ));
        }
    }
    let parallel = api::boolean(o, "parallel_tool_calls")?.unwrap_or(true);
    let list = match o.get("tools") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(_) => {
            return Err(ApiError::invalid(
                "tools",
                "`tools` must be an array of function tools",
            ));
        }
    };
    let mut functions: Vec<(String, Value)> = Vec::new();
    for (i, t) in list.iter().enumerate() {
        let p = format!("tools[{i}]");
        let Value::Object(t) = t else {
            return Err(ApiError::invalid(&p, format!("`{p}` must be an object")));
        };
        match api::string(t, "type").map_err(|e| api::nested(e, "type", &format!("{p}.type")))? {
            Some("function") => {}
            other => {
                return Err(ApiError::invalid(
                    format!("{p}.type"),
                    format!(
                        "`{p}.type` must be `function`, got {}",
                        other.map_or("nothing".into(), |o| format!("`{o}`"))
                    ),
                ));
            }
        }
        let f = api::object(t, "function")
            .map_err(|e| api::nested(e, "function", &format!("{p}.function")))?
            .ok_or_else(|| {
                ApiError::invalid(
                    format!("{p}.function"),
                    format!("`{p}.function` is required"),
                )
            })?;
        let name = api::string(f, "name")
            .map_err(|e| api::nested(e, "name", &format!("{p}.function.name")))?
            .unwrap_or_default();
        if !valid_name(name) {
            return Err(ApiError::invalid(
                format!("{p}.function.name"),
                format!(
                    "`{p}.function.name` must be 1 to 64 letters, digits, `_`, `-` or `.`, got {name:?}"
                ),
            ));
        }
        if functions.iter().any(|(n, _)| n == name) {
            return Err(ApiError::invalid(
                format!("{p}.function.name"),
                format!("`{p}.function.name`: the function `{name}` is declared twice"),
            ));
        }
        let params = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object"}),
            Some(v @ Value::Object(_)) => v.clone(),
            Some(_) => {
                return Err(ApiError::invalid(
                    format!("{p}.function.parameters"),
                    format!("`{p}.function.parameters` must be a JSON schema object"),
                ));
            }
        };
        functions.push((name.to_string(), params));
    }
    let choice = match o.get("tool_choice") {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "`tool_choice` must be `none`, `auto`, `required` or a function, got `{other}`"
                    ),
                ));
            }
        },
        Some(Value::Object(c)) => {
            let name = api::object(c, "function")
                .ok()
                .flatten()
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tool_choice",
                        "`tool_choice` as an object must be {\"type\": \"function\", \"function\": {\"name\": …}}",
                    )
                })?;
            ToolChoice::Named(name.to_string())
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "tool_choice",
                "`tool_choice` must be a string or an object",
            ));
        }
    };
    if functions.is_empty() {
        return match choice {
            ToolChoice::None | ToolChoice::Auto => Ok(None),
            _ => Err(ApiError::invalid(
                "tool_choice",
                "`tool_choice` asks for a call but `tools` declares no function",
            )),
        };
    }
    if let ToolChoice::Named(n) = &choice
        && !functions.iter().any(|(f, _)| f == n)
    {
        return Err(ApiError::invalid(
            "tool_choice",
            format!("`tool_choice` names `{n}`, which `tools` does not declare"),
        ));
    }
    Ok(Some(Tools {
        defs: list,
        functions,
        choice,
        parallel,
    }))
}

/// The grammar of the answer when a call is required (`required` or a named function): one call
/// block, or several back to back with `parallel_tool_calls`, each a JSON object whose `name`
/// is a declared function (the named one) and whose `arguments` match its parameters. The
/// markers are the vocabulary's tokens where it has them (`call_ids`), else text.
pub fn required_grammar(
    tools: &Tools,
    call_ids: (Option<u32>, Option<u32>),
) -> Option<TopLevelGrammar> {
    let allowed: Vec<&(String, Value)> = match &tools.choice {
        ToolChoice::Required => tools.functions.iter().collect(),
        ToolChoice::Named(n) => tools.functions.iter().filter(|(f, _)| f == n).collect(),
        _ => return None,
    };
    let alternatives: Vec<Value> = allowed
        .iter()
        .map(|(name, params)| {
            json!({
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        })
        .collect();
    let schema = if alternatives.len() == 1 {
        alternatives[0].clone()
    } else {
        json!({"anyOf": alternatives})
    };
    let body = compact(schema, true);
    let marker = |id: Option<u32>, text: &str| match id {
        Some(id) => format!("<[{id}]>"),
        None => lark_literal(text),
    };
    let open = marker(call_ids.0, CALL_OPEN);
    let close = marker(call_ids.1, CALL_CLOSE);
    let repeat = if tools.parallel {
        format!(" (\"\\n\" call){{0,{}}}", MAX_REQUIRED_CALLS - 1)
    } else {
        String::new()
    };
    Some(TopLevelGrammar::from_lark(format!(
        "start: call{repeat}\ncall: {open} \"\\n\" %json {body} \"\\n\" {close}\n"
    )))
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

/// A piece of the answer: text, or a whole call.
#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    Text(String),
    Call(ToolCall),
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
    /// Whitespace-only text held until something other than a call follows it.
    held_space: String,
    calls: usize,
}

impl CallParser {
    pub fn new(tools: &Tools, id_prefix: String) -> CallParser {
        CallParser {
            functions: tools.names(),
            id_prefix,
            buf: String::new(),
            in_block: false,
            held_space: String::new(),
            calls: 0,
        }
    }

    pub fn calls(&self) -> usize {
        self.calls
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.in_block {
                let Some(at) = self.buf.find(CALL_CLOSE) else {
                    break;
                };
                let body = self.buf[..at].to_string();
                self.buf.drain(..at + CALL_CLOSE.len());
                self.in_block = false;
                match self.parse_body(&body) {
                    Some(call) => {
                        self.held_space.clear();
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
        let rest = if std::mem::take(&mut self.in_block) {
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

    fn text(&mut self, t: String, out: &mut Vec<Piece>) {
        if t.is_empty() {
            return;
        }
        if t.trim().is_empty() {
            self.held_space.push_str(&t);
            return;
        }
        let mut s = std::mem::take(&mut self.held_space);
        s.push_str(&t);
        match out.last_mut() {
            Some(Piece::Text(prev)) => prev.push_str(&s),
            _ => out.push(Piece::Text(s)),
        }
    }

    fn parse_body(&mut self, body: &str) -> Option<ToolCall> {
        let body = body.trim();
        let (name, arguments) = if body.starts_with('{') {
            json_body(body)?
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

    fn tools(o: Value) -> Tools {
        parse(o.as_object().unwrap()).unwrap().unwrap()
    }

    fn weather() -> Tools {
        tools(json!({"tools": [
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
            {"type": "function", "function": {"name": "add"}},
        ]}))
    }

    /// Feeds `pieces` one by one; returns (text, calls).
    fn run(pieces: &[&str]) -> (String, Vec<ToolCall>) {
        let mut p = CallParser::new(&weather(), "x".into());
        let mut out: Vec<Piece> = pieces.iter().flat_map(|t| p.push(t)).collect();
        out.extend(p.finish());
        let mut text = String::new();
        let mut calls = Vec::new();
        for piece in out {
            match piece {
                Piece::Text(t) => text.push_str(&t),
                Piece::Call(c) => calls.push(c),
            }
        }
        (text, calls)
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
        assert_eq!(calls[0].arguments, r#"{"city":"Paris"}"#);
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
        assert_eq!(many.1[0].arguments, r#"{"city":"Rome"}"#);
    }

    #[test]
    fn a_partial_marker_is_held_until_decided() {
        let mut p = CallParser::new(&weather(), "x".into());
        assert_eq!(p.push("Hello <tool_"), vec![Piece::Text("Hello ".into())]);
        assert_eq!(p.push("ca"), vec![]);
        assert_eq!(p.push("t>"), vec![Piece::Text("<tool_cat>".into())]);
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
    fn tool_choice_must_name_a_declared_function_and_needs_tools() {
        let e = parse(json!({"tool_choice": "required"}).as_object().unwrap()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        let e = parse(
            json!({"tools": [{"type": "function", "function": {"name": "a"}}],
                   "tool_choice": {"type": "function", "function": {"name": "b"}}})
            .as_object()
            .unwrap(),
        )
        .unwrap_err();
        assert!(e.message.contains("`b`"), "{}", e.message);
        let e = parse(
            json!({"tools": [{"type": "function", "function": {"name": "a b"}}]})
                .as_object()
                .unwrap(),
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].function.name"));
    }

    #[test]
    fn a_required_call_grammar_uses_the_marker_tokens_and_names_each_function() {
        let mut t = weather();
        t.choice = ToolChoice::Required;
        let g = required_grammar(&t, (Some(11), Some(12))).unwrap();
        let lark = g.grammars[0].lark_grammar.clone().unwrap();
        assert!(lark.contains("<[11]>") && lark.contains("<[12]>"), "{lark}");
        assert!(
            lark.contains("get_weather") && lark.contains("\"add\""),
            "{lark}"
        );
        assert!(lark.contains("(\"\\n\" call){0,7}"), "{lark}");
        t.parallel = false;
        t.choice = ToolChoice::Named("add".into());
        let lark = required_grammar(&t, (None, None)).unwrap().grammars[0]
            .lark_grammar
            .clone()
            .unwrap();
        assert!(
            !lark.contains("get_weather") && !lark.contains("call){"),
            "{lark}"
        );
        assert!(lark.contains("\"<tool_call>\""), "{lark}");
    }
}
