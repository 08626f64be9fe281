//! Tool calls: the request's `tools`, `tool_choice` and `parallel_tool_calls`; the grammar that
//! enforces a call when one is required; and the parser that finds calls in the answer (spec
//! §8.1: `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>` blocks, several back to back,
//! or a key/value-tag body `name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>` as some ports
//! of this model write it).

use llguidance::api::TopLevelGrammar;
use serde_json::{Value, json};

use crate::api::{self, ApiError, Obj};
use crate::structured::{compact, lark_literal};

type R<T> = Result<T, ApiError>;

pub use loader::toolcall::{CALL_CLOSE, CALL_OPEN, CallParser, Piece, ToolCall, valid_name};
/// The most calls an enforced answer (`tool_choice` required or named, parallel calls on) may
/// hold: the grammar must end somewhere, and a model that repeats itself would otherwise fill
/// `max_tokens` with calls.
pub const MAX_REQUIRED_CALLS: usize = 8;

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

    pub fn names(&self) -> Vec<String> {
        self.functions.iter().map(|(n, _)| n.clone()).collect()
    }
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
