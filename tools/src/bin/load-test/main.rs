//! Loopback load test for `serve`: N concurrent clients stream chat completions against --url,
//! either until --requests are done (or --time-limit passes) or, with --duration, for that
//! long. A seeded fraction of the requests is cancelled midway by closing the connection, and
//! another is read slowly.
//! Reports requests/s, generated tokens/s, the p50/p99 time to first token and inter-token
//! latency (of the requests read at full speed: a slow reader's gaps are its own pauses, reported
//! apart), then checks on `/metrics` that the server went idle with every cache block back;
//! fails on any failed request or leaked block. Starts no server itself (bench/soak.sh and
//! bench/load-test.sh do).

mod client;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
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
    /// Requests in all (no limit with --duration).
    #[arg(long, default_value_t = 64)]
    requests: usize,
    #[arg(long, default_value_t = 16)]
    max_tokens: usize,
    /// No request starts after this many seconds; unfinished ones then count as failed
    /// (ignored with --duration).
    #[arg(long, default_value_t = 120)]
    time_limit: u64,
    /// Clients keep starting requests until this many seconds have passed, then let the
    /// running ones finish.
    #[arg(long)]
    duration: Option<f64>,
    /// Fraction of the requests cancelled by closing the connection after a random number
    /// (1..=--max-tokens) of content chunks.
    #[arg(long, default_value_t = 0.0)]
    cancel_fraction: f64,
    /// Fraction of the requests read slowly: the client waits --slow-read-ms after each event
    /// it reads, so the server's stream outruns it (its bytes queue in the connection).
    #[arg(long, default_value_t = 0.0)]
    slow_fraction: f64,
    #[arg(long, default_value_t = 50)]
    slow_read_ms: u64,
    /// Prompts of exactly this many token ids (seeded, distinct a request, below
    /// --prompt-vocab) through /v1/completions; 0 (default): chat prompts of 1 to 20
    /// sentences through /v1/chat/completions.
    #[arg(long, default_value_t = 0)]
    prompt_tokens: usize,
    /// The token ids of --prompt-tokens are drawn from 1..this.
    #[arg(long, default_value_t = 1000)]
    prompt_vocab: u32,
    /// Seeds the choice of cancelled requests and the sampling seeds of all of them.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// A request not finished after this many seconds fails (a server that keeps a stream
    /// open with keep-alives but never finishes it would otherwise hang the test).
    #[arg(long, default_value_t = 300)]
    request_timeout: u64,
    #[arg(long)]
    api_key: Option<String>,
}

/// What one request is told to do, fixed by its index and --seed so that a run can be
/// repeated request for request.
struct Plan {
    index: usize,
    max_tokens: usize,
    /// Close the connection after this many content chunks.
    cancel_after: Option<usize>,
    /// Wait this long after each event read (a slow reader).
    read_pause: Option<Duration>,
    seed: u64,
    timeout: Duration,
    /// Token ids of the prompt (--prompt-tokens), or empty for a chat prompt.
    prompt_ids: Vec<u32>,
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Plan {
    fn new(args: &Args, index: usize) -> Plan {
        let r = splitmix64(args.seed ^ splitmix64(index as u64));
        // The top 53 bits as a uniform number in [0, 1).
        let u = (r >> 11) as f64 / (1u64 << 53) as f64;
        let cancel_after = (u < args.cancel_fraction)
            .then(|| 1 + (splitmix64(r) % args.max_tokens.max(1) as u64) as usize);
        let v = (splitmix64(r ^ 0x51_0e) >> 11) as f64 / (1u64 << 53) as f64;
        let read_pause = (v < args.slow_fraction).then(|| Duration::from_millis(args.slow_read_ms));
        let range = u64::from(args.prompt_vocab.max(2) - 1);
        let mut s = splitmix64(r ^ 0x1d5);
        let prompt_ids = (0..args.prompt_tokens)
            .map(|_| {
                s = splitmix64(s);
                1 + (s % range) as u32
            })
            .collect();
        Plan {
            index,
            max_tokens: args.max_tokens,
            cancel_after,
            read_pause,
            // The API takes an i64; the mask keeps it positive.
            seed: splitmix64(r ^ 0x5eed) & (i64::MAX as u64),
            timeout: Duration::from_secs(args.request_timeout),
            prompt_ids,
        }
    }

    /// Prompts of different lengths (1 to 20 sentences), so that sequences of different lengths
    /// batch together and longer prompts share their leading blocks with shorter ones.
    fn prompt(&self) -> String {
        let i = self.index;
        format!(
            "{}Request {i}: say something about the number {i}.",
            "The quick brown fox jumps over the lazy dog. ".repeat(1 + i % 20)
        )
    }
}

#[derive(Default)]
struct Outcome {
    cancelled: bool,
    /// Read slowly (--slow-fraction): its gaps are the reader's pauses.
    slow: bool,
    ttft: Option<Duration>,
    /// Arrival of each content chunk, from the request's start.
    chunks: Vec<Duration>,
    /// Completion tokens: the usage of a finished request, the chunks seen of a cancelled one.
    tokens: usize,
}

/// A content chunk: one with a choice that carries generated text, neither the opening one
/// (the role) nor the one with the finish reason.
fn is_content(choice: &Value) -> bool {
    let finished = choice.get("finish_reason").is_some_and(|f| !f.is_null());
    let opening = choice.get("delta").is_some_and(|d| d.get("role").is_some());
    !finished && !opening
}

/// One streaming chat, timing each content chunk as it arrives.
fn one(addr: &str, auth: &[(&str, &str)], plan: &Plan) -> Result<Outcome> {
    let mut body = json!({
        "max_tokens": plan.max_tokens,
        "temperature": 0.8,
        "seed": plan.seed,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let path = if plan.prompt_ids.is_empty() {
        body["messages"] = json!([{"role": "user", "content": plan.prompt()}]);
        "/v1/chat/completions"
    } else {
        body["prompt"] = json!(plan.prompt_ids);
        "/v1/completions"
    };
    let start = Instant::now();
    let conn = client::send(addr, "POST", path, auth, body.to_string().as_bytes())?;
    if conn.status != 200 {
        let r = conn.read_all()?;
        bail!("HTTP {}: {}", r.status, r.text());
    }
    let mut events = conn.events();
    let mut out = Outcome {
        slow: plan.read_pause.is_some(),
        ..Outcome::default()
    };
    let mut usage = None;
    let mut finished = false;
    let mut done = false;
    while let Some(ev) = events.next_event()? {
        if let Some(p) = plan.read_pause {
            std::thread::sleep(p);
        }
        if start.elapsed() > plan.timeout {
            bail!(
                "not finished after {} s ({} content chunks)",
                plan.timeout.as_secs(),
                out.chunks.len()
            );
        }
        let Some(data) = ev.lines().find_map(|l| l.strip_prefix("data: ")) else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
            break;
        }
        let v: Value =
            serde_json::from_str(data).with_context(|| format!("bad event data {data:?}"))?;
        if v.get("error").is_some() {
            bail!(
                "error event after {} content chunks: {data}",
                out.chunks.len()
            );
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            let n = u.get("completion_tokens").and_then(Value::as_u64);
            usage = Some(n.ok_or_else(|| anyhow!("usage without completion_tokens: {data}"))?);
        }
        let Some(choice) = v.get("choices").and_then(|c| c.as_array()?.first()) else {
            continue;
        };
        let now = start.elapsed();
        if is_content(choice) {
            out.chunks.push(now);
            out.ttft.get_or_insert(now);
            if plan.cancel_after == Some(out.chunks.len()) {
                // Dropping the stream closes the connection: the server sees its client go.
                drop(events);
                out.cancelled = true;
                out.tokens = out.chunks.len();
                return Ok(out);
            }
        } else if choice.get("finish_reason").is_some_and(|f| !f.is_null()) {
            finished = true;
            // A completion of no text still has a first token: the finish.
            out.ttft.get_or_insert(now);
        }
    }
    if !done {
        bail!(
            "the stream ended without [DONE] ({} content chunks)",
            out.chunks.len()
        );
    }
    if !finished {
        bail!("the stream ended without a finish_reason");
    }
    let tokens = usage.ok_or_else(|| anyhow!("the stream ended without its usage"))?;
    out.tokens = usize::try_from(tokens)?;
    Ok(out)
}

/// One client's tally, merged over all of them at the end.
#[derive(Default)]
struct Tally {
    ok: usize,
    cancelled: usize,
    failed: usize,
    /// The first few failures' messages (a server that fails every request at once would
    /// otherwise fill the memory during a long --duration).
    failures: Vec<String>,
    ttft: Vec<Duration>,
    /// Gaps between consecutive content chunks of one request read at full speed.
    itl: Vec<Duration>,
    /// The same of the slow readers (their pauses, not the server's).
    itl_slow: Vec<Duration>,
    tokens: usize,
}

impl Tally {
    fn add(&mut self, o: Outcome) {
        if o.cancelled {
            self.cancelled += 1;
        } else {
            self.ok += 1;
        }
        self.ttft.extend(o.ttft);
        let gaps = o.chunks.windows(2).map(|w| w[1].saturating_sub(w[0]));
        if o.slow {
            self.itl_slow.extend(gaps);
        } else {
            self.itl.extend(gaps);
        }
        self.tokens += o.tokens;
    }

    fn fail(&mut self, msg: String) {
        self.failed += 1;
        if self.failures.len() < 10 {
            self.failures.push(msg);
        }
    }

    fn merge(&mut self, t: Tally) {
        self.ok += t.ok;
        self.cancelled += t.cancelled;
        self.failed += t.failed;
        self.failures.extend(t.failures);
        self.ttft.extend(t.ttft);
        self.itl.extend(t.itl);
        self.itl_slow.extend(t.itl_slow);
        self.tokens += t.tokens;
    }
}

fn percentile_ms(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)].as_secs_f64() * 1e3
}

/// The samples of `/metrics` by name (labelled series keep their labels in the name).
fn metrics(addr: &str, auth: &[(&str, &str)]) -> Result<HashMap<String, f64>> {
    let r = client::request(addr, "GET", "/metrics", auth, b"")?;
    if r.status != 200 {
        bail!("GET /metrics: HTTP {}: {}", r.status, r.text());
    }
    let mut m = HashMap::new();
    for line in r.text().lines().filter(|l| !l.starts_with('#')) {
        if let Some((name, value)) = line.rsplit_once(' ')
            && let Ok(v) = value.parse::<f64>()
        {
            m.insert(name.to_string(), v);
        }
    }
    Ok(m)
}

/// The server's state once the clients are gone.
struct After {
    running: f64,
    cache_usage: f64,
    preemptions: f64,
    blocks: f64,
}

/// Polls `/metrics` for up to 10 s until nothing runs and no cache block is held: a cancelled
/// request's blocks are freed by the engine thread a step after its client goes.
fn settle(addr: &str, auth: &[(&str, &str)]) -> Result<After> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = metrics(addr, auth).and_then(|m| {
            let get = |name: &str| {
                m.get(name)
                    .copied()
                    .ok_or_else(|| anyhow!("/metrics has no {name}"))
            };
            Ok(After {
                running: get("xing4_num_requests_running")?,
                cache_usage: get("xing4_gpu_cache_usage_perc")?,
                preemptions: get("xing4_num_preemptions_total")?,
                blocks: get("xing4_kv_cache_blocks")?,
            })
        });
        match got {
            Ok(a) if a.running == 0.0 && a.cache_usage == 0.0 => return Ok(a),
            r if Instant::now() >= deadline => return r,
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    }
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
    if !(0.0..=1.0).contains(&args.slow_fraction) {
        bail!("--slow-fraction {}: give 0..=1", args.slow_fraction);
    }
    if !(0.0..=1.0).contains(&args.cancel_fraction) {
        bail!("--cancel-fraction {}: give 0..=1", args.cancel_fraction);
    }
    if args.duration.is_some_and(|d| !(d >= 0.0 && d.is_finite())) {
        bail!("--duration: give a number of seconds");
    }
    let clients = args.clients.max(1);
    let next = AtomicUsize::new(0);
    let start = Instant::now();
    let deadline = start + Duration::from_secs(args.time_limit);
    let stop_at = args.duration.map(|d| start + Duration::from_secs_f64(d));
    let auth_header = args.api_key.as_ref().map(|k| format!("Bearer {k}"));
    let auth: Vec<(&str, &str)> = auth_header
        .as_deref()
        .map(|h| ("Authorization", h))
        .into_iter()
        .collect();
    let mut all = Tally::default();
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = (0..clients)
            .map(|_| {
                let (addr, auth, args, next) = (&addr, &auth, &args, &next);
                s.spawn(move || {
                    let mut t = Tally::default();
                    loop {
                        let i = next.fetch_add(1, Relaxed);
                        let more = match stop_at {
                            Some(stop) => Instant::now() < stop,
                            None => i < args.requests && Instant::now() <= deadline,
                        };
                        if !more {
                            break;
                        }
                        match one(addr, auth, &Plan::new(args, i)) {
                            Ok(o) => t.add(o),
                            Err(e) => t.fail(format!("request {i}: {e:#}")),
                        }
                    }
                    t
                })
            })
            .collect();
        for h in handles {
            all.merge(h.join().map_err(|_| anyhow!("a client panicked"))?);
        }
        Ok(())
    })?;
    let wall = start.elapsed().as_secs_f64();
    all.ttft.sort();
    all.itl.sort();
    all.itl_slow.sort();
    let failed = all.failed;
    let not_started = match stop_at {
        Some(_) => 0,
        None => args
            .requests
            .saturating_sub(all.ok + all.cancelled + failed),
    };
    let req_per_s = all.ok as f64 / wall;
    let tok_per_s = all.tokens as f64 / wall;
    let (ttft50, ttft99) = (
        percentile_ms(&all.ttft, 0.5),
        percentile_ms(&all.ttft, 0.99),
    );
    let (itl50, itl99) = (percentile_ms(&all.itl, 0.5), percentile_ms(&all.itl, 0.99));
    let slow_itl50 = percentile_ms(&all.itl_slow, 0.5);
    println!(
        "load-test: {clients} clients, {} ok, {} cancelled, {failed} failed, {not_started} not started, {wall:.2} s",
        all.ok, all.cancelled
    );
    println!(
        "load-test: {req_per_s:.2} requests/s, {tok_per_s:.1} generated tokens/s, time to first token p50 {ttft50:.1} ms, p99 {ttft99:.1} ms, inter-token p50 {itl50:.1} ms, p99 {itl99:.1} ms ({} gaps; the slow readers' {} gaps apart, p50 {slow_itl50:.1} ms)",
        all.itl.len(),
        all.itl_slow.len()
    );
    for f in all.failures.iter().take(20) {
        eprintln!("load-test: {f}");
    }
    let mut problems = Vec::new();
    if failed > 0 {
        problems.push(format!("{failed} requests failed"));
    }
    if not_started > 0 {
        problems.push(format!(
            "{not_started} requests did not start within --time-limit"
        ));
    }
    let after = settle(&addr, &auth);
    let (preemptions, usage_end) = match &after {
        Ok(a) => {
            println!(
                "load-test: server after the run: {} running, cache usage {}, {} preemptions, {} KV cache blocks",
                a.running, a.cache_usage, a.preemptions, a.blocks
            );
            if a.cache_usage != 0.0 {
                problems.push(format!(
                    "the cache usage stayed at {} ({} of {} blocks held) 10 s after the clients stopped: blocks leaked",
                    a.cache_usage,
                    (a.cache_usage * a.blocks).round(),
                    a.blocks
                ));
            }
            if a.running != 0.0 {
                problems.push(format!(
                    "{} requests still running 10 s after the clients stopped",
                    a.running
                ));
            }
            (a.preemptions.to_string(), a.cache_usage.to_string())
        }
        Err(e) => {
            problems.push(format!("the server's metrics after the run: {e:#}"));
            ("na".to_string(), "na".to_string())
        }
    };
    println!(
        "load-test: summary clients={clients} seconds={wall:.1} ok={} cancelled={} failed={failed} req_per_s={req_per_s:.2} tok_per_s={tok_per_s:.1} ttft_p50_ms={ttft50:.1} ttft_p99_ms={ttft99:.1} itl_p50_ms={itl50:.1} itl_p99_ms={itl99:.1} slow_itl_p50_ms={slow_itl50:.1} preemptions={preemptions} cache_usage_end={usage_end}",
        all.ok, all.cancelled
    );
    if !problems.is_empty() {
        bail!("{}", problems.join("; "));
    }
    Ok(())
}
