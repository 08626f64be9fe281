//! Loopback load test for `serve`: N concurrent clients stream chat completions against --url
//! until --requests are done or --time-limit passes. Reports requests/s and the p50/p99 time
//! to first token, and fails on any failed request. Starts no server itself
//! (bench/load-test.sh does).

mod client;

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use clap::Parser;
use serde_json::{Value, json};

#[derive(Parser, Debug)]
#[command(about = "Concurrent streaming clients against a running `serve`")]
struct Args {
    /// The server, e.g. http://127.0.0.1:8080.
    #[arg(long)]
    url: String,
    /// Concurrent clients.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Requests in all.
    #[arg(long, default_value_t = 64)]
    requests: usize,
    #[arg(long, default_value_t = 16)]
    max_tokens: usize,
    /// No request starts after this many seconds; unfinished ones then count as failed.
    #[arg(long, default_value_t = 120)]
    time_limit: u64,
    #[arg(long)]
    api_key: Option<String>,
}

struct Outcome {
    ttft: Option<Duration>,
    tokens: usize,
}

/// One streaming chat; the time to the first chunk that carries generated text or a finish.
fn one(addr: &str, auth: &[(&str, &str)], i: usize, max_tokens: usize) -> Result<Outcome> {
    let body = json!({
        "messages": [{"role": "user", "content": format!("Request {i}: say something about the number {i}.")}],
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": i,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let start = Instant::now();
    let conn = client::send(
        addr,
        "POST",
        "/v1/chat/completions",
        auth,
        body.to_string().as_bytes(),
    )?;
    if conn.status != 200 {
        let r = conn.read_all()?;
        bail!("HTTP {}: {}", r.status, r.text());
    }
    let mut events = conn.events();
    let mut ttft = None;
    let mut tokens = 0;
    let mut done = false;
    let mut first = true;
    while let Some(ev) = events.next_event()? {
        let Some(data) = ev.lines().find_map(|l| l.strip_prefix("data: ")) else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
            break;
        }
        let v: Value = serde_json::from_str(data)?;
        if v.get("error").is_some() {
            bail!("error event: {data}");
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            tokens = u["completion_tokens"].as_u64().unwrap_or(0) as usize;
        }
        // The opening chunk only carries the role.
        if std::mem::take(&mut first) {
            continue;
        }
        if ttft.is_none() && v["choices"].as_array().is_some_and(|c| !c.is_empty()) {
            ttft = Some(start.elapsed());
        }
    }
    if !done {
        bail!("the stream ended without [DONE]");
    }
    Ok(Outcome { ttft, tokens })
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn main() -> Result<()> {
    let args = Args::parse();
    let addr = args
        .url
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    if addr.contains('/') || args.url.starts_with("https://") {
        bail!("--url {}: give http://host:port", args.url);
    }
    let next = Arc::new(AtomicUsize::new(0));
    let results = Arc::new(Mutex::new(Vec::new()));
    let failures = Arc::new(Mutex::new(Vec::<String>::new()));
    let deadline = Instant::now() + Duration::from_secs(args.time_limit);
    let start = Instant::now();
    let auth_header = args.api_key.as_ref().map(|k| format!("Bearer {k}"));
    std::thread::scope(|s| {
        for _ in 0..args.clients.max(1) {
            let (next, results, failures) = (next.clone(), results.clone(), failures.clone());
            let (addr, auth_header) = (&addr, &auth_header);
            s.spawn(move || {
                let auth: Vec<(&str, &str)> = auth_header
                    .as_deref()
                    .map(|h| ("Authorization", h))
                    .into_iter()
                    .collect();
                loop {
                    let i = next.fetch_add(1, Relaxed);
                    if i >= args.requests || Instant::now() > deadline {
                        break;
                    }
                    match one(addr, &auth, i, args.max_tokens) {
                        Ok(o) => results.lock().map(|mut r| r.push(o)).unwrap_or(()),
                        Err(e) => failures
                            .lock()
                            .map(|mut f| f.push(format!("request {i}: {e:#}")))
                            .unwrap_or(()),
                    }
                }
            });
        }
    });
    let wall = start.elapsed();
    let results = std::mem::take(
        &mut *results
            .lock()
            .map_err(|_| anyhow::anyhow!("a client panicked"))?,
    );
    let failures = std::mem::take(
        &mut *failures
            .lock()
            .map_err(|_| anyhow::anyhow!("a client panicked"))?,
    );
    let mut ttft: Vec<Duration> = results.iter().filter_map(|o| o.ttft).collect();
    ttft.sort();
    let tokens: usize = results.iter().map(|o| o.tokens).sum();
    let done = results.len();
    let not_started = args.requests.saturating_sub(done + failures.len());
    println!(
        "load-test: {} clients, {done}/{} requests ok, {} failed, {not_started} not started, {:.2} s",
        args.clients,
        args.requests,
        failures.len(),
        wall.as_secs_f64()
    );
    println!(
        "load-test: {:.2} requests/s, {:.1} generated tokens/s, time to first token p50 {:.1} ms, p99 {:.1} ms",
        done as f64 / wall.as_secs_f64(),
        tokens as f64 / wall.as_secs_f64(),
        percentile(&ttft, 0.50).as_secs_f64() * 1e3,
        percentile(&ttft, 0.99).as_secs_f64() * 1e3,
    );
    for f in failures.iter().take(10) {
        eprintln!("load-test: {f}");
    }
    if !failures.is_empty() || not_started > 0 {
        bail!(
            "{} requests failed and {not_started} did not start within --time-limit",
            failures.len()
        );
    }
    Ok(())
}
