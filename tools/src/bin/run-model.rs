//! Generate text with a checkpoint. With no arguments it chats with the embedded default
//! model (tools/default-model).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use engine::scheduler::{Scheduler, SchedulerConfig, SeqEvent};
use engine::{Device, Engine, EngineConfig, GenerateRequest, SamplingParams};
use graph::LogitRows;
use loader::chat::ChatMessage;

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Generate text with a Xing4.0 (or deepseek2) GGUF checkpoint"
)]
struct Args {
    /// A .gguf file or a release directory holding one. Default: the embedded default model (tools/default-model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The release directory (tokenizer.json, config.json, chat template).
    #[arg(long)]
    tokenizer_path: Option<PathBuf>,
    /// The user message (or raw text with --raw).
    #[arg(long, default_value = "What is the capital of France?")]
    prompt: String,
    /// Encode the prompt as is, without the chat template.
    #[arg(long)]
    raw: bool,
    /// Token ids instead of text, e.g. `1,2,3` (no tokenizer needed).
    #[arg(long, value_delimiter = ',')]
    prompt_tokens: Option<Vec<u32>>,
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sample greedily (temperature 0).
    #[arg(long)]
    greedy: bool,
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.05)]
    repetition_penalty: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Disable the thinking preamble of the chat template.
    #[arg(long)]
    no_thinking: bool,
    /// `cpu`, `cuda[:N]`, or `auto` (GPU 0 when the driver sees one, else the CPU).
    #[arg(long, default_value = "auto")]
    device: String,
    /// Run every GPU decode step eagerly instead of replaying a captured CUDA graph.
    #[arg(long)]
    no_cuda_graphs: bool,
    #[command(flatten)]
    lowering: tools::LoweringArgs,
    #[arg(long, default_value_t = 4096)]
    max_model_len: usize,
    /// Prefill chunk size in tokens (0: 4096 on a GPU, 256 on the CPU).
    #[arg(long, default_value_t = 0)]
    prefill_chunk: usize,
    /// Write `{"logits": [[f32; vocab]; n_prompt]}` for every prompt position and exit.
    #[arg(long)]
    dump_logits: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device: Device = args
        .device
        .parse()
        .map_err(|e: String| anyhow::anyhow!("--device: {e}"))?;
    let (gguf, release_dir, embedded) = match &args.model {
        Some(m) => {
            let (g, r) = models::resolve(Some(m), args.tokenizer_path.as_deref())?;
            (g, r, false)
        }
        None => {
            let dir = tools::default_checkpoint()?;
            (dir.join("model.gguf"), Some(dir), true)
        }
    };
    if embedded {
        eprintln!(
            "note: no --model given; running {} ({})",
            tools::DEFAULT_MODEL_NOTE,
            gguf.display()
        );
    }
    let loaded = models::load(&gguf, release_dir.as_deref(), true)?;
    let h = &loaded.model.hparams;
    eprintln!(
        "model: {:?}, {} layers, n_embd {}, vocab {}, {:.1} MiB of weights",
        h.arch,
        h.n_layer,
        h.n_embd,
        h.n_vocab,
        loaded.model.total_weight_bytes() as f64 / 1048576.0
    );

    let prompt: Vec<u32> = match (&args.prompt_tokens, &loaded.tokenizer) {
        (Some(ids), _) => ids.clone(),
        (None, None) => bail!("the checkpoint has no tokenizer; pass --prompt-tokens"),
        (None, Some(tok)) => {
            let text = if args.raw {
                args.prompt.clone()
            } else {
                let tpl = loaded
                    .chat_template
                    .as_ref()
                    .context("the checkpoint has no chat template; pass --raw")?;
                let msgs = [ChatMessage::new("user", args.prompt.clone())];
                tpl.render(&msgs, true, !args.no_thinking, None)?
            };
            tok.encode(&text, true)?
        }
    };

    let config = EngineConfig {
        max_model_len: args.max_model_len,
        prefill_chunk: args.prefill_chunk,
        device,
        cuda_graphs: !args.no_cuda_graphs,
        lowering: args.lowering.options()?,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(loaded.model.clone(), config)
        .with_context(|| format!("starting the engine on {device}"))?;
    tools::upload_with_progress(&mut engine, "run-model")?;
    match engine.device_budget() {
        Some(b) => eprintln!(
            "device: {device} ({}), {:.1} MiB weights + {:.1} MiB cache + {:.1} MiB step arena, cuda graphs {}",
            engine.device_name(),
            b.weights as f64 / 1048576.0,
            b.cache as f64 / 1048576.0,
            b.arena as f64 / 1048576.0,
            if args.no_cuda_graphs { "off" } else { "on" }
        ),
        None => eprintln!("device: cpu"),
    }

    if let Some(path) = &args.dump_logits {
        let logits = engine.forward(&prompt, LogitRows::All)?;
        let vocab = loaded.model.decl.n_vocab();
        let rows: Vec<&[f32]> = logits.chunks(vocab).collect();
        let json = serde_json::json!({ "logits": rows });
        std::fs::write(path, serde_json::to_vec(&json)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!(
            "wrote logits of {} positions to {}",
            rows.len(),
            path.display()
        );
        return Ok(());
    }

    let sampling = if args.greedy {
        SamplingParams::greedy()
    } else {
        SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            min_p: args.min_p,
            repetition_penalty: args.repetition_penalty,
            seed: args.seed,
            logit_bias: Vec::new(),
        }
    };
    sampling.validate().map_err(anyhow::Error::msg)?;
    let stop_tokens: Vec<u32> = loaded
        .tokenizer
        .as_ref()
        .and_then(|t| t.eos_id())
        .into_iter()
        .collect();
    let req = GenerateRequest {
        prompt,
        max_tokens: args.max_tokens,
        sampling,
        stop_tokens,
        stop_strings: Vec::new(),
        want_logits: false,
    };
    // One request through the scheduler, as `serve` and `bench -b` run them.
    let prompt_len = req.prompt.len();
    let tokenizer = loaded.tokenizer.map(Arc::new);
    let printable = tokenizer.is_some();
    let chunk = engine.config().prefill_chunk;
    let mut sched = Scheduler::new(
        engine,
        SchedulerConfig {
            max_num_seqs: 1,
            max_num_batched_tokens: chunk.max(1),
            prefix_caching: false,
            sample_on_host: false,
            ..SchedulerConfig::default()
        },
        tokenizer,
    );
    sched.add(req);
    let mut out = std::io::stdout();
    let t0 = Instant::now();
    let (mut prefill_s, mut first_step_s, mut steady_s, mut steady_steps) = (None, 0.0, 0.0, 0);
    let mut finish = None;
    while sched.has_work() {
        let t = Instant::now();
        let events = sched.step();
        let dt = t.elapsed().as_secs_f64();
        let mut token = false;
        for ev in events {
            match ev {
                SeqEvent::Token { id, text, .. } => {
                    token = true;
                    let _ = if printable {
                        write!(out, "{text}")
                    } else {
                        write!(out, "{id} ")
                    };
                }
                SeqEvent::Finished {
                    finish: f, rest, ..
                } => {
                    let _ = write!(out, "{rest}");
                    finish = Some(f);
                }
                SeqEvent::Failed { error, .. } => bail!("generation failed: {error}"),
            }
        }
        let _ = out.flush();
        // The step that gives the first token ends the prefill; the next one is the first
        // decode step, timed apart from the steady ones (seed §6).
        match prefill_s {
            None if token => prefill_s = Some(t0.elapsed().as_secs_f64()),
            None => {}
            Some(_) if first_step_s == 0.0 => first_step_s = dt,
            Some(_) => {
                steady_s += dt;
                steady_steps += 1;
            }
        }
    }
    println!();
    let prefill_s = prefill_s.unwrap_or(0.0);
    let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
    eprintln!(
        "prefill: {prompt_len} tokens in {prefill_s:.3} s ({:.1} tok/s) | first decode step {:.1} ms | decode: {steady_steps} steps {:.1} tok/s | finish: {}",
        rate(prompt_len, prefill_s),
        first_step_s * 1e3,
        rate(steady_steps, steady_s),
        finish.map_or("error", |f| f.as_str())
    );
    Ok(())
}
