//! Writes a checkpoint directory in the release layout: random, deterministic weights, or
//! (`--weights`) trained ones quantized to the release's types.

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Parser;
use loader::GgmlType;
use loader::hparams::{Arch, ExpertGating};
use models::synth::{Dims, Preset, SynthOptions, write_checkpoint, write_trained_checkpoint};

#[derive(Parser, Debug)]
#[command(about = "Write a synthetic xing4_0/deepseek2 checkpoint (model.gguf + release files)")]
struct Args {
    /// Architecture: xing4_0 or deepseek2.
    #[arg(long, default_value = "xing4_0")]
    arch: String,
    /// Dimension preset: tiny (<2 MB), small (tens of MB), full (the released dims, ~20 GB),
    /// trained (the trained default model's dims, ~13 MB), lite (DeepSeek-V2-Lite's shapes and
    /// routing, with --arch deepseek2; ~9 GB).
    #[arg(long, default_value = "tiny")]
    preset: String,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Overwrite an existing checkpoint in --out.
    #[arg(long)]
    force: bool,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Train the vocabulary (BPE) on this text file instead of the built-in word list.
    #[arg(long)]
    corpus: Option<PathBuf>,
    /// Trained weights: a safetensors file of F32 tensors named as in the GGUF, in PyTorch
    /// shape (needs --corpus, the vocabulary they were trained with).
    #[arg(long, requires = "corpus")]
    weights: Option<PathBuf>,

    #[arg(long)]
    n_embd: Option<usize>,
    /// Trunk blocks (NextN blocks come on top: --nextn).
    #[arg(long)]
    n_layer: Option<usize>,
    #[arg(long)]
    nextn: Option<usize>,
    /// Leading dense blocks.
    #[arg(long)]
    n_dense: Option<usize>,
    #[arg(long)]
    n_head: Option<usize>,
    #[arg(long)]
    q_lora: Option<usize>,
    #[arg(long)]
    kv_lora: Option<usize>,
    #[arg(long)]
    qk_nope: Option<usize>,
    #[arg(long)]
    qk_rope: Option<usize>,
    #[arg(long)]
    v_head: Option<usize>,
    #[arg(long)]
    n_ff: Option<usize>,
    #[arg(long)]
    n_ff_exp: Option<usize>,
    #[arg(long)]
    n_expert: Option<usize>,
    #[arg(long)]
    n_expert_used: Option<usize>,
    #[arg(long)]
    n_expert_shared: Option<usize>,
    #[arg(long)]
    vocab: Option<usize>,
    #[arg(long)]
    ctx: Option<usize>,
    /// Hyper-connection streams (xing4_0; 1..=8, the release has 4, which is all llama.cpp reads).
    #[arg(long)]
    hc: Option<usize>,
    #[arg(long)]
    yarn_factor: Option<f32>,
    #[arg(long)]
    yarn_orig_ctx: Option<usize>,
    /// HF `rope_scaling.mscale_all_dim` (the header stores 0.1 × it).
    #[arg(long)]
    mscale_all_dim: Option<f32>,
    /// Router scores: sigmoid (with a selection bias, as the release) or softmax (DeepSeek-V2).
    #[arg(long)]
    gating: Option<String>,
    /// Renormalise the top-k routing weights: true or false.
    #[arg(long)]
    norm_topk: Option<bool>,
    /// routed_scaling_factor.
    #[arg(long)]
    routed_scale: Option<f32>,
    /// The routed experts' storage type (IQ4_NL, the release's; Q8_0, Q6_K, BF16, F16, F32).
    #[arg(long)]
    expert_type: Option<String>,
}

fn main() -> Result<()> {
    let a = Args::parse();
    let Some(arch) = Arch::from_name(&a.arch) else {
        bail!("--arch {:?}: expected xing4_0 or deepseek2", a.arch);
    };
    let Some(preset) = Preset::from_name(&a.preset) else {
        bail!(
            "--preset {:?}: expected tiny, small, full, trained or lite",
            a.preset
        );
    };
    let mut d = Dims::preset(preset);
    if arch == Arch::Deepseek2 {
        d.hc = 0;
    }
    let set = |field: &mut usize, v: Option<usize>| {
        if let Some(v) = v {
            *field = v;
        }
    };
    set(&mut d.n_embd, a.n_embd);
    set(&mut d.n_layer, a.n_layer);
    set(&mut d.n_nextn, a.nextn);
    set(&mut d.n_dense, a.n_dense);
    set(&mut d.n_head, a.n_head);
    set(&mut d.q_lora, a.q_lora);
    set(&mut d.kv_lora, a.kv_lora);
    set(&mut d.qk_nope, a.qk_nope);
    set(&mut d.qk_rope, a.qk_rope);
    set(&mut d.v_head, a.v_head);
    set(&mut d.n_ff, a.n_ff);
    set(&mut d.n_ff_exp, a.n_ff_exp);
    set(&mut d.n_expert, a.n_expert);
    set(&mut d.n_expert_used, a.n_expert_used);
    set(&mut d.n_expert_shared, a.n_expert_shared);
    set(&mut d.n_vocab, a.vocab);
    set(&mut d.n_ctx, a.ctx);
    set(&mut d.hc, a.hc);
    set(&mut d.yarn_orig_ctx, a.yarn_orig_ctx);
    if let Some(f) = a.yarn_factor {
        d.yarn_factor = f;
    }
    if let Some(m) = a.mscale_all_dim {
        d.mscale_all_dim = m;
    }
    if let Some(g) = &a.gating {
        d.gating = match g.as_str() {
            "sigmoid" => ExpertGating::Sigmoid,
            "softmax" => ExpertGating::Softmax,
            _ => bail!("--gating {g:?}: expected sigmoid or softmax"),
        };
    }
    if let Some(n) = a.norm_topk {
        d.norm_topk = n;
    }
    if let Some(s) = a.routed_scale {
        d.routed_scale = s;
    }
    if let Some(t) = &a.expert_type {
        let Some(ty) = GgmlType::ALL
            .into_iter()
            .find(|g| g.name().eq_ignore_ascii_case(t))
        else {
            let names: Vec<&str> = GgmlType::ALL.iter().map(|g| g.name()).collect();
            bail!("--expert-type {t:?}: expected one of {}", names.join(", "));
        };
        d.expert_type = Some(ty);
    }
    let opts = SynthOptions {
        arch,
        dims: d,
        seed: a.seed,
        out: a.out.clone(),
        force: a.force,
        progress: !a.quiet,
    };
    let s = match &a.corpus {
        Some(c) => write_trained_checkpoint(&opts, c, a.weights.as_deref())?,
        None => write_checkpoint(&opts)?,
    };
    eprintln!(
        "wrote {} ({} tensors, {} bytes) and the release files in {:.1} s",
        s.gguf.display(),
        s.n_tensors,
        s.gguf_bytes,
        s.seconds
    );
    Ok(())
}
