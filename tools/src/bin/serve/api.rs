//! Request parsing and validation. Every refusal is a 4xx with OpenAI's error body naming the
//! field at fault; bodies are read field by field (not derived) so that the field can be named.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use engine::SamplingParams;
use loader::chat::ChatMessage;
use serde_json::{Map, Value, json};

pub type Obj = Map<String, Value>;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.into()),
            code: None,
        }
    }

    pub fn body(message: impl Into<String>) -> ApiError {
        ApiError {
            param: None,
            ..ApiError::invalid("", message)
        }
    }

    pub fn unauthorized() -> ApiError {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "Incorrect or missing API key: send `Authorization: Bearer <key>` with the key given to --api-key".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    pub fn loading() -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the model is still loading; retry when GET /health answers 200".into(),
            kind: "service_unavailable",
            param: None,
            code: Some("model_loading"),
        }
    }

    /// The server is draining for a shutdown: the request was not run (retry elsewhere).
    pub fn shutting_down() -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the server is shutting down and takes no new requests".into(),
            kind: "service_unavailable",
            param: None,
            code: Some("shutting_down"),
        }
    }

    /// A connection over `--max-connections`.
    pub fn too_many_connections(cap: usize) -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: format!(
                "the server holds {cap} connections (--max-connections); retry in a second"
            ),
            kind: "service_unavailable",
            param: None,
            code: Some("too_many_connections"),
        }
    }

    /// A request body that did not arrive within `--body-timeout`.
    pub fn body_timeout(limit: std::time::Duration) -> ApiError {
        ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            message: format!(
                "the request body did not arrive within {:.1} s (--body-timeout)",
                limit.as_secs_f64()
            ),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_timeout"),
        }
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("not_found"),
        }
    }

    pub fn json(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.json())).into_response()
    }
}

type R<T> = Result<T, ApiError>;

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Re-aims an error about `key` of a nested object at its full path `param`.
pub fn nested(e: ApiError, key: &str, param: &str) -> ApiError {
    ApiError::invalid(
        param,
        e.message
            .replace(&format!("`{key}`"), &format!("`{param}`")),
    )
}

fn wrong(param: &str, want: &str, got: &Value) -> ApiError {
    ApiError::invalid(
        param,
        format!("`{param}` must be {want}, got {}", kind_of(got)),
    )
}

pub fn parse_object(body: &[u8]) -> R<Obj> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::body(format!("the request body is not valid JSON: {e}")))?;
    match v {
        Value::Object(o) => Ok(o),
        other => Err(ApiError::body(format!(
            "the request body must be a JSON object, got {}",
            kind_of(&other)
        ))),
    }
}

/// A field that is absent or null reads as `None`.
fn field<'a>(o: &'a Obj, key: &str) -> Option<&'a Value> {
    o.get(key).filter(|v| !v.is_null())
}

pub fn number(o: &Obj, key: &str) -> R<Option<f64>> {
    match field(o, key) {
        None => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(v) => Err(wrong(key, "a number", v)),
    }
}

pub fn integer(o: &Obj, key: &str) -> R<Option<i64>> {
    match field(o, key) {
        None => Ok(None),
        Some(Value::Number(n)) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Ok(Some(i)),
            (None, Some(_)) => Ok(Some(i64::MAX)),
            _ => Err(ApiError::invalid(
                key,
                format!("`{key}` must be an integer, got {n}"),
            )),
        },
        Some(v) => Err(wrong(key, "an integer", v)),
    }
}

pub fn boolean(o: &Obj, key: &str) -> R<Option<bool>> {
    match field(o, key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(wrong(key, "a boolean", v)),
    }
}

pub fn string<'a>(o: &'a Obj, key: &str) -> R<Option<&'a str>> {
    match field(o, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(wrong(key, "a string", v)),
    }
}

pub fn object<'a>(o: &'a Obj, key: &str) -> R<Option<&'a Obj>> {
    match field(o, key) {
        None => Ok(None),
        Some(Value::Object(m)) => Ok(Some(m)),
        Some(v) => Err(wrong(key, "an object", v)),
    }
}

/// What every generation request carries.
/// The most choices (`n`) one request may ask for.
pub const MAX_CHOICES: usize = 64;

#[derive(Debug)]
pub struct Common {
    pub max_tokens: Option<usize>,
    /// Choices to generate (`n`): as many sequences, sharing the prompt's cache blocks.
    pub n: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub ignore_eos: bool,
}

/// The release's recommended sampling, used for fields a request leaves out.
#[derive(Clone, Copy, Debug)]
pub struct Defaults {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub repetition_penalty: f32,
}

impl Default for Defaults {
    fn default() -> Self {
        Defaults {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            repetition_penalty: 1.0,
        }
    }
}

fn in_range(key: &str, v: f64, ok: bool, range: &str) -> R<f32> {
    if ok && v.is_finite() {
        Ok(v as f32)
    } else {
        Err(ApiError::invalid(
            key,
            format!("`{key}` must be in {range}, got {v}"),
        ))
    }
}

/// `logit_bias`: an object from token id (a decimal string, as OpenAI's API has it) to a bias
/// in [-100, 100]. Whether each id is in the vocabulary is checked where the tokenizer is
/// known ([`check_logit_bias`]).
fn logit_bias(o: &Obj) -> R<Vec<(u32, f32)>> {
    let Some(v) = field(o, "logit_bias") else {
        return Ok(Vec::new());
    };
    let Value::Object(m) = v else {
        return Err(ApiError::invalid(
            "logit_bias",
            "`logit_bias` must be an object from token id to a bias in [-100, 100]",
        ));
    };
    let mut out = Vec::with_capacity(m.len());
    for (k, b) in m {
        let id: u32 = k.trim().parse().map_err(|_| {
            ApiError::invalid(
                "logit_bias",
                format!("`logit_bias` key {k:?} is not a token id"),
            )
        })?;
        let b = b
            .as_f64()
            .filter(|b| b.is_finite() && (-100.0..=100.0).contains(b))
            .ok_or_else(|| {
                ApiError::invalid(
                    "logit_bias",
                    format!("`logit_bias` of token {id} must be a number in [-100, 100], got {b}"),
                )
            })?;
        out.push((id, b as f32));
    }
    out.sort_by_key(|&(id, _)| id);
    Ok(out)
}

/// Refuses a `logit_bias` id outside a vocabulary of `vocab` tokens.
pub fn check_logit_bias(c: &Common, vocab: usize) -> R<()> {
    match c
        .sampling
        .logit_bias
        .iter()
        .find(|(id, _)| *id as usize >= vocab)
    {
        Some((id, _)) => Err(ApiError::invalid(
            "logit_bias",
            format!("`logit_bias` names token {id}, outside the vocabulary of {vocab}"),
        )),
        None => Ok(()),
    }
}

pub fn common(o: &Obj, d: &Defaults, fresh_seed: u64) -> R<Common> {
    let mut max_tokens = None;
    for key in ["max_tokens", "max_completion_tokens"] {
        if let Some(n) = integer(o, key)? {
            if n <= 0 {
                return Err(ApiError::invalid(
                    key,
                    format!("`{key}` must be at least 1, got {n}"),
                ));
            }
            max_tokens = Some(usize::try_from(n).unwrap_or(usize::MAX));
        }
    }
    let temperature = match number(o, "temperature")? {
        Some(t) => in_range("temperature", t, (0.0..=2.0).contains(&t), "[0, 2]")?,
        None => d.temperature,
    };
    let top_p = match number(o, "top_p")? {
        Some(p) => in_range("top_p", p, p > 0.0 && p <= 1.0, "(0, 1]")?,
        None => d.top_p,
    };
    let top_k = match integer(o, "top_k")? {
        Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => {
            return Err(ApiError::invalid(
                "top_k",
                format!("`top_k` must be -1 (off) or at least 0, got {k}"),
            ));
        }
        None => d.top_k,
    };
    let min_p = match number(o, "min_p")? {
        Some(p) => in_range("min_p", p, (0.0..=1.0).contains(&p), "[0, 1]")?,
        None => 0.0,
    };
    let repetition_penalty = match number(o, "repetition_penalty")? {
        Some(p) => in_range("repetition_penalty", p, p > 0.0 && p <= 2.0, "(0, 2]")?,
        None => d.repetition_penalty,
    };
    for key in ["presence_penalty", "frequency_penalty"] {
        if let Some(p) = number(o, key)? {
            in_range(key, p, (-2.0..=2.0).contains(&p), "[-2, 2]")?;
            if p != 0.0 {
                return Err(ApiError::invalid(
                    key,
                    format!("`{key}` is not supported (only 0); use repetition_penalty"),
                ));
            }
        }
    }
    let seed = match integer(o, "seed")? {
        Some(s) => s as u64,
        None => fresh_seed,
    };
    let n = match integer(o, "n")? {
        None => 1,
        Some(n) if (1..=MAX_CHOICES as i64).contains(&n) => n as usize,
        Some(n) => {
            return Err(ApiError::invalid(
                "n",
                format!("`n` must be in 1..={MAX_CHOICES}, got {n}"),
            ));
        }
    };
    let stop = match field(o, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok(s.clone()),
                other => Err(wrong(&format!("stop[{i}]"), "a string", other)),
            })
            .collect::<R<Vec<_>>>()?,
        Some(v) => return Err(wrong("stop", "a string or an array of strings", v)),
    };
    if let Some(i) = stop.iter().position(String::is_empty) {
        return Err(ApiError::invalid(
            format!("stop[{i}]"),
            "a stop sequence must not be empty",
        ));
    }
    let stream = boolean(o, "stream")?.unwrap_or(false);
    let include_usage = match object(o, "stream_options")? {
        Some(so) => {
            if !stream {
                return Err(ApiError::invalid(
                    "stream_options",
                    "`stream_options` is only allowed when `stream` is true",
                ));
            }
            boolean(so, "include_usage")
                .map_err(|e| nested(e, "include_usage", "stream_options.include_usage"))?
                .unwrap_or(false)
        }
        None => false,
    };
    let ignore_eos = boolean(o, "ignore_eos")?.unwrap_or(false);
    let logit_bias = logit_bias(o)?;
    Ok(Common {
        max_tokens,
        n,
        sampling: SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            seed,
            logit_bias,
        },
        stop,
        stream,
        include_usage,
        ignore_eos,
    })
}

/// `model`, when given, must name the served model.
pub fn check_model(o: &Obj, served: &str) -> R<()> {
    match string(o, "model")? {
        Some(m) if m != served => Err(ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{m}` does not exist; this server serves `{served}`"),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }),
        _ => Ok(()),
    }
}

/// A message's content: a string, or an array of `{"type": "text", "text": ...}` parts.
fn content(v: Option<&Value>, param: &str, allow_null: bool) -> R<String> {
    match v {
        Some(Value::String(s)) => Ok(s.clone()),
        None | Some(Value::Null) if allow_null => Ok(String::new()),
        Some(Value::Array(parts)) => {
            let mut s = String::new();
            for (j, p) in parts.iter().enumerate() {
                let pp = format!("{param}[{j}]");
                let Value::Object(p) = p else {
                    return Err(wrong(&pp, "a content part object", p));
                };
                match string(p, "type").map_err(|e| nested(e, "type", &format!("{pp}.type")))? {
                    Some("text") => {}
                    Some(other) => {
                        return Err(ApiError::invalid(
                            format!("{pp}.type"),
                            format!(
                                "`{pp}.type`: content parts of type `{other}` are not supported; only `text`"
                            ),
                        ));
                    }
                    None => {
                        return Err(ApiError::invalid(
                            format!("{pp}.type"),
                            format!("`{pp}.type` is required"),
                        ));
                    }
                }
                match p.get("text") {
                    Some(Value::String(t)) => s.push_str(t),
                    Some(v) => return Err(wrong(&format!("{pp}.text"), "a string", v)),
                    None => {
                        return Err(ApiError::invalid(
                            format!("{pp}.text"),
                            format!("`{pp}.text` is required"),
                        ));
                    }
                }
            }
            Ok(s)
        }
        None => Err(ApiError::invalid(param, format!("`{param}` is required"))),
        Some(v) => Err(wrong(param, "a string or an array of text parts", v)),
    }
}

pub fn messages(o: &Obj) -> R<Vec<ChatMessage>> {
    let list = match o.get("messages") {
        Some(Value::Array(a)) => a,
        None | Some(Value::Null) => {
            return Err(ApiError::invalid("messages", "`messages` is required"));
        }
        Some(v) => return Err(wrong("messages", "an array", v)),
    };
    if list.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must hold at least one message",
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let p = format!("messages[{i}]");
        let Value::Object(m) = m else {
            return Err(wrong(&p, "an object", m));
        };
        let role = match m.get("role") {
            Some(Value::String(r)) => r.as_str(),
            Some(v) => return Err(wrong(&format!("{p}.role"), "a string", v)),
            None => {
                return Err(ApiError::invalid(
                    format!("{p}.role"),
                    format!("`{p}.role` is required"),
                ));
            }
        };
        let role = match role {
            "system" | "developer" => "system",
            "user" | "assistant" | "tool" => role,
            other => {
                return Err(ApiError::invalid(
                    format!("{p}.role"),
                    format!(
                        "`{p}.role`: unknown role `{other}`; expected system, developer, user, assistant or tool"
                    ),
                ));
            }
        };
        let text = content(
            m.get("content"),
            &format!("{p}.content"),
            role == "assistant",
        )?;
        let optional_string = |key: &str| -> R<Option<String>> {
            match m.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(v) => Err(wrong(&format!("{p}.{key}"), "a string", v)),
            }
        };
        let reasoning_content = optional_string("reasoning_content")?;
        let tool_call_id = optional_string("tool_call_id")?;
        let name = optional_string("name")?;
        let tool_calls = match (role, m.get("tool_calls")) {
            (_, None | Some(Value::Null)) => None,
            ("assistant", Some(Value::Array(calls))) => Some(
                calls
                    .iter()
                    .enumerate()
                    .map(|(j, c)| history_call(c, &format!("{p}.tool_calls[{j}]")))
                    .collect::<R<Vec<_>>>()?,
            ),
            ("assistant", Some(v)) => return Err(wrong(&format!("{p}.tool_calls"), "an array", v)),
            (_, Some(_)) => {
                return Err(ApiError::invalid(
                    format!("{p}.tool_calls"),
                    format!("`{p}.tool_calls` is only allowed on assistant messages"),
                ));
            }
        };
        out.push(ChatMessage {
            role: role.to_string(),
            content: text,
            reasoning_content,
            tool_calls,
            tool_call_id,
            name,
        });
    }
    Ok(out)
}

/// A past call of an assistant message, `{"id", "type": "function", "function": {"name",
/// "arguments"}}`, with its arguments string parsed to JSON where it parses (the template
/// renders them as JSON).
fn history_call(c: &Value, p: &str) -> R<Value> {
    let Value::Object(c) = c else {
        return Err(wrong(p, "an object", c));
    };
    let f = object(c, "function")
        .map_err(|e| nested(e, "function", &format!("{p}.function")))?
        .ok_or_else(|| {
            ApiError::invalid(
                format!("{p}.function"),
                format!("`{p}.function` is required"),
            )
        })?;
    let name = string(f, "name")
        .map_err(|e| nested(e, "name", &format!("{p}.function.name")))?
        .ok_or_else(|| {
            ApiError::invalid(
                format!("{p}.function.name"),
                format!("`{p}.function.name` is required"),
            )
        })?;
    let arguments = match f.get("arguments") {
        None | Some(Value::Null) => json!({}),
        Some(Value::String(s)) => {
            serde_json::from_str(s).unwrap_or_else(|_| Value::from(s.clone()))
        }
        Some(v @ Value::Object(_)) => v.clone(),
        Some(v) => {
            return Err(wrong(
                &format!("{p}.function.arguments"),
                "a JSON string",
                v,
            ));
        }
    };
    let id = string(c, "id").map_err(|e| nested(e, "id", &format!("{p}.id")))?;
    Ok(json!({
        "id": id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }))
}

/// Chat `logprobs` (bool) + `top_logprobs` (0..=20): the number of alternatives, when asked.
pub fn chat_logprobs(o: &Obj) -> R<Option<usize>> {
    let on = boolean(o, "logprobs")?.unwrap_or(false);
    let top = integer(o, "top_logprobs")?;
    if let Some(t) = top {
        if !(0..=20).contains(&t) {
            return Err(ApiError::invalid(
                "top_logprobs",
                format!("`top_logprobs` must be in [0, 20], got {t}"),
            ));
        }
        if !on && t > 0 {
            return Err(ApiError::invalid(
                "top_logprobs",
                "`top_logprobs` needs `logprobs: true`",
            ));
        }
    }
    Ok(on.then_some(top.unwrap_or(0) as usize))
}

/// Completions `logprobs`: an integer in 0..=20 (alternatives per token).
pub fn completion_logprobs(o: &Obj) -> R<Option<usize>> {
    match integer(o, "logprobs")? {
        None => Ok(None),
        Some(t) if (0..=20).contains(&t) => Ok(Some(t as usize)),
        Some(t) => Err(ApiError::invalid(
            "logprobs",
            format!("`logprobs` must be in [0, 20], got {t}"),
        )),
    }
}

pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

fn token_ids(a: &[Value], param: &str) -> R<Vec<u32>> {
    a.iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| {
                    wrong(
                        &format!("{param}[{i}]"),
                        "a token id (a non-negative integer)",
                        v,
                    )
                })
        })
        .collect()
}

/// `prompt`: a string, a list of one string, a list of token ids, or a list of one such list.
pub fn prompt(o: &Obj, key: &str) -> R<Prompt> {
    let v = match field(o, key) {
        Some(v) => v,
        None => return Err(ApiError::invalid(key, format!("`{key}` is required"))),
    };
    match v {
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(a) if a.is_empty() => Err(ApiError::invalid(key, format!("`{key}` is empty"))),
        Value::Array(a) => match &a[0] {
            Value::String(s) if a.len() == 1 => Ok(Prompt::Text(s.clone())),
            Value::Number(_) => Ok(Prompt::Tokens(token_ids(a, key)?)),
            Value::Array(inner) if a.len() == 1 => {
                Ok(Prompt::Tokens(token_ids(inner, &format!("{key}[0]"))?))
            }
            Value::String(_) | Value::Array(_) => Err(ApiError::invalid(
                key,
                "one prompt per request is supported",
            )),
            other => Err(wrong(
                &format!("{key}[0]"),
                "a string, a token id or a list of token ids",
                other,
            )),
        },
        other => Err(wrong(key, "a string or an array", other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(s: &str) -> Obj {
        parse_object(s.as_bytes()).unwrap()
    }

    #[test]
    fn sampling_fields_out_of_range_are_refused_by_name() {
        let d = Defaults::default();
        for (body, param) in [
            (r#"{"temperature": -1}"#, "temperature"),
            (r#"{"temperature": "hot"}"#, "temperature"),
            (r#"{"top_p": 0}"#, "top_p"),
            (r#"{"top_k": -2}"#, "top_k"),
            (r#"{"min_p": 1.5}"#, "min_p"),
            (r#"{"repetition_penalty": 0}"#, "repetition_penalty"),
            (r#"{"max_tokens": 0}"#, "max_tokens"),
            (r#"{"max_completion_tokens": -3}"#, "max_completion_tokens"),
            (r#"{"stop": 3}"#, "stop"),
            (r#"{"stop": ["a", 1]}"#, "stop[1]"),
            (r#"{"n": 0}"#, "n"),
            (r#"{"n": 65}"#, "n"),
            (
                r#"{"stream_options": {"include_usage": true}}"#,
                "stream_options",
            ),
        ] {
            let e = common(&obj(body), &d, 0).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
            assert!(e.status.is_client_error());
            assert!(
                e.message.contains(param.split('[').next().unwrap()),
                "{body}: {}",
                e.message
            );
        }
    }

    #[test]
    fn omitted_sampling_fields_take_the_release_defaults() {
        let d = Defaults {
            temperature: 0.7,
            top_p: 0.95,
            top_k: 0,
            repetition_penalty: 1.05,
        };
        let c = common(&obj(r#"{"top_p": 0.5, "stop": "END"}"#), &d, 9).unwrap();
        assert_eq!(c.sampling.temperature, 0.7);
        assert_eq!(c.sampling.top_p, 0.5);
        assert_eq!(c.sampling.repetition_penalty, 1.05);
        assert_eq!(c.sampling.seed, 9);
        assert_eq!(c.stop, vec!["END".to_string()]);
    }

    #[test]
    fn messages_accept_text_parts_and_name_the_bad_field() {
        let m = messages(&obj(r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}"#)).unwrap();
        assert_eq!(m[0].content, "ab");
        let e = messages(&obj(r#"{"messages": [{"role": "user", "content": "x"}, {"role": "wizard", "content": "y"}]}"#)).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[1].role"));
        let e = messages(&obj(r#"{"messages": []}"#)).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
    }
}
