//! Which output constraint a request asks for (`response_format`, `grammar`, vLLM's `guided_*`),
//! as an llguidance grammar; the constraint itself is `tools::guidance`.

use llguidance::api::TopLevelGrammar;
use serde_json::{Value, json};
use tools::guidance::json_schema_grammar;
pub use tools::guidance::{Guidance, compact, lark_literal};

use crate::api::{self, ApiError, Obj};

/// What the request constrains its output to, and the field that asked: `response_format`
/// (`json_object`, `json_schema`), `grammar` (Lark), or vLLM's `guided_json`, `guided_regex`,
/// `guided_choice`, `guided_grammar`. `None` when the output is free text.
pub fn output_grammar(o: &Obj) -> Result<Option<(TopLevelGrammar, String)>, ApiError> {
    let mut found: Vec<(TopLevelGrammar, String)> = Vec::new();
    if let Some(rf) = o.get("response_format").filter(|v| !v.is_null()) {
        let Value::Object(rf) = rf else {
            return Err(ApiError::invalid(
                "response_format",
                "`response_format` must be an object with a `type`",
            ));
        };
        match api::string(rf, "type").map_err(|e| api::nested(e, "type", "response_format.type"))? {
            Some("text") => {}
            Some("json_object") => found.push((
                json_schema_grammar(&json!({"type": "object"}), false),
                "response_format".into(),
            )),
            Some("json_schema") => {
                let js = api::object(rf, "json_schema")
                    .map_err(|e| api::nested(e, "json_schema", "response_format.json_schema"))?
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "response_format.json_schema",
                            "`response_format.json_schema` is required with type `json_schema`",
                        )
                    })?;
                let strict = api::boolean(js, "strict")
                    .map_err(|e| api::nested(e, "strict", "response_format.json_schema.strict"))?
                    .unwrap_or(false);
                let schema = match js.get("schema") {
                    None | Some(Value::Null) => json!({}),
                    Some(s @ (Value::Object(_) | Value::Bool(_))) => s.clone(),
                    Some(_) => {
                        return Err(ApiError::invalid(
                            "response_format.json_schema.schema",
                            "`response_format.json_schema.schema` must be a JSON schema object",
                        ));
                    }
                };
                found.push((
                    json_schema_grammar(&schema, strict),
                    "response_format.json_schema.schema".into(),
                ));
            }
            Some(other) => {
                return Err(ApiError::invalid(
                    "response_format.type",
                    format!(
                        "`response_format.type` must be `text`, `json_object` or `json_schema`, got `{other}`"
                    ),
                ));
            }
            None => {
                return Err(ApiError::invalid(
                    "response_format.type",
                    "`response_format.type` is required",
                ));
            }
        }
    }
    for key in ["grammar", "guided_grammar"] {
        if let Some(g) = api::string(o, key)? {
            found.push((TopLevelGrammar::from_lark(g.to_string()), key.into()));
        }
    }
    if let Some(rx) = api::string(o, "guided_regex")? {
        found.push((TopLevelGrammar::from_regex(rx), "guided_regex".into()));
    }
    if let Some(v) = o.get("guided_json").filter(|v| !v.is_null()) {
        let schema = match v {
            Value::String(s) => serde_json::from_str(s).map_err(|e| {
                ApiError::invalid("guided_json", format!("`guided_json` is not JSON: {e}"))
            })?,
            other => other.clone(),
        };
        found.push((json_schema_grammar(&schema, false), "guided_json".into()));
    }
    if let Some(v) = o.get("guided_choice").filter(|v| !v.is_null()) {
        let choices: Vec<&str> = match v {
            Value::Array(a) if !a.is_empty() => a
                .iter()
                .map(Value::as_str)
                .collect::<Option<_>>()
                .ok_or_else(|| {
                    ApiError::invalid(
                        "guided_choice",
                        "`guided_choice` must be an array of strings",
                    )
                })?,
            _ => {
                return Err(ApiError::invalid(
                    "guided_choice",
                    "`guided_choice` must be a non-empty array of strings",
                ));
            }
        };
        let alts: Vec<String> = choices.iter().map(|c| lark_literal(c)).collect();
        found.push((
            TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | "))),
            "guided_choice".into(),
        ));
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(_, p)| p.as_str()).collect();
        return Err(ApiError::invalid(
            found[1].1.clone(),
            format!(
                "only one output constraint per request; this one has {}",
                names.join(" and ")
            ),
        ));
    }
    Ok(found.pop())
}
