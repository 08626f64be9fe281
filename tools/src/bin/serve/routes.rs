//! The HTTP surface: OpenAI's chat and completion endpoints, models, health, metrics, and
//! vLLM's tokenize/detokenize.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock, mpsc};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use engine::TokenConstraint;
use engine::sampling::Rng;
use engine::{FinishReason, GenerateRequest};
use loader::chat::{ChatError, ChatTemplate, MarkerGuard, prompt_pieces};
use loader::tokenizer::Tokenizer;
use serde_json::{Value, json};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use crate::api::{self, ApiError, Common, Defaults, Obj, Prompt};
use crate::metrics::Metrics;
use crate::sse::{CancelGuard, SseBody};
use crate::structured::{Guidance, output_grammar};
use crate::toolcall::{self, CallParser, ToolCall, Tools};
use crate::worker::{Delta, Done, Event, Job, Shutdown, ThinkIds, TokenLogprob};

/// What exists once the model is loaded.
pub struct Ready {
    pub tokenizer: Arc<Tokenizer>,
    pub template: Option<ChatTemplate>,
    pub jobs: mpsc::Sender<Job>,
    pub defaults: Defaults,
    pub think: ThinkIds,
    /// Prepend BOS to every prompt (the tokenizer's own setting).
    pub bos: Option<u32>,
    /// Ids that end a chat turn; a raw completion ends on EOS only.
    pub chat_stops: Vec<u32>,
    pub eos_stops: Vec<u32>,
    /// The strings the tokenizer parses as tokens: inside a message they are text.
    pub markers: Vec<String>,
    /// Structured outputs (None when the vocabulary has no end-of-turn token to end them).
    pub guidance: Option<Guidance>,
}

/// A chat prompt as the template rendered it, with the marker strings its messages held.
pub struct Rendered {
    text: String,
    literals: Vec<String>,
}

pub struct App {
    pub served: String,
    pub api_key: Option<String>,
    pub max_model_len: usize,
    /// Silence after which a stream gets a `: keep-alive` comment.
    pub keep_alive: Duration,
    /// How long a request's body may take to arrive.
    pub body_timeout: Duration,
    pub created: u64,
    pub metrics: Arc<Metrics>,
    pub ready: OnceLock<Ready>,
    /// Set by SIGTERM/SIGINT; read by the routes and the engine thread.
    pub shutdown: Arc<Shutdown>,
    ids: AtomicU64,
}

type R<T> = Result<T, ApiError>;

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl App {
    pub fn new(
        served: String,
        api_key: Option<String>,
        max_model_len: usize,
        keep_alive: Duration,
        body_timeout: Duration,
        metrics: Arc<Metrics>,
    ) -> App {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        App {
            served,
            api_key,
            max_model_len,
            keep_alive,
            body_timeout,
            created: now_secs(),
            metrics,
            ready: OnceLock::new(),
            shutdown: Arc::default(),
            ids: AtomicU64::new(nanos ^ u64::from(std::process::id()) << 32),
        }
    }

    /// The loaded model, unless it is still loading or the server is shutting down.
    fn ready(&self) -> R<&Ready> {
        if self.shutdown.draining.load(Relaxed) {
            return Err(ApiError::shutting_down());
        }
        self.ready.get().ok_or_else(ApiError::loading)
    }

    fn authorize(&self, headers: &HeaderMap) -> R<()> {
        let Some(key) = &self.api_key else {
            return Ok(());
        };
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        match given {
            Some(g) if g == key => Ok(()),
            _ => Err(ApiError::unauthorized()),
        }
    }

    /// A fresh 64-bit value per call: request ids and unseeded sampling.
    fn fresh(&self) -> u64 {
        Rng::new(self.ids.fetch_add(1, Relaxed)).next_u64()
    }

    fn request_id(&self, prefix: &str) -> String {
        format!("{prefix}-{:016x}{:016x}", self.fresh(), self.fresh())
    }

    fn check_prompt_len(&self, n: usize, param: &str) -> R<()> {
        if n == 0 {
            return Err(ApiError::invalid(
                param,
                format!("`{param}` encodes to no tokens"),
            ));
        }
        if n >= self.max_model_len {
            return Err(ApiError::invalid(
                param,
                format!(
                    "`{param}` is {n} tokens, but this server's context is {} tokens (--max-model-len) and must leave room for at least one generated token",
                    self.max_model_len
                ),
            ));
        }
        Ok(())
    }
}

impl Ready {
    fn encode(&self, text: &str, param: &str) -> R<Vec<u32>> {
        let mut ids: Vec<u32> = self.bos.into_iter().collect();
        let body = self
            .tokenizer
            .encode(text, true)
            .map_err(|e| ApiError::invalid(param, format!("the text cannot be tokenized: {e}")))?;
        ids.extend(body);
        Ok(ids)
    }

    /// The chat prompt's ids: the template's markers as tokens, every string of a message
    /// (markers included) as ordinary text.
    fn encode_chat(&self, r: &Rendered) -> R<Vec<u32>> {
        let mut ids: Vec<u32> = self.bos.into_iter().collect();
        let body = self
            .tokenizer
            .encode_prompt(&prompt_pieces(&r.text, &r.literals))
            .map_err(|e| {
                ApiError::invalid("messages", format!("the text cannot be tokenized: {e}"))
            })?;
        ids.extend(body);
        Ok(ids)
    }

    fn render(
        &self,
        o: &Obj,
        add_generation_prompt: bool,
        tools: Option<&Tools>,
    ) -> R<(Rendered, bool)> {
        let mut messages = api::messages(o)?;
        let mut guard = MarkerGuard::new(&self.markers);
        guard.messages(&mut messages);
        let mut tool_defs = tools.map(|t| Value::Array(t.defs.clone()));
        if let Some(defs) = tool_defs.as_mut() {
            guard.json(defs);
        }
        let literals = guard.into_literals();
        let kwargs = api::object(o, "chat_template_kwargs")?;
        let enable_thinking = match kwargs {
            Some(k) => api::boolean(k, "enable_thinking")
                .map_err(|e| {
                    api::nested(e, "enable_thinking", "chat_template_kwargs.enable_thinking")
                })?
                .unwrap_or(true),
            None => true,
        };
        let template = self.template.as_ref().ok_or_else(|| {
            ApiError::invalid(
                "messages",
                "this checkpoint has no chat template; use /v1/completions",
            )
        })?;
        let mut extra = kwargs.cloned().unwrap_or_default();
        if let Some(defs) = tool_defs {
            extra.insert("tools".into(), defs);
        }
        let extra = (!extra.is_empty()).then_some(Value::Object(extra));
        let text = template
            .render(
                &messages,
                add_generation_prompt,
                enable_thinking,
                extra.as_ref(),
            )
            .map_err(|e| match e {
                ChatError::Raised(m) => ApiError::invalid("messages", m),
                ChatError::Extra(m) => ApiError::invalid("chat_template_kwargs", m),
                other => ApiError::invalid("messages", other.to_string()),
            })?;
        Ok((Rendered { text, literals }, enable_thinking))
    }
}

pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .fallback(|| async { ApiError::not_found("no such endpoint").into_response() })
        .method_not_allowed_fallback(|| async {
            ApiError {
                status: StatusCode::METHOD_NOT_ALLOWED,
                code: Some("method_not_allowed"),
                ..ApiError::not_found("this endpoint does not take that method")
            }
            .into_response()
        })
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            json_errors,
        ))
        .with_state(app)
}

/// Whether reading a body failed on its length limit (`http-body-util`'s `LengthLimitError`,
/// known here by its message: the type is not one of this crate's dependencies).
fn over_limit(e: &axum::Error) -> bool {
    let mut cause: Option<&dyn std::error::Error> = Some(e);
    while let Some(c) = cause {
        if c.to_string().contains("length limit exceeded") {
            return true;
        }
        cause = c.source();
    }
    false
}

/// The most bytes a request body may have (axum's default limit, stated here so that the
/// early refusal below and the body extractor agree).
pub const BODY_LIMIT: usize = 2 << 20;

/// Every error a client gets is OpenAI-shaped JSON: a `Content-Length` over [`BODY_LIMIT`] is
/// refused before any of the body is read, and an extractor's plain-text rejection (a
/// chunked body that grows past the limit, a missing header) is rewritten as JSON.
///
/// The body is read here, within `--body-timeout` (a client that stops sending gets a JSON 408
/// and its connection back instead of holding the request open).
async fn json_errors(
    State(app): State<Arc<App>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if let Some(len) = declared.filter(|&len| len > BODY_LIMIT as u64) {
        return too_large(format!(
            "the request body of {len} bytes (Content-Length) is over the limit of {BODY_LIMIT} bytes"
        ));
    }
    let (parts, body) = req.into_parts();
    let read = tokio::time::timeout(app.body_timeout, axum::body::to_bytes(body, BODY_LIMIT));
    let bytes = match read.await {
        Err(_) => return ApiError::body_timeout(app.body_timeout).into_response(),
        Ok(Err(e)) if over_limit(&e) => {
            return too_large(format!(
                "the request body is over the limit of {BODY_LIMIT} bytes"
            ));
        }
        Ok(Err(e)) => {
            return ApiError::body(format!("the request body could not be read: {e}"))
                .into_response();
        }
        Ok(Ok(b)) => b,
    };
    let req = axum::extract::Request::from_parts(parts, axum::body::Body::from(bytes));
    let resp = next.run(req).await;
    let status = resp.status();
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    let streaming = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    if !(status.is_client_error() || status.is_server_error()) || is_json || streaming {
        return resp;
    }
    let body = axum::body::to_bytes(resp.into_body(), 64 << 10)
        .await
        .unwrap_or_default();
    let text = String::from_utf8_lossy(&body).trim().to_string();
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        return too_large(format!(
            "the request body is over the limit of {BODY_LIMIT} bytes ({text})"
        ));
    }
    ApiError {
        status,
        message: if text.is_empty() {
            status.canonical_reason().unwrap_or("error").to_string()
        } else {
            text
        },
        kind: if status.is_server_error() {
            "server_error"
        } else {
            "invalid_request_error"
        },
        param: None,
        code: None,
    }
    .into_response()
}

fn too_large(message: String) -> Response {
    ApiError {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        message,
        kind: "invalid_request_error",
        param: None,
        code: Some("payload_too_large"),
    }
    .into_response()
}

fn reply(r: R<Response>) -> Response {
    r.unwrap_or_else(IntoResponse::into_response)
}

async fn health(State(app): State<Arc<App>>) -> Response {
    match app.ready() {
        Ok(_) => (StatusCode::OK, axum::Json(json!({"status": "ok"}))).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        app.metrics.render(),
    )
        .into_response()
}

async fn models(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    reply((|| {
        app.authorize(&headers)?;
        Ok(axum::Json(json!({
            "object": "list",
            "data": [{
                "id": app.served,
                "object": "model",
                "created": app.created,
                "owned_by": "xing4-rt",
                "max_model_len": app.max_model_len,
            }],
        }))
        .into_response())
    })())
}

async fn tokenize(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    reply((|| {
        app.authorize(&headers)?;
        let ready = app.ready()?;
        let o = api::parse_object(&body)?;
        api::check_model(&o, &app.served)?;
        let tokens = if o.contains_key("messages") {
            let add = api::boolean(&o, "add_generation_prompt")?.unwrap_or(true);
            let tools = toolcall::parse(&o)?;
            let (rendered, _) = ready.render(&o, add, tools.as_ref())?;
            ready.encode_chat(&rendered)?
        } else {
            let key = if o.contains_key("content") {
                "content"
            } else {
                "prompt"
            };
            let text = api::string(&o, key)?
                .ok_or_else(|| ApiError::invalid("prompt", "give `prompt` (text) or `messages`"))?;
            let add_special = api::boolean(&o, "add_special_tokens")?.unwrap_or(true);
            let mut ids = ready.encode(text, key)?;
            if !add_special && ready.bos.is_some() {
                ids.remove(0);
            }
            ids
        };
        Ok(axum::Json(json!({
            "tokens": tokens,
            "count": tokens.len(),
            "max_model_len": app.max_model_len,
        }))
        .into_response())
    })())
}

async fn detokenize(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    reply((|| {
        app.authorize(&headers)?;
        let ready = app.ready()?;
        let o = api::parse_object(&body)?;
        api::check_model(&o, &app.served)?;
        let ids = match api::prompt(&o, "tokens")? {
            Prompt::Tokens(ids) => ids,
            Prompt::Text(_) => {
                return Err(ApiError::invalid(
                    "tokens",
                    "`tokens` must be a list of token ids",
                ));
            }
        };
        let vocab = ready.tokenizer.vocab_size();
        if let Some(i) = ids.iter().position(|&t| t as usize >= vocab) {
            return Err(ApiError::invalid(
                format!("tokens[{i}]"),
                format!(
                    "`tokens[{i}]`: token id {} is outside the vocabulary of {vocab}",
                    ids[i]
                ),
            ));
        }
        let text = ready
            .tokenizer
            .decode(&ids, false)
            .map_err(|e| ApiError::invalid("tokens", e.to_string()))?;
        Ok(axum::Json(json!({"prompt": text})).into_response())
    })())
}

async fn chat_completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    reply(chat(&app, &headers, &body).await)
}

async fn chat(app: &Arc<App>, headers: &HeaderMap, body: &[u8]) -> R<Response> {
    app.authorize(headers)?;
    let ready = app.ready()?;
    let o = api::parse_object(body)?;
    api::check_model(&o, &app.served)?;
    let tools = toolcall::parse(&o)?;
    let output = output_grammar(&o)?;
    let required = tools.as_ref().and_then(|t| {
        toolcall::required_grammar(t, (ready.think.call_open, ready.think.call_close))
    });
    if let (Some(_), Some((_, param))) = (&required, &output) {
        return Err(ApiError::invalid(
            param.clone(),
            format!("`{param}` cannot be combined with a required tool call (`tool_choice`)"),
        ));
    }
    let (rendered, _) = ready.render(&o, true, tools.as_ref())?;
    let common = api::common(&o, &ready.defaults, app.fresh())?;
    api::check_logit_bias(&common, ready.tokenizer.vocab_size())?;
    let logprobs = api::chat_logprobs(&o)?;
    let prompt = ready.encode_chat(&rendered)?;
    app.check_prompt_len(prompt.len(), "messages")?;
    let opens_reasoning = ready.think.opens_reasoning(&prompt);
    let reasoning = Some(opens_reasoning);
    let grammar = required.map(|g| (g, "tool_choice".to_string())).or(output);
    // One constraint a choice, each compiled here so that a grammar llguidance refuses is a
    // 400 before anything runs.
    let constraints = match &grammar {
        None => Vec::new(),
        Some((g, param)) => {
            let guidance = ready.guidance.as_ref().ok_or_else(|| {
                ApiError::invalid(
                    param.clone(),
                    format!("`{param}`: this checkpoint's vocabulary has no end-of-turn token to end a constrained answer"),
                )
            })?;
            (0..common.n.max(1))
                .map(|_| {
                    guidance.constraint(g, opens_reasoning).map_err(|e| {
                        ApiError::invalid(param.clone(), format!("`{param}` cannot be used: {e}"))
                    })
                })
                .collect::<R<Vec<_>>>()?
        }
    };
    let calls = tools.filter(Tools::parse_calls);
    // A required call's form is the grammar's: its arguments stream as they come.
    let stream_calls = matches!(&grammar, Some((_, p)) if p == "tool_choice");
    let stops = if common.ignore_eos {
        Vec::new()
    } else {
        ready.chat_stops.clone()
    };
    let fmt = Formatter {
        id: app.request_id("chatcmpl"),
        created: now_secs(),
        model: app.served.clone(),
        chat: true,
        include_usage: common.include_usage,
        logprobs: logprobs.is_some(),
        text_offset: Vec::new(),
        choices: 1,
        done: Vec::new(),
    };
    let extras = Extras {
        constraints,
        calls,
        stream_calls,
        call_ids: format!("{:016x}", app.fresh()),
    };
    submit(
        app, ready, prompt, common, stops, reasoning, logprobs, fmt, extras,
    )
    .await
}

/// What a chat request adds to its jobs: a constraint per choice, tools to find in the answer.
#[derive(Default)]
struct Extras {
    constraints: Vec<Box<dyn TokenConstraint>>,
    calls: Option<Tools>,
    stream_calls: bool,
    /// Call ids are `call_{call_ids}{choice}_{index}`.
    call_ids: String,
}

async fn completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    reply(completion(&app, &headers, &body).await)
}

async fn completion(app: &Arc<App>, headers: &HeaderMap, body: &[u8]) -> R<Response> {
    app.authorize(headers)?;
    let ready = app.ready()?;
    let o = api::parse_object(body)?;
    api::check_model(&o, &app.served)?;
    for key in ["echo", "best_of", "suffix"] {
        let set = match o.get(key) {
            None | Some(Value::Null) | Some(Value::Bool(false)) => false,
            Some(Value::Number(n)) => n.as_u64() != Some(1),
            Some(_) => true,
        };
        if set {
            return Err(ApiError::invalid(key, format!("`{key}` is not supported")));
        }
    }
    let prompt = match api::prompt(&o, "prompt")? {
        Prompt::Text(t) => ready.encode(&t, "prompt")?,
        Prompt::Tokens(ids) => {
            let vocab = ready.tokenizer.vocab_size();
            if let Some(i) = ids.iter().position(|&t| t as usize >= vocab) {
                return Err(ApiError::invalid(
                    format!("prompt[{i}]"),
                    format!(
                        "`prompt[{i}]`: token id {} is outside the vocabulary of {vocab}",
                        ids[i]
                    ),
                ));
            }
            ids
        }
    };
    app.check_prompt_len(prompt.len(), "prompt")?;
    let common = api::common(&o, &ready.defaults, app.fresh())?;
    api::check_logit_bias(&common, ready.tokenizer.vocab_size())?;
    let logprobs = api::completion_logprobs(&o)?;
    let stops = if common.ignore_eos {
        Vec::new()
    } else {
        ready.eos_stops.clone()
    };
    let fmt = Formatter {
        id: app.request_id("cmpl"),
        created: now_secs(),
        model: app.served.clone(),
        chat: false,
        include_usage: common.include_usage,
        logprobs: logprobs.is_some(),
        text_offset: Vec::new(),
        choices: 1,
        done: Vec::new(),
    };
    let extras = Extras::default();
    submit(
        app, ready, prompt, common, stops, None, logprobs, fmt, extras,
    )
    .await
}

#[allow(clippy::too_many_arguments)]
async fn submit(
    app: &Arc<App>,
    ready: &Ready,
    prompt: Vec<u32>,
    common: Common,
    stop_tokens: Vec<u32>,
    reasoning: Option<bool>,
    logprobs: Option<usize>,
    fmt: Formatter,
    extras: Extras,
) -> R<Response> {
    let mut constraints = extras.constraints.into_iter();
    let max_tokens = common
        .max_tokens
        .unwrap_or(app.max_model_len.saturating_sub(prompt.len()));
    let (tx, rx) = unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let n = common.n.max(1);
    let group = app.ids.fetch_add(1, Relaxed);
    let mut fmt = fmt;
    fmt.choices = n;
    // One sequence a choice, each with its own seed; the cancel flag and the event channel
    // are the request's.
    for index in 0..n {
        let job = Job {
            req: GenerateRequest {
                prompt: prompt.clone(),
                max_tokens,
                sampling: engine::SamplingParams {
                    seed: common.sampling.seed.wrapping_add(index as u64),
                    ..common.sampling.clone()
                },
                stop_tokens: stop_tokens.clone(),
                stop_strings: common.stop.clone(),
                want_logits: logprobs.is_some(),
            },
            index,
            group,
            reasoning,
            logprobs,
            events: tx.clone(),
            cancel: cancel.clone(),
            arrived: Instant::now(),
            constraint: constraints.next(),
            calls: extras.calls.as_ref().map(|t| {
                CallParser::new(t.names(), format!("{}{index}_", extras.call_ids))
                    .streaming(extras.stream_calls)
            }),
        };
        app.metrics.waiting.fetch_add(1, Relaxed);
        if ready.jobs.send(job).is_err() {
            app.metrics.waiting.fetch_sub(1, Relaxed);
            return Err(ApiError::internal(
                "the engine thread has stopped; restart the server",
            ));
        }
    }
    drop(tx);
    let guard = CancelGuard::new(cancel);
    if common.stream {
        let body = Body::from_stream(SseBody::new(rx, fmt, guard, app.keep_alive));
        let mut resp = Response::new(body);
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        return Ok(resp);
    }
    let mut guard = guard;
    let collected = collect(rx, n).await?;
    guard.disarm();
    Ok(axum::Json(fmt.whole(&collected)).into_response())
}

#[derive(Default)]
pub struct Collected {
    reasoning: String,
    content: String,
    /// With the character offset of the token's text in `content`.
    logprobs: Vec<(usize, TokenLogprob)>,
    tool_calls: Vec<ToolCall>,
    done: Option<Done>,
}

/// Each of the `n` choices' text, until every one is done.
async fn collect(mut rx: UnboundedReceiver<Event>, n: usize) -> R<Vec<Collected>> {
    let mut cs: Vec<Collected> = (0..n).map(|_| Collected::default()).collect();
    let mut done = 0;
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Token(d) => {
                let Some(c) = cs.get_mut(d.index) else {
                    continue;
                };
                let offset = c.content.chars().count();
                c.logprobs.extend(d.logprob.map(|l| (offset, l)));
                c.reasoning.push_str(&d.reasoning);
                c.content.push_str(&d.content);
                for part in d.tool_calls {
                    match part.head {
                        Some((id, name)) => c.tool_calls.push(ToolCall {
                            index: part.index,
                            id,
                            name,
                            arguments: part.arguments,
                        }),
                        None => {
                            if let Some(call) =
                                c.tool_calls.iter_mut().find(|t| t.index == part.index)
                            {
                                call.arguments.push_str(&part.arguments);
                            }
                        }
                    }
                }
            }
            Event::Done(d) => {
                if let Some(c) = cs.get_mut(d.index) {
                    c.done = Some(d);
                }
                done += 1;
                if done == n {
                    return Ok(cs);
                }
            }
            Event::Error(e) => return Err(ApiError::internal(format!("generation failed: {e}"))),
            Event::Unavailable => return Err(ApiError::shutting_down()),
        }
    }
    Err(ApiError::internal(
        "the engine thread stopped during the request",
    ))
}

fn finish_str(d: &Done) -> &'static str {
    match d.finish {
        FinishReason::Stop if d.tool_calls => "tool_calls",
        FinishReason::Stop => "stop",
        // A cancelled request has no client to read this.
        FinishReason::Length | FinishReason::Cancelled => "length",
    }
}

/// A call as OpenAI's message has it.
fn call_json(c: &ToolCall) -> Value {
    json!({
        "id": c.id,
        "type": "function",
        "function": {"name": c.name, "arguments": c.arguments},
    })
}

/// A request's usage over its choices: the prompt (and its cached part) once, as the first
/// choice saw it, the completions summed.
fn usage(ds: &[Done]) -> Value {
    let first = ds.iter().find(|d| d.index == 0).or(ds.first());
    let prompt = first.map_or(0, |d| d.prompt_tokens);
    let cached = first.map_or(0, |d| d.cached_tokens);
    let completion: usize = ds.iter().map(|d| d.completion_tokens).sum();
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

fn bytes_json(b: &[u8]) -> Value {
    Value::from(b.to_vec())
}

fn chat_logprob(t: &TokenLogprob) -> Value {
    json!({
        "token": t.token,
        "logprob": t.logprob,
        "bytes": bytes_json(&t.bytes),
        "top_logprobs": t.top.iter().map(|(tok, b, lp)| json!({
            "token": tok, "logprob": lp, "bytes": bytes_json(b),
        })).collect::<Vec<_>>(),
    })
}

/// Shapes one request's events as OpenAI objects (chat or text completion).
pub struct Formatter {
    id: String,
    created: u64,
    model: String,
    chat: bool,
    include_usage: bool,
    logprobs: bool,
    /// Per choice, characters of completion text sent so far (`text_offset` of completions
    /// logprobs).
    text_offset: Vec<usize>,
    /// Choices of the request (`n`).
    pub choices: usize,
    /// The choices that are done, for the usage chunk once all are.
    done: Vec<Done>,
}

impl Formatter {
    /// `lps` with the character offset of each token's text in the completion.
    fn completion_logprobs(lps: &[(usize, TokenLogprob)]) -> Value {
        json!({
            "tokens": lps.iter().map(|(_, t)| t.token.clone()).collect::<Vec<_>>(),
            "token_logprobs": lps.iter().map(|(_, t)| t.logprob).collect::<Vec<_>>(),
            "top_logprobs": lps.iter().map(|(_, t)| {
                t.top.iter().map(|(tok, _, lp)| (tok.clone(), json!(lp))).collect::<serde_json::Map<_, _>>()
            }).collect::<Vec<_>>(),
            "text_offset": lps.iter().map(|(o, _)| *o).collect::<Vec<_>>(),
        })
    }

    /// The non-streaming response: one choice per `Collected`, indexed in order.
    fn whole(self, cs: &[Collected]) -> Value {
        let dones: Vec<Done> = cs
            .iter()
            .enumerate()
            .map(|(index, c)| {
                c.done.unwrap_or(Done {
                    index,
                    finish: FinishReason::Length,
                    tool_calls: false,
                    prompt_tokens: 0,
                    completion_tokens: 0,
                    cached_tokens: 0,
                })
            })
            .collect();
        let choices: Vec<Value> = cs
            .iter()
            .zip(&dones)
            .enumerate()
            .map(|(index, (c, done))| {
                let finish = finish_str(done);
                if self.chat {
                    let logprobs = self.logprobs.then(|| {
                        json!({"content": c.logprobs.iter().map(|(_, l)| chat_logprob(l)).collect::<Vec<_>>()})
                    });
                    let reasoning = (!c.reasoning.is_empty()).then(|| c.reasoning.clone());
                    let mut message = json!({"role": "assistant", "content": c.content, "reasoning_content": reasoning});
                    if !c.tool_calls.is_empty() {
                        message["tool_calls"] = c.tool_calls.iter().map(call_json).collect();
                        if c.content.is_empty() {
                            message["content"] = Value::Null;
                        }
                    }
                    json!({
                        "index": index,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                    })
                } else {
                    let logprobs = self
                        .logprobs
                        .then(|| Self::completion_logprobs(&c.logprobs));
                    json!({
                        "index": index,
                        "text": c.content,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                    })
                }
            })
            .collect();
        json!({
            "id": self.id,
            "object": if self.chat { "chat.completion" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(&dones),
        })
    }

    fn chunk(&self, choice: Value) -> String {
        let object = if self.chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let mut v = json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        });
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        format!("data: {v}\n\n")
    }

    /// Sent before any token: the assistant role (chat), so a client sees the stream open.
    pub fn opening(&self) -> String {
        if !self.chat {
            return String::new();
        }
        (0..self.choices.max(1))
            .map(|index| {
                self.chunk(json!({
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": null,
                    "finish_reason": null,
                }))
            })
            .collect()
    }

    fn delta_chunk(&mut self, d: &Delta) -> String {
        if d.is_empty() {
            return String::new();
        }
        let index = d.index;
        if self.text_offset.len() <= index {
            self.text_offset.resize(index + 1, 0);
        }
        let lps: Vec<(usize, TokenLogprob)> = d
            .logprob
            .iter()
            .map(|l| (self.text_offset[index], l.clone()))
            .collect();
        self.text_offset[index] += d.content.chars().count();
        if self.chat {
            let mut delta = serde_json::Map::new();
            if !d.reasoning.is_empty() {
                delta.insert("reasoning_content".into(), json!(d.reasoning));
            }
            if !d.content.is_empty() || d.reasoning.is_empty() {
                delta.insert("content".into(), json!(d.content));
            }
            let logprobs = self.logprobs.then(
                || json!({"content": lps.iter().map(|(_, l)| chat_logprob(l)).collect::<Vec<_>>()}),
            );
            let text = !d.content.is_empty() || !d.reasoning.is_empty() || d.tool_calls.is_empty();
            let mut s = if text || logprobs.is_some() {
                self.chunk(
                    json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": null}),
                )
            } else {
                String::new()
            };
            // OpenAI's order: a call's id, type and name with empty arguments, then its
            // arguments (in as many deltas as they came in).
            for c in &d.tool_calls {
                let mut calls = Vec::new();
                if let Some((id, name)) = &c.head {
                    calls.push(json!({"index": c.index, "id": id, "type": "function",
                                      "function": {"name": name, "arguments": ""}}));
                }
                if !c.arguments.is_empty() {
                    calls.push(json!({"index": c.index, "function": {"arguments": c.arguments}}));
                }
                for call in calls {
                    s.push_str(
                        &self.chunk(json!({"index": index, "delta": {"tool_calls": [call]},
                                                  "logprobs": null, "finish_reason": null})),
                    );
                }
            }
            s
        } else {
            let logprobs = self.logprobs.then(|| Self::completion_logprobs(&lps));
            self.chunk(
                json!({"index": index, "text": d.content, "logprobs": logprobs, "finish_reason": null}),
            )
        }
    }

    /// One worker event as SSE text, and whether the stream ends with it (every choice
    /// done, an error, or `None`: the worker went away).
    pub fn stream_event(&mut self, ev: Option<Event>) -> (String, bool) {
        match ev {
            Some(Event::Token(d)) => (self.delta_chunk(&d), false),
            Some(Event::Done(done)) => {
                let finish = finish_str(&done);
                let index = done.index;
                let mut s = if self.chat {
                    self.chunk(
                        json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": finish}),
                    )
                } else {
                    self.chunk(
                        json!({"index": index, "text": "", "logprobs": null, "finish_reason": finish}),
                    )
                };
                self.done.push(done);
                if self.done.len() < self.choices.max(1) {
                    return (s, false);
                }
                if self.include_usage {
                    let object = if self.chat {
                        "chat.completion.chunk"
                    } else {
                        "text_completion"
                    };
                    let v = json!({
                        "id": self.id,
                        "object": object,
                        "created": self.created,
                        "model": self.model,
                        "choices": [],
                        "usage": usage(&self.done),
                    });
                    s.push_str(&format!("data: {v}\n\n"));
                }
                s.push_str("data: [DONE]\n\n");
                (s, true)
            }
            Some(Event::Error(e)) => {
                let err = ApiError::internal(format!("generation failed: {e}")).json();
                (format!("data: {err}\n\ndata: [DONE]\n\n"), true)
            }
            Some(Event::Unavailable) => {
                let err = ApiError::shutting_down().json();
                (format!("data: {err}\n\ndata: [DONE]\n\n"), true)
            }
            None => {
                let err = ApiError::internal("the engine thread stopped during the request").json();
                (format!("data: {err}\n\ndata: [DONE]\n\n"), true)
            }
        }
    }
}
