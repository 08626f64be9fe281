//! `serve`: an OpenAI-compatible HTTP server over one engine (DESIGN §7).
//!
//! Requests are continuously batched by the engine's scheduler on a thread that owns it: they
//! join the running batch between decode steps and leave when they finish or their client goes
//! away. HTTP runs on tokio. The server listens while the model loads (`/health` answers 503
//! until it is ready).

mod api;
mod listen;
mod metrics;
mod routes;
mod sse;
mod structured;
mod toolcall;
mod worker;

use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;
use engine::{Device, Engine, EngineConfig};
use models::Loaded;

use crate::api::Defaults;
use crate::metrics::Metrics;
use crate::routes::{App, Ready};
use crate::worker::ThinkIds;
use engine::scheduler::SchedulerConfig;

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Serve a Xing4.0 (or deepseek2) GGUF checkpoint over the OpenAI API"
)]
struct Args {
    /// A .gguf file or a release directory holding one. Default: the embedded default model (tools/default-model).
    #[arg(long, short = 'm')]
    model: Option<PathBuf>,
    #[command(flatten)]
    lowering: tools::LoweringArgs,
    /// The release directory (tokenizer.json, config.json, chat template).
    #[arg(long)]
    tokenizer_path: Option<PathBuf>,
    /// The name clients put in `model`. Default: the release directory's (or file's) name.
    #[arg(long)]
    served_model_name: Option<String>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// 0 picks a free port (the address is printed once ready).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// `cpu`, `cuda[:N]`, or `auto` (GPU 0 when there is one, else the CPU).
    #[arg(long, default_value = "auto")]
    device: String,
    /// Positions one sequence may use (prompt + completion); the KV cache is sized for it at
    /// start-up. Default: 4096, or the checkpoint's context length when that is shorter.
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Prefix caching: full prompt blocks of the KV cache pool are shared between requests
    /// with the same token prefix (0 disables it; any other value enables it, the pool's
    /// unreferenced blocks are the cache).
    #[arg(long, default_value_t = 1 << 30)]
    prefix_cache_bytes: usize,
    /// Sequences decoded together in one step.
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
    /// Tokens one step may carry (decode rows plus a prefill chunk).
    #[arg(long, default_value_t = 4096)]
    max_num_batched_tokens: usize,
    /// Query-key pairs a prompt's chunk may attend in a step that also decodes (its tokens
    /// times the positions they reach; 0: no bound): a chunk deep in a long prompt slows every
    /// running sequence's step, so deeper chunks are shorter.
    #[arg(long, default_value_t = 0)]
    mixed_attention_budget: usize,
    /// Tokens a prompt's chunk may carry in a step that also decodes (0: no bound beyond
    /// --max-num-batched-tokens): every running sequence waits for that step, so this bounds
    /// their inter-token latency while prompts are admitted.
    #[arg(long, default_value_t = engine::scheduler::DEFAULT_MIXED_CHUNK_TOKENS)]
    mixed_chunk_tokens: usize,
    /// Choose every token on the host from its logits row (by default a step chooses the
    /// tokens of requests without a penalty, a bias, a grammar or logprobs where it ran, and
    /// only token ids come back).
    #[arg(long)]
    sample_on_host: bool,
    /// Blocks of the KV cache pool (0: sized from the free memory at load).
    #[arg(long, default_value_t = 0)]
    kv_cache_blocks: usize,
    /// Positions of a KV cache block (a power of two): the granularity of prefix sharing.
    #[arg(long, default_value_t = 64)]
    block_size: usize,
    /// Require `Authorization: Bearer <KEY>` on the API endpoints.
    #[arg(long)]
    api_key: Option<String>,
    /// Seconds of silence after which a stream (e.g. one waiting in the queue) gets a
    /// `: keep-alive` comment, so that proxies and clients do not time it out.
    #[arg(long, default_value_t = 5.0)]
    sse_keep_alive: f64,
    /// Tokens per prefill chunk (0: 4096 on a GPU, 256 on the CPU).
    #[arg(long, default_value_t = 0)]
    prefill_chunk: usize,
    /// Seconds running requests have to finish after SIGTERM or SIGINT; then each is cut at
    /// its next token (its stream still ends with a final chunk and `[DONE]`) and the server
    /// exits 0. Requests that have no token yet get 503 at once.
    #[arg(long, default_value_t = 30.0)]
    shutdown_timeout: f64,
    /// Seconds a connection has to send a request's headers, counted from its opening or from
    /// the end of its previous response, so it is also how long an idle keep-alive connection
    /// is kept; past it the connection is closed.
    #[arg(long, default_value_t = 10.0)]
    header_timeout: f64,
    /// Seconds a request's body has to arrive once its headers have; past it, a JSON 408.
    #[arg(long, default_value_t = 30.0)]
    body_timeout: f64,
    /// Connections served at once; one more gets a JSON 503 with `Retry-After: 1` and is
    /// closed.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device: Device = args
        .device
        .parse()
        .map_err(|e| anyhow::anyhow!("--device {}: {e}", args.device))?;
    for (flag, v) in [
        ("--header-timeout", args.header_timeout),
        ("--body-timeout", args.body_timeout),
    ] {
        if !(v.is_finite() && v >= 0.01) {
            bail!("{flag} {v} must be at least 0.01 seconds");
        }
    }
    if args.max_connections == 0 {
        bail!("--max-connections must be at least 1");
    }
    if !(args.shutdown_timeout.is_finite() && args.shutdown_timeout >= 0.0) {
        bail!(
            "--shutdown-timeout {} must be a number of seconds, 0 or more",
            args.shutdown_timeout
        );
    }
    if !(args.sse_keep_alive.is_finite() && args.sse_keep_alive >= 0.01) {
        bail!(
            "--sse-keep-alive {} must be at least 0.01 seconds",
            args.sse_keep_alive
        );
    }
    if let Some(n) = args.max_model_len
        && n < 2
    {
        bail!(
            "--max-model-len {n} is too small: a request needs at least one prompt and one generated position"
        );
    }
    let (gguf, release_dir) = match &args.model {
        Some(m) => models::resolve(Some(m), args.tokenizer_path.as_deref())?,
        None => {
            let dir = tools::default_checkpoint()?;
            eprintln!(
                "note: no --model given; running {} ({})",
                tools::DEFAULT_MODEL_NOTE,
                dir.display()
            );
            (dir.join("model.gguf"), Some(dir))
        }
    };
    let loaded = models::load(&gguf, release_dir.as_deref(), false)?;
    let trained = loaded.model.hparams.n_ctx_train;
    let config = EngineConfig {
        max_model_len: args.max_model_len.unwrap_or(if trained >= 2 {
            trained.min(4096)
        } else {
            4096
        }),
        prefill_chunk: args.prefill_chunk,
        device,
        lowering: args.lowering.options()?,
        max_num_seqs: args.max_num_seqs,
        kv_blocks: args.kv_cache_blocks,
        block_size: args.block_size,
        ..EngineConfig::default()
    };
    if args.max_num_seqs == 0 || args.max_num_batched_tokens == 0 {
        bail!("--max-num-seqs and --max-num-batched-tokens must be at least 1");
    }
    if args.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
        bail!(
            "--api-key is empty: every client would pass with `Authorization: Bearer ` and nothing; give a key, or leave the flag out to serve without one"
        );
    }
    if !args.block_size.is_power_of_two() {
        bail!("--block-size {} must be a power of two", args.block_size);
    }
    check_memory(&loaded, &config)?;
    let served = args
        .served_model_name
        .clone()
        .unwrap_or_else(|| default_name(release_dir.as_deref(), &gguf));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(serve(args, served, loaded, config))
}

fn default_name(release_dir: Option<&Path>, gguf: &Path) -> String {
    release_dir
        .and_then(|d| d.file_name())
        .or_else(|| gguf.file_stem())
        .map_or_else(|| "xing4".to_string(), |n| n.to_string_lossy().into_owned())
}

/// `MemAvailable` of /proc/meminfo, in bytes.
fn mem_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

fn gib(b: u128) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// Refuses a --max-model-len whose KV cache cannot fit, with the numbers (seed §5), rather than
/// failing inside a request. The engine allocates a power-of-two number of rows.
fn check_memory(loaded: &Loaded, config: &EngineConfig) -> Result<()> {
    let per_position = loaded.model.decl.state_bytes_per_position() as u128;
    let len = config.max_model_len;
    let trained = loaded.model.hparams.n_ctx_train;
    if trained > 0 && len > trained {
        bail!(
            "--max-model-len {len} is longer than the checkpoint's context length {trained} ({}.context_length); lower it",
            loaded.model.hparams.arch.name()
        );
    }
    let rows = len
        .max(config.min_kv_bucket)
        .checked_next_power_of_two()
        .map_or(u128::MAX, |r| r as u128);
    let need = per_position.saturating_mul(rows);
    // A GPU cache is checked against the card's free memory by Engine::new.
    if config.device == Device::Cpu
        && let Some(avail) = mem_available()
        && need > avail as u128
    {
        let fit = (avail as u128 / per_position.max(1)).min(usize::MAX as u128);
        let fit = if fit.is_power_of_two() {
            fit
        } else {
            fit.next_power_of_two() / 2
        };
        // Never more than the checkpoint can attend over.
        let fit = if trained > 0 {
            fit.min(trained as u128)
        } else {
            fit
        };
        bail!(
            "--max-model-len {len} needs a KV cache of {need} bytes ({:.2} GiB: {per_position} bytes a position x {rows} rows), but /proc/meminfo MemAvailable is {avail} bytes ({:.2} GiB); lower --max-model-len to at most {fit}",
            gib(need),
            gib(avail as u128)
        );
    }
    Ok(())
}

async fn serve(args: Args, served: String, loaded: Loaded, config: EngineConfig) -> Result<()> {
    let metrics = Arc::new(Metrics::new(args.prefix_cache_bytes, config.max_model_len));
    metrics
        .weight_bytes
        .store(loaded.model.total_weight_bytes(), Relaxed);
    let app = Arc::new(App::new(
        served.clone(),
        args.api_key.clone(),
        config.max_model_len,
        Duration::from_secs_f64(args.sse_keep_alive),
        Duration::from_secs_f64(args.body_timeout),
        metrics.clone(),
    ));
    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("binding {addr} (--host/--port)"))?;
    let local = listener.local_addr().context("reading the bound address")?;
    eprintln!("serve: loading on http://{local}; /health answers 503 until the model is ready");

    let loader_app = app.clone();
    let sched = SchedulerConfig {
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        prefix_caching: args.prefix_cache_bytes > 0,
        sample_on_host: args.sample_on_host,
        mixed_attention_budget: args.mixed_attention_budget,
        mixed_chunk_tokens: args.mixed_chunk_tokens,
    };
    std::thread::Builder::new()
        .name("load".into())
        .spawn(move || {
            if let Err(e) = finish_loading(&loader_app, loaded, config, sched, local) {
                eprintln!("serve: error: {e:#}");
                std::process::exit(1);
            }
        })
        .context("starting the loading thread")?;

    let drain = shutdown_signal(app.clone(), Duration::from_secs_f64(args.shutdown_timeout));
    let limits = listen::Limits {
        header_timeout: Duration::from_secs_f64(args.header_timeout),
        max_connections: args.max_connections,
    };
    listen::serve(listener, routes::router(app), limits, drain).await;
    eprintln!("serve: shut down");
    Ok(())
}

/// Resolves at SIGTERM or SIGINT, after starting the drain: the routes and the engine thread
/// refuse new work, running requests have `timeout` before they are cut at their next token,
/// and the HTTP server (awaiting this) stops accepting and waits for open streams to end. Ten
/// seconds past the timeout the process exits 0 even if a client has not read its stream.
async fn shutdown_signal(app: Arc<App>, timeout: Duration) {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                eprintln!("serve: warning: cannot listen for SIGTERM ({e}); SIGINT still drains");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate => {}
    }
    eprintln!(
        "serve: shutting down: no new requests; running ones have {:.1} s to finish",
        timeout.as_secs_f64()
    );
    app.shutdown.draining.store(true, Relaxed);
    let shutdown = app.shutdown.clone();
    tokio::spawn(async move {
        tokio::time::sleep(timeout).await;
        shutdown.cut.store(true, Relaxed);
    });
    std::thread::spawn(move || {
        std::thread::sleep(timeout + Duration::from_secs(10));
        eprintln!("serve: streams still open 10 s after the shutdown timeout; exiting");
        std::process::exit(0);
    });
}

/// Pages the weights in, allocates the cache, starts the engine thread, and opens the API.
fn finish_loading(
    app: &Arc<App>,
    loaded: Loaded,
    config: EngineConfig,
    sched: SchedulerConfig,
    addr: SocketAddr,
) -> Result<()> {
    let gguf = &loaded.model.gguf;
    let mut sink = 0u8;
    for t in &gguf.tensors {
        for page in gguf.tensor_data(t).chunks(4096) {
            sink ^= page[0];
        }
    }
    std::hint::black_box(sink);
    let tokenizer = Arc::new(loaded.tokenizer.context(
        "the checkpoint has no tokenizer (give the release directory with --tokenizer-path)",
    )?);
    let engine = Engine::new(loaded.model.clone(), config).context("allocating the engine")?;
    app.metrics
        .kv_cache_bytes
        .store(engine.cache_bytes() as u64, Relaxed);
    let budget = app.metrics.prefix_budget();
    if budget > engine.cache_bytes() {
        eprintln!(
            "serve: note: --prefix-cache-bytes {budget} is more than the whole KV cache ({} bytes): \
             cached prefixes live in the cache's blocks, so they never hold more than it",
            engine.cache_bytes()
        );
    }
    let mut engine = engine;
    tools::upload_with_progress(&mut engine, "serve")?;

    let think = ThinkIds::of(&tokenizer);
    let mut eos_stops: Vec<u32> = tokenizer.eos_id().into_iter().collect();
    let generation = loaded.release.as_ref().and_then(|r| r.generation.as_ref());
    if let Some(ids) = generation.and_then(|g| g.eos_token_id.as_ref()) {
        eos_stops.extend(ids.ids());
    }
    // The turn markers end a chat turn too (spec §8).
    let mut chat_stops = eos_stops.clone();
    for piece in [
        "<_user>",
        "<_bot>",
        "<_system>",
        "<_start>",
        "<_pad>",
        "<tool_response>",
        "</tool_response>",
    ] {
        chat_stops.extend(tokenizer.piece_to_id(piece));
    }
    for v in [&mut eos_stops, &mut chat_stops] {
        v.sort_unstable();
        v.dedup();
    }
    let d = Defaults::default();
    let defaults = Defaults {
        temperature: generation
            .and_then(|g| g.temperature)
            .map_or(d.temperature, |v| v as f32),
        top_p: generation
            .and_then(|g| g.top_p)
            .map_or(d.top_p, |v| v as f32),
        top_k: generation
            .and_then(|g| g.top_k)
            .map_or(d.top_k, |v| usize::try_from(v).unwrap_or(0)),
        repetition_penalty: generation
            .and_then(|g| g.repetition_penalty)
            .map_or(d.repetition_penalty, |v| v as f32),
    };
    let bos = match tokenizer.add_bos_token() {
        Some(true) => tokenizer.bos_id(),
        _ => None,
    };
    let jobs = worker::spawn(
        engine,
        tokenizer.clone(),
        sched,
        think,
        app.metrics.clone(),
        app.shutdown.clone(),
    )
    .context("starting the engine thread")?;
    let markers = tokenizer.marker_strings();
    // A constrained answer ends with the turn's end (the first chat stop that is EOS).
    let guidance = match eos_stops.first().copied().or(tokenizer.eos_id()) {
        Some(eos) => Some(
            structured::Guidance::new(&tokenizer, eos, think.end, &chat_stops)
                .context("building the structured-output token trie")?,
        ),
        None => None,
    };
    let ready = Ready {
        guidance,
        markers,
        tokenizer,
        template: loaded.chat_template,
        jobs,
        defaults,
        think,
        bos,
        chat_stops,
        eos_stops,
    };
    if app.ready.set(ready).is_err() {
        bail!("the model was loaded twice");
    }
    app.metrics.loaded.store(1, Relaxed);
    let mut out = std::io::stdout();
    let _ = writeln!(
        out,
        "serve: ready on http://{addr} (model `{}`, OpenAI base URL http://{addr}/v1)",
        app.served
    );
    let _ = out.flush();
    if std::io::stderr().is_terminal() {
        eprintln!(
            "try: curl -s http://{addr}/v1/chat/completions -H 'Content-Type: application/json' -d '{{\"messages\":[{{\"role\":\"user\",\"content\":\"Hello\"}}],\"max_tokens\":16}}'"
        );
    }
    Ok(())
}
