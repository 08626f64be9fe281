//! Generate text with a checkpoint. With no arguments it makes (once, cached) the
//! small synthetic Xing4.0 checkpoint and chats with it.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Parser;
use engine::{Device, Engine, EngineConfig, GenerateRequest, SamplingParams};
use graph::LogitRows;
use loader::chat::ChatMessage;

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Generate text with a Xing4.0 (or deepseek2) GGUF checkpoint"
)]
struct Args {
    /// A .gguf file or a release directory holding one. Default: the embedded small checkpoint.
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
    let (gguf, release_dir, synthetic) = match &args.model {
        Some(m) => {
            let (g, r) = models::resolve(Some(m), args.tokenizer_path.as_deref())?;
            (g, r, false)
        }
        None => {
            let dir = tools::default_checkpoint()?;
            (dir.join("model.gguf"), Some(dir), true)
        }
    };
    if synthetic {
        eprintln!(
            "note: no --model given; using the embedded small Xing4.0-architecture checkpoint at {}.\n      Its weights are RANDOM: the text below is noise, not the released model's answer.",
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
                let msgs = [ChatMessage {
                    role: "user".into(),
                    content: args.prompt.clone(),
                    reasoning_content: None,
                }];
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
    let mut out = std::io::stdout();
    let tok = loaded.tokenizer.as_ref();
    let generation = engine.generate(&req, tok, |ev| {
        if tok.is_some() {
            let _ = write!(out, "{}", ev.text);
        } else {
            let _ = write!(out, "{} ", ev.id);
        }
        let _ = out.flush();
        ControlFlow::Continue(())
    })?;
    println!();
    let s = &generation.stats;
    eprintln!(
        "prefill: {} tokens in {:.3} s ({:.1} tok/s) | first decode step {:.1} ms | decode: {} steps {:.1} tok/s | finish: {}",
        s.prefilled_tokens,
        s.prefill_seconds,
        s.prefill_tok_per_s(),
        s.first_step_seconds * 1e3,
        s.steady_steps,
        s.decode_tok_per_s(),
        generation.finish.as_str()
    );
    Ok(())
}
