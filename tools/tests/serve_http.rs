//! `serve` over plain HTTP on loopback, with a tiny synthetic checkpoint: the wire format of a
//! stream, bad requests, disconnects, the prefix store, reasoning, stop strings, and start-up
//! refusals.

mod serve_support;

use std::io::Write;
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use serve_support::{MODEL, Server, client, reassemble_chat, stream_data, tiny_checkpoint};

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

/// Replaces the value of `"key":` (a string or a number) with `[key]`.
fn redact(s: &str, key: &str) -> String {
    let pat = format!("\"{key}\":");
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find(&pat) {
        out.push_str(&rest[..i + pat.len()]);
        rest = &rest[i + pat.len()..];
        let end = if let Some(r) = rest.strip_prefix('"') {
            r.find('"').map_or(rest.len(), |j| j + 2)
        } else {
            rest.find([',', '}']).unwrap_or(rest.len())
        };
        out.push_str(&format!("\"[{key}]\""));
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

#[test]
fn a_greedy_sse_transcript_matches_its_snapshot_and_the_non_streaming_answer() {
    let s = Server::start(&[]);
    let body = json!({
        "model": MODEL,
        "messages": user("What is the capital of France?"),
        "max_tokens": 8,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let data = stream_data(&s, "/v1/chat/completions", &body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let transcript: String = data.iter().map(|d| format!("data: {d}\n\n")).collect();
    insta::assert_snapshot!(
        "chat_stream_greedy",
        redact(&redact(&transcript, "id"), "created")
    );

    let mut plain = body.clone();
    plain["stream"] = json!(false);
    plain.as_object_mut().unwrap().remove("stream_options");
    let (status, v) = s.post_json("/v1/chat/completions", &plain);
    assert_eq!(status, 200, "{v}");
    let (reasoning, content, finish) = reassemble_chat(&data);
    let msg = &v["choices"][0]["message"];
    assert_eq!(msg["content"].as_str().unwrap_or(""), content);
    assert_eq!(msg["reasoning_content"].as_str().unwrap_or(""), reasoning);
    assert_eq!(
        v["choices"][0]["finish_reason"].as_str(),
        Some(finish.as_str())
    );
    assert_eq!(v["object"], "chat.completion");
}

#[test]
fn malformed_requests_get_a_4xx_naming_the_field_and_the_server_keeps_serving() {
    let s = Server::start(&["--max-model-len", "64"]);
    let long = "hello world ".repeat(100);
    let u = user("hi");
    let chat = |extra: Value| {
        let mut b = json!({"messages": u});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b.to_string()
    };
    let cases: Vec<(&str, String, u16, Option<&str>)> = vec![
        ("/v1/chat/completions", "{not json".into(), 400, None),
        ("/v1/chat/completions", "[1, 2]".into(), 400, None),
        ("/v1/chat/completions", "{}".into(), 400, Some("messages")),
        (
            "/v1/chat/completions",
            r#"{"messages": "hi"}"#.into(),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": []}"#.into(),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"model": "gpt-4"})),
            404,
            Some("model"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"model": 3})),
            400,
            Some("model"),
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "wizard", "content": "x"}]}"#.into(),
            400,
            Some("messages[0].role"),
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user"}]}"#.into(),
            400,
            Some("messages[0].content"),
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": 5}]}"#.into(),
            400,
            Some("messages[0].content"),
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": [7]}"#.into(),
            400,
            Some("messages[0]"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"max_tokens": 0})),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"max_tokens": -5})),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"max_tokens": "ten"})),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"max_tokens": 2.5})),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"max_completion_tokens": 0})),
            400,
            Some("max_completion_tokens"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"temperature": 3.5})),
            400,
            Some("temperature"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"temperature": "warm"})),
            400,
            Some("temperature"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"top_p": 1.5})),
            400,
            Some("top_p"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"top_p": 0})),
            400,
            Some("top_p"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"top_k": -5})),
            400,
            Some("top_k"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"min_p": -0.1})),
            400,
            Some("min_p"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"repetition_penalty": 0})),
            400,
            Some("repetition_penalty"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"presence_penalty": 5})),
            400,
            Some("presence_penalty"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"stop": 7})),
            400,
            Some("stop"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"stop": ["ok", ""]})),
            400,
            Some("stop[1]"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"logprobs": "yes"})),
            400,
            Some("logprobs"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"logprobs": true, "top_logprobs": 50})),
            400,
            Some("top_logprobs"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"n": 0})),
            400,
            Some("n"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"stream": "yes"})),
            400,
            Some("stream"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"stream_options": {"include_usage": true}})),
            400,
            Some("stream_options"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"seed": "x"})),
            400,
            Some("seed"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"chat_template_kwargs": {"enable_thinking": "no"}})),
            400,
            Some("chat_template_kwargs.enable_thinking"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"chat_template_kwargs": []})),
            400,
            Some("chat_template_kwargs"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user(&long)}).to_string(),
            400,
            Some("messages"),
        ),
        ("/v1/completions", "{}".into(), 400, Some("prompt")),
        (
            "/v1/completions",
            r#"{"prompt": 5}"#.into(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            r#"{"prompt": []}"#.into(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            r#"{"prompt": ["a", "b"]}"#.into(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            r#"{"prompt": [1, 99999]}"#.into(),
            400,
            Some("prompt[1]"),
        ),
        (
            "/v1/completions",
            r#"{"prompt": [1, -2]}"#.into(),
            400,
            Some("prompt[1]"),
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "echo": true}"#.into(),
            400,
            Some("echo"),
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "logprobs": 99}"#.into(),
            400,
            Some("logprobs"),
        ),
        (
            "/v1/completions",
            json!({"prompt": long}).to_string(),
            400,
            Some("prompt"),
        ),
        // Tools and structured outputs that cannot be honoured are refused, naming the field.
        (
            "/v1/chat/completions",
            json!({"messages": user("x"), "tools": [{"type": "function",
                   "function": {"name": "two words", "parameters": {"type": "object"}}}]})
            .to_string(),
            400,
            Some("tools[0].function.name"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user("x"), "response_format": {"type": "json_schema",
                   "json_schema": {"name": "x", "strict": true,
                                   "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}})
            .to_string(),
            400,
            Some("response_format.json_schema.schema"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user("x"), "response_format": {"type": "xml"}}).to_string(),
            400,
            Some("response_format.type"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user("x"), "grammar": "start: (("}).to_string(),
            400,
            Some("grammar"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user("x"), "tool_choice": "required"}).to_string(),
            400,
            Some("tool_choice"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user("x"), "functions": [{"name": "f"}]}).to_string(),
            400,
            Some("functions"),
        ),
        ("/tokenize", r#"{"prompt": 3}"#.into(), 400, Some("prompt")),
        (
            "/detokenize",
            r#"{"tokens": [99999]}"#.into(),
            400,
            Some("tokens[0]"),
        ),
        ("/v1/nothing", "{}".into(), 404, None),
    ];
    for (path, body, status, param) in &cases {
        let r = s.post(path, body);
        assert_eq!(r.status, *status, "{path} {body}: {}", r.text());
        let v: Value = serde_json::from_slice(&r.body)
            .unwrap_or_else(|e| panic!("{path} {body}: non-JSON error body ({e}): {}", r.text()));
        let e = &v["error"];
        assert!(
            e["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{body}: {v}"
        );
        assert!(e["type"].is_string(), "{body}: {v}");
        assert!(e.get("code").is_some(), "{body}: {v}");
        assert_eq!(e["param"].as_str(), *param, "{path} {body}: {v}");
        if let Some(p) = param {
            let field = p.split(['[', '.']).next().unwrap();
            assert!(
                e["message"].as_str().unwrap().contains(field),
                "{body}: the message names `{field}`: {v}"
            );
        }
    }
    let r = s.get("/v1/chat/completions");
    assert_eq!(r.status, 405);
    assert!(serde_json::from_slice::<Value>(&r.body).unwrap()["error"]["message"].is_string());
    let (status, v) = s.post_json(
        "/v1/chat/completions",
        &json!({"messages": user("hi"), "max_tokens": 2}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(s.get("/health").status, 200);
}

#[test]
fn a_disconnect_mid_stream_cancels_the_decode_and_the_next_request_is_unaffected() {
    let s = Server::start(&[]);
    let long = json!({"prompt": "Hello world", "max_tokens": 3000, "ignore_eos": true, "temperature": 0, "stream": true});
    let mut events = client::send(
        &s.addr,
        "POST",
        "/v1/completions",
        &[],
        long.to_string().as_bytes(),
    )
    .expect("streaming request")
    .events();
    for _ in 0..2 {
        let ev = events
            .next_event()
            .expect("an event")
            .expect("the stream is open");
        assert!(ev.starts_with("data: {"), "{ev}");
    }
    drop(events);
    s.wait_metric("xing4_cancellations_total", 1.0);
    let generated = s.metric("xing4_generation_tokens_total");
    assert!(
        generated < 3000.0,
        "the decode ran on after the disconnect: {generated} tokens"
    );
    assert_eq!(
        s.metric("xing4_request_success_total{finished_reason=\"length\"}"),
        0.0
    );

    let next = json!({"messages": user("And Japan?"), "max_tokens": 12, "temperature": 0});
    let (status, after) = s.post_json("/v1/chat/completions", &next);
    assert_eq!(status, 200, "{after}");
    let fresh = Server::start(&[]);
    let (_, want) = fresh.post_json("/v1/chat/completions", &next);
    assert_eq!(
        after["choices"][0]["message"],
        want["choices"][0]["message"]
    );
    assert_eq!(
        after["usage"]["completion_tokens"],
        want["usage"]["completion_tokens"]
    );
}

#[test]
fn a_client_that_leaves_a_non_streaming_request_cancels_it_too() {
    let s = Server::start(&[]);
    let body = json!({"prompt": "Hello", "max_tokens": 3000, "ignore_eos": true, "temperature": 0})
        .to_string();
    let mut conn = TcpStream::connect(&s.addr).unwrap();
    write!(
        conn,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    drop(conn);
    s.wait_metric("xing4_cancellations_total", 1.0);
    assert!(s.metric("xing4_generation_tokens_total") < 3000.0);
}

/// Token ids of normal pieces of the tiny vocabulary.
fn ids(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 400 + (i * 37) % 100).collect()
}

#[test]
fn a_repeated_prompt_reuses_its_prefix_and_a_shorter_prompt_does_not_see_the_longer_ones_tail() {
    // Blocks of 16: a 40-token prompt fills two, and only whole blocks before the last
    // token are shared.
    let s = Server::start(&["--block-size", "16"]);
    let long = json!({"prompt": ids(40), "max_tokens": 10, "temperature": 0, "ignore_eos": true});
    let (_, first) = s.post_json("/v1/completions", &long);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (_, again) = s.post_json("/v1/completions", &long);
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
    assert_eq!(again["choices"][0]["text"], first["choices"][0]["text"]);
    s.wait_metric("xing4_prefix_store_hits_total", 1.0);
    assert_eq!(s.metric("xing4_prefix_store_reused_tokens_total"), 32.0);
    assert_eq!(s.metric("xing4_prefix_cache_hits_total"), 32.0);
    assert_eq!(s.metric("xing4_prefix_cache_queries_total"), 80.0);
    assert_eq!(s.metric("xing4_prefix_store_entries"), 2.0);
    assert!(s.metric("xing4_prefix_store_bytes") > 0.0);

    // The shorter prompt shares the first block only; its second block would hold tokens
    // 16..20 of it, not the longer prompt's 16..32.
    let short = json!({"prompt": ids(20), "max_tokens": 10, "temperature": 0, "ignore_eos": true});
    let (_, cut) = s.post_json("/v1/completions", &short);
    assert_eq!(cut["usage"]["prompt_tokens_details"]["cached_tokens"], 16);
    let fresh = Server::start(&["--prefix-cache-bytes", "0", "--block-size", "16"]);
    let (_, want) = fresh.post_json("/v1/completions", &short);
    assert_eq!(want["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(cut["choices"][0]["text"], want["choices"][0]["text"]);
    assert_eq!(fresh.metric("xing4_prefix_store_budget_bytes"), 0.0);
}

#[test]
fn a_chat_repeat_reports_cached_tokens_in_usage() {
    let s = Server::start(&["--block-size", "16"]);
    let body = json!({"messages": user("What is the capital of France?"), "max_tokens": 4, "temperature": 0});
    let (_, a) = s.post_json("/v1/chat/completions", &body);
    let (_, b) = s.post_json("/v1/chat/completions", &body);
    let n = a["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // Every whole block before the prompt's last token.
    assert_eq!(
        b["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some((n - 1) / 16 * 16)
    );
    assert!(n > 16, "the chat prompt should span a block: {n}");
    assert_eq!(a["choices"][0]["message"], b["choices"][0]["message"]);
    assert_eq!(
        a["usage"]["total_tokens"].as_u64(),
        Some(n + a["usage"]["completion_tokens"].as_u64().unwrap())
    );
}

/// The greedy completion of the exact prompt a chat request renders to.
fn raw_answer(s: &Server, chat: &Value) -> String {
    let (_, t) = s.post_json("/tokenize", chat);
    let prompt = t["tokens"].clone();
    let mut body = json!({"prompt": prompt, "temperature": 0, "ignore_eos": true});
    body["max_tokens"] = chat["max_tokens"].clone();
    let (_, v) = s.post_json("/v1/completions", &body);
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

#[test]
fn reasoning_and_content_split_at_the_end_of_thinking() {
    let s = Server::start(&["--prefix-cache-bytes", "0"]);
    let off = json!({"messages": user("Hi"), "max_tokens": 16, "temperature": 0, "ignore_eos": true,
                     "chat_template_kwargs": {"enable_thinking": false}});
    let (_, v) = s.post_json("/v1/chat/completions", &off);
    let msg = &v["choices"][0]["message"];
    let raw = raw_answer(&s, &off);
    assert!(!raw.is_empty());
    if msg["reasoning_content"].is_null() {
        assert_eq!(
            msg["content"].as_str(),
            Some(raw.as_str()),
            "thinking off: everything is content"
        );
    } else {
        assert!(raw.starts_with(msg["content"].as_str().unwrap()), "{msg}");
    }
    let (_, t) = s.post_json("/tokenize", &off);
    let think_end = 10;
    assert_eq!(
        t["tokens"].as_array().unwrap().last(),
        Some(&json!(think_end)),
        "the prompt ends in </think>"
    );

    let on =
        json!({"messages": user("Hi"), "max_tokens": 16, "temperature": 0, "ignore_eos": true});
    let (_, v) = s.post_json("/v1/chat/completions", &on);
    let msg = &v["choices"][0]["message"];
    let raw = raw_answer(&s, &on);
    let reasoning = msg["reasoning_content"].as_str().unwrap_or("");
    let content = msg["content"].as_str().unwrap();
    assert!(
        !reasoning.is_empty(),
        "thinking on: the answer starts in the reasoning: {msg}"
    );
    let joined = format!("{reasoning}{content}");
    let joined_nl = format!("{reasoning}\n{content}");
    assert!(raw == joined || raw == joined_nl, "raw {raw:?} vs {msg}");
}

#[test]
fn a_stop_string_ends_the_text_and_is_not_returned() {
    let s = Server::start(&["--prefix-cache-bytes", "0"]);
    let base = json!({"prompt": ids(8), "max_tokens": 16, "temperature": 0, "ignore_eos": true});
    let (_, v) = s.post_json("/v1/completions", &base);
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = text.chars().collect();
    assert!(
        chars.len() >= 6,
        "the greedy text is too short to cut: {text:?}"
    );
    let stop: String = chars[3..5].iter().collect();
    let want = &text[..text.find(&stop).unwrap()];
    let mut cut = base.clone();
    cut["stop"] = json!([stop, "never-appears"]);
    let (_, v) = s.post_json("/v1/completions", &cut);
    assert_eq!(v["choices"][0]["text"].as_str(), Some(want));
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let mut streamed = cut.clone();
    streamed["stream"] = json!(true);
    let data = stream_data(&s, "/v1/completions", &streamed);
    let mut joined = String::new();
    for d in data.iter().filter(|d| d.as_str() != "[DONE]") {
        let v: Value = serde_json::from_str(d).unwrap();
        joined.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
    }
    assert_eq!(joined, want);
}

#[test]
fn logprobs_are_log_softmax_values_with_the_requested_alternatives() {
    let s = Server::start(&[]);
    let body = json!({"messages": user("Hi"), "max_tokens": 4, "temperature": 0, "ignore_eos": true,
                      "logprobs": true, "top_logprobs": 3});
    let (_, v) = s.post_json("/v1/chat/completions", &body);
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("logprobs.content");
    assert_eq!(content.len(), 4);
    for t in content {
        let lp = t["logprob"].as_f64().unwrap();
        let top = t["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert!(
            (lp - top[0]["logprob"].as_f64().unwrap()).abs() < 1e-6,
            "{t}"
        );
        assert!(lp <= 0.0);
        assert!(
            top.windows(2)
                .all(|w| w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64())
        );
    }
}

#[test]
fn models_health_tokenize_and_detokenize_answer() {
    let s = Server::start(&[]);
    assert_eq!(s.get("/health").status, 200);
    let (_, _) = (s.get("/health"), ());
    let m: Value = serde_json::from_slice(&s.get("/v1/models").body).unwrap();
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"][0]["id"], MODEL);
    let (status, t) = s.post_json("/tokenize", &json!({"prompt": "hello world"}));
    assert_eq!(status, 200);
    assert_eq!(
        t["count"].as_u64(),
        Some(t["tokens"].as_array().unwrap().len() as u64)
    );
    let (_, d) = s.post_json("/detokenize", &json!({"tokens": t["tokens"]}));
    assert_eq!(d["prompt"], "hello world");
    let metrics = s.get("/metrics");
    assert!(
        metrics
            .header("content-type")
            .is_some_and(|c| c.starts_with("text/plain"))
    );
    for name in [
        "xing4_num_requests_running",
        "xing4_num_requests_waiting",
        "xing4_kv_cache_bytes",
        "xing4_resident_bytes",
        "xing4_context_positions",
        "xing4_prompt_tokens_total",
        "xing4_generation_tokens_total",
        "xing4_time_to_first_token_seconds_count",
        "xing4_inter_token_latency_seconds_count",
        "xing4_prefix_cache_queries_total",
        "xing4_prefix_cache_hits_total",
        "xing4_cancellations_total",
    ] {
        s.metric(name);
    }
    assert!(s.metric("xing4_kv_cache_bytes") > 0.0);
    assert_eq!(s.metric("xing4_context_positions"), 4096.0);
    assert_eq!(
        s.metric("xing4_prefix_store_budget_bytes"),
        (1u64 << 30) as f64
    );
}

#[test]
fn the_step_counters_account_for_a_sampled_request() {
    let s = Server::start(&[]);
    let body = json!({"prompt": ids(20), "max_tokens": 4, "temperature": 0.9, "seed": 3, "ignore_eos": true});
    let (status, _) = s.post_json("/v1/completions", &body);
    assert_eq!(status, 200);
    // The worker publishes its counters after the step whose events ended the response.
    let deadline = Instant::now() + Duration::from_secs(30);
    while s.metric("xing4_engine_steps_total{kind=\"decode\"}") < 3.0 {
        assert!(
            Instant::now() < deadline,
            "the decode steps were not counted"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(s.metric("xing4_engine_steps_total{kind=\"prefill\"}") >= 1.0);
    assert!(s.metric("xing4_engine_step_seconds_total{kind=\"decode\"}") > 0.0);
    assert!(s.metric("xing4_host_token_seconds_total") > 0.0);
    assert!(s.metric("xing4_plan_builds_total") >= 1.0);
    assert!(s.metric("xing4_plan_build_seconds_total") > 0.0);
}

#[test]
fn an_api_key_is_required_on_the_api_when_one_is_set() {
    let s = Server::start(&["--api-key", "sesame"]);
    let body = json!({"messages": user("hi"), "max_tokens": 2}).to_string();
    let r = client::request(
        &s.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        body.as_bytes(),
    )
    .unwrap();
    assert_eq!(r.status, 401);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["error"]["code"], "invalid_api_key");
    let wrong = [("Authorization", "Bearer nope")];
    assert_eq!(
        client::request(&s.addr, "GET", "/v1/models", &wrong, b"")
            .unwrap()
            .status,
        401
    );
    let right = [("Authorization", "Bearer sesame")];
    let r = client::request(
        &s.addr,
        "POST",
        "/v1/chat/completions",
        &right,
        body.as_bytes(),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(s.get("/health").status, 200);
}

#[test]
fn flags_that_cannot_work_are_refused_at_start_up_with_the_numbers() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_serve"))
            .arg("--model")
            .arg(tiny_checkpoint())
            .args(["--port", "0"])
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} was accepted");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    // Past the checkpoint's context the length is refused for that, before any memory
    // arithmetic (whose suggested length is never past the context either).
    for len in ["1000000000000000", "32768"] {
        let e = run(&["--max-model-len", len]);
        assert!(
            e.contains(&format!(
                "--max-model-len {len} is longer than the checkpoint's context length 16384"
            )),
            "{e}"
        );
    }
    // Without a usable GPU, --device cuda is refused at start-up naming the device and the driver.
    if !matches!(cuda::Device::available(), Ok(n) if n > 0) {
        let e = run(&["--device", "cuda"]);
        assert!(
            e.contains("cuda:0 is not usable") && e.contains("driver"),
            "{e}"
        );
    }
    let e = run(&["--device", "tpu"]);
    assert!(e.contains("--device tpu"), "{e}");
    let e = run(&["--api-key", ""]);
    assert!(e.contains("--api-key is empty"), "{e}");
}

#[test]
fn a_stream_waiting_in_the_queue_gets_keep_alive_comments_then_its_tokens() {
    // One sequence at a time, so the second request waits for the first.
    let s = Server::start(&["--sse-keep-alive", "0.05", "--max-num-seqs", "1"]);
    let busy = json!({"prompt": ids(8), "max_tokens": 400, "ignore_eos": true, "temperature": 0, "stream": true});
    let addr = s.addr.clone();
    let first = std::thread::spawn(move || {
        let conn = client::send(
            &addr,
            "POST",
            "/v1/completions",
            &[],
            busy.to_string().as_bytes(),
        )
        .unwrap();
        conn.read_all().unwrap().status
    });
    s.wait_metric("xing4_num_requests_running", 1.0);
    let queued = json!({"messages": user("hi"), "max_tokens": 4, "temperature": 0, "stream": true});
    let mut events = client::send(
        &s.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        queued.to_string().as_bytes(),
    )
    .unwrap()
    .events();
    let opening = events.next_event().unwrap().unwrap();
    assert!(opening.contains("\"role\":\"assistant\""), "{opening}");
    let (mut comments, mut waiting) = (0, None);
    let first_token = loop {
        let ev = events
            .next_event()
            .unwrap()
            .expect("the stream ended early");
        if ev.starts_with(':') {
            comments += 1;
            waiting.get_or_insert_with(|| s.metric("xing4_num_requests_waiting"));
            continue;
        }
        break ev;
    };
    assert!(comments >= 1, "no keep-alive comment while queued");
    assert_eq!(
        waiting,
        Some(1.0),
        "the queued request is counted as waiting"
    );
    assert!(first_token.starts_with("data: {"), "{first_token}");
    let mut last = first_token;
    while let Some(ev) = events.next_event().unwrap() {
        if !ev.starts_with(':') {
            last = ev;
        }
    }
    assert_eq!(last, "data: [DONE]");
    assert_eq!(first.join().unwrap(), 200);
}

#[test]
fn n_choices_are_sequences_of_their_own_that_share_the_prompt_blocks() {
    // Blocks of 16: the 40-token prompt's first two blocks are shared by the later choices.
    let s = Server::start(&["--block-size", "16"]);
    let body = json!({"prompt": ids(40), "max_tokens": 12, "temperature": 0.9, "seed": 5, "n": 3, "ignore_eos": true});
    let (status, whole) = s.post_json("/v1/completions", &body);
    assert_eq!(status, 200, "{whole}");
    let choices = whole["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{whole}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "{whole}");
        assert_eq!(c["finish_reason"], "length", "{whole}");
    }
    // Each choice has its own seed: sampled at 0.9, they differ.
    let texts: std::collections::HashSet<&str> =
        choices.iter().filter_map(|c| c["text"].as_str()).collect();
    assert!(texts.len() > 1, "{whole}");
    assert_eq!(whole["usage"]["prompt_tokens"], 40);
    assert_eq!(whole["usage"]["completion_tokens"], 36);
    // The two later choices each took the first's two full prompt blocks.
    s.wait_metric("xing4_prefix_cache_hits_total", 64.0);

    // Streamed with the same seed: per index, the same text; one [DONE], after every finish.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let data = stream_data(&s, "/v1/completions", &streamed);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(data.iter().filter(|d| *d == "[DONE]").count(), 1);
    let mut text = vec![String::new(); 3];
    let mut finished = [false; 3];
    for d in data.iter().filter(|d| *d != "[DONE]") {
        let v: Value = serde_json::from_str(d).unwrap();
        for c in v["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap() as usize;
            text[i].push_str(c["text"].as_str().unwrap_or(""));
            finished[i] |= !c["finish_reason"].is_null();
        }
    }
    assert_eq!(finished, [true; 3]);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["text"].as_str().unwrap(), text[i], "choice {i}");
    }
    let (status, e) = s.post_json("/v1/completions", &json!({"prompt": "x", "n": 65}));
    assert_eq!(status, 400, "{e}");
    assert_eq!(e["error"]["param"], "n");
}

#[test]
fn a_logit_bias_of_plus_100_makes_greedy_decoding_emit_that_token_and_bad_ones_are_refused() {
    let s = Server::start(&[]);
    let body = json!({"prompt": ids(8), "max_tokens": 5, "temperature": 0, "ignore_eos": true,
        "logit_bias": {"450": 100}});
    let (status, v) = s.post_json("/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    let (_, want) = s.post_json("/detokenize", &json!({"tokens": [450, 450, 450, 450, 450]}));
    assert_eq!(v["choices"][0]["text"], want["prompt"], "{v}");
    // The same request without the bias says something else.
    let mut plain = body.clone();
    plain.as_object_mut().unwrap().remove("logit_bias");
    let (_, p) = s.post_json("/v1/completions", &plain);
    assert_ne!(p["choices"][0]["text"], want["prompt"], "{p}");
    for bad in [
        json!({"450": 101}),
        json!({"abc": 1}),
        json!({"99999999": 1}),
        json!([1, 2]),
    ] {
        let (status, e) = s.post_json(
            "/v1/completions",
            &json!({"prompt": "x", "max_tokens": 1, "logit_bias": bad}),
        );
        assert_eq!(status, 400, "{bad}: {e}");
        assert_eq!(e["error"]["param"], "logit_bias", "{bad}: {e}");
    }
}

/// The raw response to `request` written on a fresh connection, read until the server closes it
/// or `limit` passes.
fn raw(addr: &str, request: &[u8], limit: Duration) -> String {
    let mut conn = TcpStream::connect(addr).unwrap();
    conn.set_read_timeout(Some(limit)).unwrap();
    conn.write_all(request).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n) = std::io::Read::read(&mut conn, &mut buf) {
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
        if out.windows(4).any(|w| w == b"\r\n\r\n") && out.ends_with(b"}") {
            break;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn an_oversized_body_gets_a_json_413_at_once_and_wrong_methods_a_json_405_with_its_code() {
    let s = Server::start(&[]);
    // A declared length far past the limit, two bytes sent: refused before any body is read.
    let t = std::time::Instant::now();
    let reply = raw(
        &s.addr,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000000000000\r\n\r\n{}",
        Duration::from_secs(5),
    );
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "took {:?}",
        t.elapsed()
    );
    assert!(reply.starts_with("HTTP/1.1 413"), "{reply}");
    let body = &reply[reply.find("\r\n\r\n").unwrap() + 4..];
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {reply}"));
    assert_eq!(v["error"]["code"], "payload_too_large", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("1000000000000"),
        "{v}"
    );
    // A chunked body that grows past the limit: the extractor's refusal, as JSON too.
    let big = "x".repeat(3 << 20);
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{big}\r\n0\r\n\r\n",
        big.len()
    );
    let reply = raw(&s.addr, req.as_bytes(), Duration::from_secs(10));
    assert!(
        reply.starts_with("HTTP/1.1 413"),
        "{}",
        &reply[..reply.len().min(300)]
    );
    assert!(
        reply.contains("\"payload_too_large\""),
        "{}",
        &reply[..reply.len().min(600)]
    );
    let r = s.get("/v1/completions");
    assert_eq!(r.status, 405);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["error"]["code"], "method_not_allowed", "{v}");
    assert_eq!(s.get("/health").status, 200);
}

/// Every marker of spec §8 typed inside a user message is text: the chat prompt holds exactly
/// the marker tokens the template puts there (those of a message without the marker), and the
/// typed marker comes back from `/detokenize` as the characters the user sent. The raw
/// `/v1/completions` prompt (here `/tokenize` of `prompt`) still parses markers.
#[test]
fn each_special_marker_typed_in_a_user_message_tokenizes_to_ordinary_pieces() {
    let s = Server::start(&[]);
    let ids_of = |body: Value| -> Vec<u64> {
        let (status, t) = s.post_json("/tokenize", &body);
        assert_eq!(status, 200, "{t}");
        t["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect()
    };
    for marker in [
        "<_end>",
        "<_start>",
        "<_bot>",
        "<think>",
        "</think>",
        "<tool_call>",
    ] {
        let raw = ids_of(json!({"prompt": marker, "add_special_tokens": false}));
        assert_eq!(
            raw.len(),
            1,
            "{marker} is one token in a raw prompt: {raw:?}"
        );
        let id = raw[0];
        let count = |v: &[u64]| v.iter().filter(|&&t| t == id).count();
        let plain = ids_of(json!({"messages": user("ab")}));
        let typed_text = format!("a{marker}<_user>b{marker}");
        let typed = ids_of(json!({"messages": user(&typed_text)}));
        assert_eq!(
            count(&typed),
            count(&plain),
            "{marker} typed in a message became its control token: {typed:?}"
        );
        assert!(
            typed.len() >= plain.len() + 2 * marker.len().min(2),
            "{marker}: {typed:?} against {plain:?}"
        );
        // This test tokenizer's decoder puts spaces between word pieces, so the characters
        // are compared without whitespace.
        let (_, d) = s.post_json("/detokenize", &json!({"tokens": typed}));
        let squeeze = |t: &str| t.split_whitespace().collect::<String>();
        assert!(
            squeeze(d["prompt"].as_str().unwrap()).contains(&squeeze(&typed_text)),
            "{marker}: {d}"
        );
    }
}

/// SIGTERM while a stream runs: the stream still ends with a chunk carrying its
/// `finish_reason` and then `[DONE]` (cut at the next token once `--shutdown-timeout` has
/// passed), new requests meanwhile get a JSON 503, and the process exits 0.
#[test]
fn a_streaming_request_gets_its_final_chunk_and_done_on_sigterm_and_the_server_exits_0() {
    let mut s = Server::start(&["--shutdown-timeout", "1", "--max-model-len", "4096"]);
    let body = json!({"messages": user("Tell me everything."), "max_tokens": 4000,
                      "temperature": 0, "ignore_eos": true, "stream": true});
    let conn = serve_support::client::send(
        &s.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        body.to_string().as_bytes(),
    )
    .expect("POST");
    assert_eq!(conn.status, 200);
    let mut events = conn.events();
    let mut data = Vec::new();
    // The stream is running: its first chunk has arrived.
    while data.is_empty() {
        let ev = events
            .next_event()
            .expect("reading")
            .expect("a first event");
        data.extend(
            ev.lines()
                .filter_map(|l| l.strip_prefix("data: ").map(String::from)),
        );
    }
    s.terminate();
    // A request arriving during the drain is refused with a JSON 503 (or its connection is
    // refused once the listener has closed).
    std::thread::sleep(Duration::from_millis(200));
    if let Ok(r) = serve_support::client::request(&s.addr, "GET", "/health", &[], b"") {
        assert_eq!(r.status, 503, "{}", r.text());
        let v: Value = serde_json::from_slice(&r.body).expect("a JSON body");
        assert_eq!(v["error"]["code"], "shutting_down");
    }
    while let Some(ev) = events.next_event().expect("reading the rest of the stream") {
        data.extend(
            ev.lines()
                .filter_map(|l| l.strip_prefix("data: ").map(String::from)),
        );
    }
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    let (_, _, finish) = reassemble_chat(&data);
    eprintln!("{} chunks, finish_reason {finish}", data.len());
    assert!(
        finish == "length" || finish == "stop",
        "the last chunk carries a finish_reason, found {finish:?}"
    );
    let status = s
        .wait_exit(Duration::from_secs(20))
        .unwrap_or_else(|| panic!("serve still runs 20 s after SIGTERM:\n{}", s.stderr()));
    assert_eq!(status.code(), Some(0), "{}", s.stderr());
}

/// Reads until the peer closes (Ok(0) or a reset) or `limit` passes; whether it closed.
fn closed_within(conn: &mut TcpStream, limit: Duration) -> bool {
    conn.set_read_timeout(Some(limit)).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match std::io::Read::read(conn, &mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

/// A client that sends half a header is dropped after `--header-timeout`, and meanwhile the
/// others are served at once; a body that stops arriving gets a JSON 408 after
/// `--body-timeout`.
#[test]
fn a_client_holding_a_partial_request_is_dropped_after_the_header_timeout_while_others_are_served()
{
    let s = Server::start(&["--header-timeout", "1", "--body-timeout", "1"]);
    let t0 = std::time::Instant::now();
    let mut slow = TcpStream::connect(&s.addr).unwrap();
    slow.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        .unwrap();
    for _ in 0..3 {
        let t = std::time::Instant::now();
        assert_eq!(s.get("/health").status, 200);
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "{:?}",
            t.elapsed()
        );
    }
    assert!(
        closed_within(&mut slow, Duration::from_secs(5)),
        "the partial request is still open after 5 s"
    );
    let held = t0.elapsed();
    assert!(
        held >= Duration::from_millis(900) && held < Duration::from_secs(4),
        "dropped after {held:?} with a 1 s header timeout"
    );

    let t = std::time::Instant::now();
    let reply = raw(
        &s.addr,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":",
        Duration::from_secs(5),
    );
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
    assert!(reply.contains("\"code\":\"request_timeout\""), "{reply}");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
}

/// Past `--max-connections` a connection gets a JSON 503 with `Retry-After` and is closed;
/// once the held connections close, requests are served again.
#[test]
fn connections_past_the_limit_get_a_json_503_with_retry_after() {
    let s = Server::start(&["--max-connections", "3", "--header-timeout", "10"]);
    let held: Vec<TcpStream> = (0..3)
        .map(|_| TcpStream::connect(&s.addr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let reply = raw(
        &s.addr,
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
        Duration::from_secs(3),
    );
    assert!(reply.starts_with("HTTP/1.1 503"), "{reply}");
    assert!(
        reply.to_ascii_lowercase().contains("retry-after: 1"),
        "{reply}"
    );
    assert!(
        reply.contains("\"code\":\"too_many_connections\""),
        "{reply}"
    );
    drop(held);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let r = raw(
            &s.addr,
            b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            Duration::from_secs(3),
        );
        if r.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still refused 5 s after the held connections closed: {r}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
