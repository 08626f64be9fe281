//! Synthetic checkpoints (`make-model`): a release-style directory with random but deterministic
//! weights — `model.gguf`, `config.json`, `tokenizer.json`, `tokenizer_config.json`,
//! `generation_config.json`.
//!
//! Tensors are generated one at a time, in batches of rows quantized in parallel, and streamed
//! to the writer, so the full-size model needs memory for one batch, not one tensor.

pub mod rng;
pub mod tokenizer;
pub mod trained;
pub mod weights;

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use indicatif::{ProgressBar, ProgressStyle};
use loader::GgmlType;
use loader::gguf::{GgufWriter, Metadata, TensorSpec, Value};
use loader::hparams::{Arch, ExpertGating, HParams, HcParams, YarnParams};
use loader::quant;
use rayon::prelude::*;
use serde_json::{Value as Json, json};

pub use weights::{Init, PlannedTensor, plan};

/// Size presets. `Full` has the released Xing4.0-29B-A4B dimensions (spec §1.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// Unit tests: under 2 MB.
    Tiny,
    /// The embedded default checkpoint: tens of MB.
    Small,
    /// The real dimensions (~20 GB).
    Full,
    /// The trained default model's dimensions (`train/`): ~13 MB, and every width one the GPU
    /// kernels take.
    Trained,
    /// DeepSeek-V2-Lite's shapes (`--arch deepseek2`): no low-rank query, softmax routing
    /// without a selection bias, top-6 of 64 experts of width 1,408 plus 2 shared, one leading
    /// dense block, vocabulary 102,400 (~9 GB).
    Lite,
}

impl Preset {
    pub fn from_name(s: &str) -> Option<Preset> {
        match s {
            "tiny" => Some(Preset::Tiny),
            "small" => Some(Preset::Small),
            "full" => Some(Preset::Full),
            "trained" => Some(Preset::Trained),
            "lite" => Some(Preset::Lite),
            _ => None,
        }
    }
}

/// Every dimension `make-model` can set.
#[derive(Clone, Debug, PartialEq)]
pub struct Dims {
    pub n_embd: usize,
    /// Trunk blocks.
    pub n_layer: usize,
    /// NextN (MTP) blocks appended after the trunk.
    pub n_nextn: usize,
    /// Leading dense blocks.
    pub n_dense: usize,
    pub n_head: usize,
    pub q_lora: usize,
    pub kv_lora: usize,
    pub qk_nope: usize,
    pub qk_rope: usize,
    pub v_head: usize,
    pub n_ff: usize,
    pub n_ff_exp: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub n_expert_shared: usize,
    pub n_vocab: usize,
    pub n_ctx: usize,
    /// Hyper-connection streams (xing4_0 only).
    pub hc: usize,
    pub yarn_factor: f32,
    pub yarn_orig_ctx: usize,
    /// HF `rope_scaling.mscale_all_dim` (the GGUF stores 0.1 × it).
    pub mscale_all_dim: f32,
    pub gating: ExpertGating,
    /// Renormalise the top-k weights.
    pub norm_topk: bool,
    /// `routed_scaling_factor`.
    pub routed_scale: f32,
    /// The routed experts' storage type; `None`: the release's IQ4_NL.
    pub expert_type: Option<GgmlType>,
}

/// The release's routing and YaRN magnitudes, which every preset but `lite` shares.
const XING4_ROUTING: Dims = Dims {
    n_embd: 0,
    n_layer: 0,
    n_nextn: 0,
    n_dense: 0,
    n_head: 0,
    q_lora: 0,
    kv_lora: 0,
    qk_nope: 0,
    qk_rope: 0,
    v_head: 0,
    n_ff: 0,
    n_ff_exp: 0,
    n_expert: 0,
    n_expert_used: 0,
    n_expert_shared: 0,
    n_vocab: 0,
    n_ctx: 0,
    hc: 0,
    yarn_factor: 1.0,
    yarn_orig_ctx: 0,
    mscale_all_dim: 1.0,
    gating: ExpertGating::Sigmoid,
    norm_topk: true,
    routed_scale: 2.0,
    expert_type: None,
};

impl Dims {
    pub fn preset(p: Preset) -> Dims {
        match p {
            Preset::Tiny => Dims {
                n_embd: 256,
                n_layer: 3,
                n_nextn: 1,
                n_dense: 1,
                n_head: 4,
                q_lora: 32,
                kv_lora: 32,
                qk_nope: 16,
                qk_rope: 16,
                v_head: 16,
                n_ff: 128,
                n_ff_exp: 32,
                n_expert: 8,
                n_expert_used: 4,
                n_expert_shared: 1,
                n_vocab: 512,
                n_ctx: 16384,
                hc: 4,
                yarn_factor: 4.0,
                yarn_orig_ctx: 4096,
                ..XING4_ROUTING
            },
            Preset::Small => Dims {
                n_embd: 512,
                n_layer: 6,
                n_nextn: 1,
                n_dense: 2,
                n_head: 8,
                q_lora: 128,
                kv_lora: 128,
                qk_nope: 32,
                qk_rope: 32,
                v_head: 32,
                n_ff: 1536,
                n_ff_exp: 256,
                n_expert: 16,
                n_expert_used: 4,
                n_expert_shared: 1,
                n_vocab: 4096,
                n_ctx: 16384,
                hc: 4,
                yarn_factor: 4.0,
                yarn_orig_ctx: 4096,
                ..XING4_ROUTING
            },
            Preset::Trained => Dims {
                n_embd: 256,
                n_layer: 6,
                n_nextn: 1,
                n_dense: 2,
                n_head: 4,
                q_lora: 64,
                kv_lora: 128,
                qk_nope: 64,
                qk_rope: 64,
                v_head: 64,
                n_ff: 768,
                n_ff_exp: 256,
                n_expert: 8,
                n_expert_used: 4,
                n_expert_shared: 1,
                n_vocab: 4096,
                n_ctx: 16384,
                hc: 4,
                yarn_factor: 4.0,
                yarn_orig_ctx: 4096,
                ..XING4_ROUTING
            },
            Preset::Lite => Dims {
                n_embd: 2048,
                n_layer: 27,
                n_nextn: 0,
                n_dense: 1,
                n_head: 16,
                q_lora: 0,
                kv_lora: 512,
                qk_nope: 128,
                qk_rope: 64,
                v_head: 128,
                n_ff: 10944,
                n_ff_exp: 1408,
                n_expert: 64,
                n_expert_used: 6,
                n_expert_shared: 2,
                n_vocab: 102400,
                n_ctx: 163840,
                hc: 0,
                yarn_factor: 40.0,
                yarn_orig_ctx: 4096,
                mscale_all_dim: 0.707,
                gating: ExpertGating::Softmax,
                norm_topk: false,
                routed_scale: 1.0,
                expert_type: None,
            },
            Preset::Full => Dims {
                n_embd: 3584,
                n_layer: 40,
                n_nextn: 1,
                n_dense: 2,
                n_head: 32,
                q_lora: 768,
                kv_lora: 512,
                qk_nope: 128,
                qk_rope: 64,
                v_head: 128,
                n_ff: 9216,
                n_ff_exp: 1024,
                n_expert: 64,
                n_expert_used: 4,
                n_expert_shared: 1,
                n_vocab: 131072,
                n_ctx: 262144,
                hc: 4,
                yarn_factor: 64.0,
                yarn_orig_ctx: 4096,
                ..XING4_ROUTING
            },
        }
    }

    /// The hyper-parameters these dimensions describe, after checking that every row length
    /// is a whole number of blocks of the type it is stored in.
    pub fn hparams(&self, arch: Arch) -> Result<HParams> {
        let d = self;
        ensure!(d.n_layer > 0, "--n-layer must be at least 1");
        ensure!(
            d.n_dense <= d.n_layer,
            "--n-dense ({}) exceeds --n-layer ({})",
            d.n_dense,
            d.n_layer
        );
        ensure!(
            d.n_expert_used >= 1 && d.n_expert_used <= d.n_expert,
            "--n-expert-used ({}) must be between 1 and --n-expert ({})",
            d.n_expert_used,
            d.n_expert
        );
        ensure!(
            d.qk_rope > 0 && d.qk_rope.is_multiple_of(2),
            "--qk-rope ({}) must be even and positive",
            d.qk_rope
        );
        ensure!(
            d.n_vocab >= tokenizer::MIN_VOCAB,
            "--vocab ({}) must be at least {} (specials, unused, byte and character pieces)",
            d.n_vocab,
            tokenizer::MIN_VOCAB
        );
        if arch == Arch::Xing4_0 {
            ensure!(
                (1..=loader::hparams::MAX_HC_STREAMS).contains(&d.hc),
                "--hc must be 1..={} for xing4_0 (the release has 4, which is all llama.cpp \
                 reads), got {}",
                loader::hparams::MAX_HC_STREAMS,
                d.hc
            );
        }
        // (flag, value, block): rows stored as IQ4_NL need multiples of 32, the Q6_K head 256.
        for (flag, v, block) in [
            ("--n-embd", d.n_embd, 256),
            ("--n-ff", d.n_ff, 32),
            ("--n-ff-exp", d.n_ff_exp, 32),
            ("--n-embd", d.n_embd, 32),
        ] {
            ensure!(
                v > 0 && v.is_multiple_of(block),
                "{flag} ({v}) must be a positive multiple of {block}"
            );
        }
        if let Some(ty) = d.expert_type {
            for (flag, v) in [("--n-embd", d.n_embd), ("--n-ff-exp", d.n_ff_exp)] {
                ensure!(
                    ty.row_bytes(v).is_some(),
                    "{flag} ({v}) is not whole {} blocks (--expert-type)",
                    ty.name()
                );
            }
        }
        for (flag, v) in [
            ("--n-head", d.n_head),
            ("--kv-lora", d.kv_lora),
            ("--qk-nope", d.qk_nope),
            ("--v-head", d.v_head),
            ("--ctx", d.n_ctx),
        ] {
            ensure!(v > 0, "{flag} must be positive");
        }
        Ok(HParams {
            arch,
            n_vocab: d.n_vocab,
            n_embd: d.n_embd,
            n_block: d.n_layer + d.n_nextn,
            n_nextn: d.n_nextn,
            n_layer: d.n_layer,
            n_ctx_train: d.n_ctx,
            n_head: d.n_head,
            n_head_kv: 1,
            q_lora_rank: d.q_lora,
            kv_lora_rank: d.kv_lora,
            qk_nope: d.qk_nope,
            qk_rope: d.qk_rope,
            v_head: d.v_head,
            key_length: d.kv_lora + d.qk_rope,
            value_length: d.kv_lora,
            n_ff: d.n_ff,
            n_ff_exp: d.n_ff_exp,
            n_expert: d.n_expert,
            n_expert_used: d.n_expert_used,
            n_expert_shared: d.n_expert_shared,
            n_dense_lead: d.n_dense,
            expert_weights_scale: d.routed_scale,
            expert_weights_norm: d.norm_topk,
            expert_gating: d.gating,
            rms_eps: 1e-6,
            rope_freq_base: 10000.0,
            rope_dim: d.qk_rope,
            yarn: Some(YarnParams {
                factor: d.yarn_factor,
                orig_ctx: d.yarn_orig_ctx as u32,
                beta_fast: 32.0,
                beta_slow: 1.0,
                log_multiplier: 0.1 * d.mscale_all_dim,
            }),
            hc: (arch == Arch::Xing4_0).then_some(HcParams {
                count: d.hc,
                sinkhorn_iters: 20,
                eps: 1e-6,
            }),
        })
    }
}

/// The comb-logit clamp of `config.json` (spec §1.2).
pub const HC_CLAMP: f64 = 30.0;
/// Rows generated and quantized per parallel batch: bounds memory for the largest tensors.
const BATCH_VALUES: usize = 1 << 24;

pub struct SynthOptions {
    pub arch: Arch,
    pub dims: Dims,
    pub seed: u64,
    pub out: PathBuf,
    /// Replace an existing checkpoint in `out`.
    pub force: bool,
    /// Show a progress bar on stderr.
    pub progress: bool,
}

/// What was written.
#[derive(Debug)]
pub struct Summary {
    pub gguf: PathBuf,
    pub gguf_bytes: u64,
    pub n_tensors: usize,
    pub seconds: f64,
}

pub const FILES: [&str; 5] = [
    "model.gguf",
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
];

/// Writes the checkpoint directory. The GGUF is written under a temporary name and renamed
/// when complete, so an interrupted run never leaves a valid-looking partial file.
pub fn write_checkpoint(opts: &SynthOptions) -> Result<Summary> {
    write(opts, None, None)
}

/// [`write_checkpoint`] with a vocabulary BPE-trained on the text file `corpus` (see
/// [`tokenizer::train_vocab`]) and, where `weights` is given, the trained values of a
/// safetensors file (see [`trained::TrainedWeights`]) in place of random draws.
pub fn write_trained_checkpoint(
    opts: &SynthOptions,
    corpus: &Path,
    weights: Option<&Path>,
) -> Result<Summary> {
    write(opts, Some(corpus), weights)
}

fn write(opts: &SynthOptions, corpus: Option<&Path>, weights: Option<&Path>) -> Result<Summary> {
    let start = Instant::now();
    let h = opts.dims.hparams(opts.arch)?;
    let out = &opts.out;
    if !opts.force {
        for f in FILES {
            let p = out.join(f);
            if p.exists() {
                bail!("{} already exists (pass --force to overwrite)", p.display());
            }
        }
    }
    fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;

    let template = loader::chat::XING4_CHAT_TEMPLATE;
    let vocab = match corpus {
        None => tokenizer::build_vocab(h.n_vocab, opts.seed),
        Some(c) => {
            let text = fs::read_to_string(c)
                .with_context(|| format!("cannot read the corpus {}", c.display()))?;
            tokenizer::train_vocab(h.n_vocab, &text)
                .map_err(|e| anyhow::anyhow!("{}: {e}", c.display()))?
        }
    };
    let mut tensors = plan(&h);
    if let Some(ty) = opts.dims.expert_type {
        for t in tensors
            .iter_mut()
            .filter(|t| t.name.ends_with("_exps.weight"))
        {
            t.ty = ty;
        }
    }
    let trained = match weights {
        None => None,
        Some(w) => {
            let t = trained::TrainedWeights::open(w)?;
            t.check(&tensors)?;
            Some(t)
        }
    };
    let mut meta = Metadata::new();
    h.to_metadata(&mut meta);
    let (name, description) = match &trained {
        None => (
            format!("synthetic-{}-seed{}", h.arch, opts.seed),
            format!(
                "random-weight synthetic checkpoint written by make-model ({})",
                describe(&opts.dims, opts.seed)
            ),
        ),
        Some(_) => (
            format!("trained-{}", h.arch),
            format!(
                "trained weights quantized by make-model ({})",
                describe(&opts.dims, opts.seed)
            ),
        ),
    };
    meta.insert("general.name", Value::String(name));
    meta.insert("general.description", Value::String(description));
    // MOSTLY_IQ4_NL, as the release.
    meta.insert("general.file_type", Value::U32(25));
    meta.insert("general.quantization_version", Value::U32(2));
    vocab.to_metadata(&mut meta, template);

    write_json(&out.join("config.json"), &config_json(&h))?;
    write_json(&out.join("tokenizer.json"), &vocab.to_tokenizer_json())?;
    write_json(
        &out.join("tokenizer_config.json"),
        &vocab.to_tokenizer_config(template, h.n_ctx_train),
    )?;
    write_json(&out.join("generation_config.json"), &generation_config())?;

    let gguf = out.join("model.gguf");
    let partial = out.join("model.gguf.partial");
    let source = match &trained {
        Some(t) => Source::Trained(t),
        None => Source::Random(opts.seed),
    };
    write_gguf(&partial, &meta, &tensors, &source, opts.progress)?;
    fs::rename(&partial, &gguf)
        .with_context(|| format!("cannot rename {} to {}", partial.display(), gguf.display()))?;
    let gguf_bytes = fs::metadata(&gguf)
        .with_context(|| format!("cannot stat {}", gguf.display()))?
        .len();
    Ok(Summary {
        gguf,
        gguf_bytes,
        n_tensors: tensors.len(),
        seconds: start.elapsed().as_secs_f64(),
    })
}

fn describe(d: &Dims, seed: u64) -> String {
    format!(
        "seed {seed}, n_embd {}, layers {} (+{} nextn, {} dense), heads {}, q_lora {}, kv_lora {}, \
         qk_nope {}, qk_rope {}, v_head {}, n_ff {}, n_ff_exp {}, experts {} top-{} + {} shared, \
         vocab {}, ctx {}, hc {}, yarn factor {} orig {}, experts stored as {}",
        d.n_embd,
        d.n_layer,
        d.n_nextn,
        d.n_dense,
        d.n_head,
        d.q_lora,
        d.kv_lora,
        d.qk_nope,
        d.qk_rope,
        d.v_head,
        d.n_ff,
        d.n_ff_exp,
        d.n_expert,
        d.n_expert_used,
        d.n_expert_shared,
        d.n_vocab,
        d.n_ctx,
        d.hc,
        d.yarn_factor,
        d.yarn_orig_ctx,
        d.expert_type.unwrap_or(GgmlType::IQ4_NL).name()
    )
}

fn write_json(path: &Path, v: &Json) -> Result<()> {
    let mut text = serde_json::to_string_pretty(v)?;
    text.push('\n');
    fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}

/// Where a tensor's values come from.
enum Source<'a> {
    Random(u64),
    Trained(&'a trained::TrainedWeights),
}

/// Encodes rows `rows` of `t` into `dst`.
pub fn encode_rows(
    t: &PlannedTensor,
    seed: u64,
    rows: std::ops::Range<usize>,
    dst: &mut Vec<u8>,
) -> Result<(), quant::BlockSizeError> {
    encode(t, &Source::Random(seed), rows, dst)
}

fn encode(
    t: &PlannedTensor,
    source: &Source,
    rows: std::ops::Range<usize>,
    dst: &mut Vec<u8>,
) -> Result<(), quant::BlockSizeError> {
    let mut vals = vec![0f32; rows.len() * t.row_len()];
    match source {
        Source::Random(seed) => t.generate_rows(*seed, rows, &mut vals),
        Source::Trained(w) => w.rows(t, rows, &mut vals),
    }
    quant::quantize(t.ty, &vals, dst)
}

fn write_gguf(
    path: &Path,
    meta: &Metadata,
    tensors: &[PlannedTensor],
    source: &Source,
    progress: bool,
) -> Result<()> {
    let specs = tensors
        .iter()
        .map(|t| TensorSpec::new(t.name.clone(), t.ne.clone(), t.ty))
        .collect();
    let mut w = GgufWriter::create(path, meta, specs)?;
    let total: u64 = tensors.iter().map(|t| t.ne.iter().product::<u64>()).sum();
    let bar = if progress {
        let b = ProgressBar::new(total);
        b.set_style(
            ProgressStyle::with_template(
                "{elapsed_precise} [{bar:40}] {percent}% ({eta} left) {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b
    } else {
        ProgressBar::hidden()
    };
    for t in tensors {
        bar.set_message(t.name.clone());
        let (n, rows) = (t.row_len(), t.n_rows());
        // Rows per task: enough to amortise the task, few enough to balance the threads.
        let per_task = (65536 / n).max(1);
        let per_batch = (BATCH_VALUES / n).max(1);
        let row_bytes = t.ty.row_bytes(n).unwrap_or(0);
        let mut start = 0;
        while start < rows {
            let end = rows.min(start + per_batch);
            let parts: Vec<Vec<u8>> = (start..end)
                .step_by(per_task)
                .collect::<Vec<_>>()
                .into_par_iter()
                .map(|r0| {
                    let r1 = end.min(r0 + per_task);
                    let mut buf = Vec::with_capacity((r1 - r0) * row_bytes);
                    encode(t, source, r0..r1, &mut buf).map(|_| buf)
                })
                .collect::<Result<_, _>>()
                .with_context(|| format!("tensor `{}`", t.name))?;
            for p in &parts {
                w.write_tensor_chunk(&t.name, p)?;
            }
            bar.inc(((end - start) * n) as u64);
            start = end;
        }
    }
    w.finish()?;
    bar.finish_and_clear();
    Ok(())
}

/// The f64 with the f32's shortest decimal form: `1e-6f32` becomes `1e-6`, not `9.99999997e-7`.
fn dec(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

/// `config.json` in the Hugging Face style, matching the header (spec §1.3).
pub fn config_json(h: &HParams) -> Json {
    let (arch_class, model_type) = match h.arch {
        Arch::Xing4_0 => ("Xing4_0ForCausalLM", "xing4_0"),
        Arch::Deepseek2 => ("DeepseekV3ForCausalLM", "deepseek_v3"),
    };
    let yarn = h.yarn.map(|y| {
        // The header's 0.1·mscale_all_dim, back to six significant digits.
        let msad = (dec(y.log_multiplier) * 10.0 * 1e6).round() / 1e6;
        json!({
            "type": "yarn",
            "rope_type": "yarn",
            "factor": dec(y.factor),
            "original_max_position_embeddings": y.orig_ctx,
            "beta_fast": dec(y.beta_fast),
            "beta_slow": dec(y.beta_slow),
            // HF's mscale equals mscale_all_dim in every release (what the runtime assumes).
            "mscale": msad,
            "mscale_all_dim": msad,
        })
    });
    let mut c = json!({
        "architectures": [arch_class],
        "model_type": model_type,
        "vocab_size": h.n_vocab,
        "hidden_size": h.n_embd,
        "intermediate_size": h.n_ff,
        "moe_intermediate_size": h.n_ff_exp,
        "num_hidden_layers": h.n_layer,
        "num_nextn_predict_layers": h.n_nextn,
        "num_attention_heads": h.n_head,
        "num_key_value_heads": h.n_head,
        "n_shared_experts": h.n_expert_shared,
        "n_routed_experts": h.n_expert,
        "num_experts_per_tok": h.n_expert_used,
        "routed_scaling_factor": dec(h.expert_weights_scale),
        "scoring_func": h.expert_gating.name(),
        "topk_method": match h.expert_gating {
            ExpertGating::Sigmoid => "noaux_tc",
            ExpertGating::Softmax => "greedy",
        },
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": h.expert_weights_norm,
        "moe_layer_freq": 1,
        "first_k_dense_replace": h.n_dense_lead,
        // No low-rank query: null, as DeepSeek-V2-Lite's config has it.
        "q_lora_rank": (h.q_lora_rank > 0).then_some(h.q_lora_rank),
        "kv_lora_rank": h.kv_lora_rank,
        "qk_nope_head_dim": h.qk_nope,
        "qk_rope_head_dim": h.qk_rope,
        "v_head_dim": h.v_head,
        "hidden_act": "silu",
        "max_position_embeddings": h.n_ctx_train,
        "rms_norm_eps": dec(h.rms_eps),
        "rope_theta": dec(h.rope_freq_base),
        "rope_scaling": yarn,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "tie_word_embeddings": false,
        "bos_token_id": tokenizer::BOS_ID,
        "eos_token_id": tokenizer::EOS_ID,
        "pad_token_id": tokenizer::PAD_ID,
        "initializer_range": 0.02,
        "use_cache": true,
        "torch_dtype": "bfloat16",
    });
    if let (Some(hc), Some(obj)) = (h.hc, c.as_object_mut()) {
        obj.insert("hc_mult".into(), json!(hc.count));
        obj.insert("hc_sinkhorn_iters".into(), json!(hc.sinkhorn_iters));
        obj.insert("hc_eps".into(), json!(dec(hc.eps)));
        obj.insert("mhc_h_res_clamp_min".into(), json!(-HC_CLAMP));
        obj.insert("mhc_h_res_clamp_max".into(), json!(HC_CLAMP));
    }
    c
}

/// The release's recommended sampling (spec §8).
fn generation_config() -> Json {
    json!({
        "bos_token_id": tokenizer::BOS_ID,
        "eos_token_id": tokenizer::EOS_ID,
        "pad_token_id": tokenizer::PAD_ID,
        "do_sample": true,
        "temperature": 1.0,
        "top_p": 0.95,
        "repetition_penalty": 1.05,
    })
}
