//! Shared plumbing for the command-line tools.

pub mod guidance;

use std::path::PathBuf;

use graph::LoweringOptions;

/// The GPU lowering's switches a user may flip for an A/B run. Each flag's environment
/// variable sets it too, so a script can A/B binaries it does not start itself; the flag wins.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct LoweringArgs {
    /// Run hc_post, hc_pre and the sub-layer norm as separate kernels instead of one
    /// (also `XING4_HC_FUSION=0`).
    #[arg(long)]
    pub no_hc_fusion: bool,
    /// Run the MoE's top-k sum as its own kernel instead of inside the hc boundary after it.
    #[arg(long)]
    pub no_routed_hc_fusion: bool,
    /// Write the step's cache rows in a launch of their own instead of beside the absorbed
    /// query's per-head GEMV.
    #[arg(long)]
    pub no_query_kv_fusion: bool,
    /// Run the shared expert's gate+up and down as launches of their own instead of as more
    /// route tiles of the routed experts' skinny launches.
    #[arg(long)]
    pub no_shared_expert_fusion: bool,
    /// 32-column chunks a warp of the hc boundaries' tensor-core rows pass takes in prefill
    /// chunks, 1..=64; 0 turns the rows pass off (also `XING4_HC_ROWS=N`; default 1).
    #[arg(long, value_name = "N")]
    pub hc_rows: Option<usize>,
    /// The one-token BF16 GEMVs wait for their predecessor before loading their weights
    /// (also `XING4_PDL_WEIGHTS_FIRST=0`).
    #[arg(long)]
    pub no_weights_first: bool,
    /// Most rows a linear layer takes on the GEMV (more: the skinny kernel for IQ4_NL
    /// weights, the tensor cores otherwise), 0..=8 (default 1): for an A/B of batched decode
    /// steps.
    #[arg(long, value_name = "N")]
    pub gemv_max_rows: Option<usize>,
    /// Most tokens MLA's per-head products take on the GEMV, 0..=8 (default 8).
    #[arg(long, value_name = "N")]
    pub head_gemv_max_rows: Option<usize>,
    /// Most routes the routed experts take on the GEMV on integer dot products, with the
    /// shared expert in the same launch (more: the f32 GEMV up to --expert-gemv-max-routes,
    /// then the skinny kernel, then the grouped tensor-core kernel), 0..=32 (default 8).
    #[arg(long, value_name = "N")]
    pub expert_int_gemv_max_routes: Option<usize>,
    /// Most routes the routed experts take on the f32 GEMV past the integer one, 0..=32
    /// (default 0).
    #[arg(long, value_name = "N")]
    pub expert_gemv_max_routes: Option<usize>,
    /// Most rows an IQ4_NL product takes on the skinny kernel (more: the tensor-core tiles;
    /// 0 turns it off; default 64).
    #[arg(long, value_name = "N")]
    pub skinny_max_rows: Option<usize>,
    /// Most rows a product over a weight type no skinny kernel takes (Q6_K, Q8_0, F16, F32:
    /// the lm head) runs on the GEMV (more: the tensor-core tiles; at most 8; default 1).
    #[arg(long, value_name = "N")]
    pub other_gemv_max_rows: Option<usize>,
    /// Most rows a Q6_K product (the lm head) runs on the GEMV, the integer-MMA product where
    /// it takes the width (more: the tensor-core tiles; at most 8; default 8).
    #[arg(long = "q6k-gemv-max-rows", value_name = "N")]
    pub q6k_gemv_max_rows: Option<usize>,
    /// Most rows a BF16 product takes on the skinny BF16 kernel (more: cuBLAS; 0 turns it
    /// off; default 16).
    #[arg(long, value_name = "N")]
    pub bf16_skinny_max_rows: Option<usize>,
    /// Most rows a BF16 product of at most 2,048 outputs (q_a, kv_a) takes on the skinny BF16
    /// kernel, where that is more than --bf16-skinny-max-rows (default 32).
    #[arg(long, value_name = "N")]
    pub bf16_skinny_narrow_max_rows: Option<usize>,
    /// Most routes the routed experts take on the skinny kernel (more: the grouped
    /// tensor-core kernel; 0 turns it off; default 512).
    #[arg(long, value_name = "N")]
    pub expert_skinny_max_routes: Option<usize>,
    /// Routes an expert averages up to which the skinny expert products run on integer MMAs
    /// with 16-bit inputs (0: never, the f16 path throughout; default 5).
    #[arg(long, value_name = "N")]
    pub expert_skinny_int_routes_an_expert: Option<usize>,
    /// Routes an expert averages up to which, past one, the routed gate+up products on the
    /// integer path take its deep ring (three stages at four blocks; 0 = never).
    #[arg(long, value_name = "N")]
    pub expert_int_deep_ring_routes_an_expert: Option<usize>,
    /// Tokens from which hc_pre's partial dots run as the tensor-core rows pass (default 32).
    #[arg(long, value_name = "N")]
    pub hc_rows_min_rows: Option<usize>,
    /// Tokens from which the router's logits are a tiled GEMM (default 512).
    #[arg(long, value_name = "N")]
    pub router_tiled_min_rows: Option<usize>,
    /// Tokens up to which the router's selection and the route plan run as one launch (0:
    /// never; default 8).
    #[arg(long, value_name = "N")]
    pub router_routes_max_rows: Option<usize>,
    /// Tokens from which the top-k sum builds an inverse route table first (default 132).
    #[arg(long, value_name = "N")]
    pub topk_inverse_min_rows: Option<usize>,
    /// Tokens from which a chunk's attention takes the flash kernel (default 256).
    #[arg(long, value_name = "N")]
    pub attention_flash_min_rows: Option<usize>,
    /// Rows of a chunk from which it takes the flash kernel over a context bucket of 2048
    /// positions or more (0: never; default 16).
    #[arg(long, value_name = "N")]
    pub attention_flash_deep_min_rows: Option<usize>,
    /// Decode attention (the split-K kernel) with f32-class products (operands split over
    /// three tensor instructions) instead of f16 operands with f32 sums (also
    /// `XING4_ATTENTION_F32=1`).
    #[arg(long)]
    pub attention_f32: bool,
    /// Keep the latent cache in F32 on the GPU even where attention reads f16 operands (by
    /// default it is stored as F16 there: the same values, half the bytes).
    #[arg(long)]
    pub latent_cache_f32: bool,
    /// Decode attention over the F16 cache on the other split kernel instead of the Hopper
    /// warpgroup one (64-row pages by tensor-memory copies, warpgroup MMAs), which compute
    /// capability 9.0 and the model's attention shape take by default.
    #[arg(long)]
    pub no_attention_wg: bool,
    /// The routed experts' integer GEMV (1–2 tokens) on persistent warps with a weight chunk
    /// a lane (`true`, the default) or on its shared-memory tiles (`false`).
    #[arg(long, value_name = "BOOL")]
    pub expert_int_lanes: Option<bool>,
    /// Routes an expert averages up to which the integer skinny gate+up products (past the
    /// deep ring's steps) copy their first four routes' inputs through the weight ring
    /// (default 1; 0: never).
    #[arg(long, value_name = "N")]
    pub expert_int_staged_gate_up_routes_an_expert: Option<usize>,
    /// The same for the integer skinny down products (default 5; 0: never).
    #[arg(long, value_name = "N")]
    pub expert_int_staged_down_routes_an_expert: Option<usize>,
    /// Routes from which the skinny expert products take the streamed integer kernel on
    /// compute capability 9.0 and later (0: never).
    #[arg(long, value_name = "N")]
    pub expert_int_stream_min_routes: Option<usize>,
    /// The streamed expert kernel moves weight rows by bulk copies, one a row (`true`, the
    /// default), or by a warp's 16-byte copies (`false`).
    #[arg(long, value_name = "BOOL")]
    pub expert_int_stream_bulk: Option<bool>,
}

impl LoweringArgs {
    /// The lowering options these flags (and the environment) give.
    pub fn options(&self) -> anyhow::Result<LoweringOptions> {
        self.options_with(|k| std::env::var(k).ok())
    }

    fn options_with(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> anyhow::Result<LoweringOptions> {
        let off = |k: &str| env(k).is_some_and(|v| v == "0");
        let hc_rows = match (self.hc_rows, env("XING4_HC_ROWS")) {
            (Some(n), _) => n,
            (None, Some(v)) => v.parse().map_err(|_| {
                anyhow::anyhow!(
                    "XING4_HC_ROWS={v:?}: expected a count of 32-column chunks (0..=64)"
                )
            })?,
            (None, None) => LoweringOptions::default().hc_rows_chunks_per_warp,
        };
        let d = LoweringOptions::default();
        let opts = LoweringOptions {
            fuse_hc: !(self.no_hc_fusion || off("XING4_HC_FUSION")),
            fuse_routed_hc: !self.no_routed_hc_fusion,
            fuse_query_kv: !self.no_query_kv_fusion,
            fuse_shared_expert: !self.no_shared_expert_fusion,
            hc_rows_chunks_per_warp: hc_rows,
            pdl_weights_first: !(self.no_weights_first || off("XING4_PDL_WEIGHTS_FIRST")),
            hc_rows_min_rows: self.hc_rows_min_rows.unwrap_or(d.hc_rows_min_rows),
            router_tiled_min_rows: self
                .router_tiled_min_rows
                .unwrap_or(d.router_tiled_min_rows),
            topk_inverse_min_rows: self
                .topk_inverse_min_rows
                .unwrap_or(d.topk_inverse_min_rows),
            router_routes_max_rows: self
                .router_routes_max_rows
                .unwrap_or(d.router_routes_max_rows),
            f16_latent_cache: !self.latent_cache_f32,
            attention_wg: !self.no_attention_wg,
            expert_int_lanes: self.expert_int_lanes.unwrap_or(d.expert_int_lanes),
            expert_int_staged_gate_up_routes_an_expert: self
                .expert_int_staged_gate_up_routes_an_expert
                .unwrap_or(d.expert_int_staged_gate_up_routes_an_expert),
            expert_int_staged_down_routes_an_expert: self
                .expert_int_staged_down_routes_an_expert
                .unwrap_or(d.expert_int_staged_down_routes_an_expert),
            expert_int_stream_min_routes: self
                .expert_int_stream_min_routes
                .unwrap_or(d.expert_int_stream_min_routes),
            expert_int_stream_bulk: self
                .expert_int_stream_bulk
                .unwrap_or(d.expert_int_stream_bulk),
            attention_f16_split: !(self.attention_f32
                || env("XING4_ATTENTION_F32").is_some_and(|v| v == "1")),
            attention_flash_min_rows: self
                .attention_flash_min_rows
                .unwrap_or(d.attention_flash_min_rows),
            attention_flash_deep_min_rows: self
                .attention_flash_deep_min_rows
                .unwrap_or(d.attention_flash_deep_min_rows),
            gemv_max_rows: self.gemv_max_rows.unwrap_or(d.gemv_max_rows),
            head_gemv_max_rows: self.head_gemv_max_rows.unwrap_or(d.head_gemv_max_rows),
            expert_int_gemv_max_routes: self
                .expert_int_gemv_max_routes
                .unwrap_or(d.expert_int_gemv_max_routes),
            expert_gemv_max_routes: self
                .expert_gemv_max_routes
                .unwrap_or(d.expert_gemv_max_routes),
            skinny_max_rows: self.skinny_max_rows.unwrap_or(d.skinny_max_rows),
            bf16_skinny_max_rows: self.bf16_skinny_max_rows.unwrap_or(d.bf16_skinny_max_rows),
            bf16_skinny_narrow_max_rows: self
                .bf16_skinny_narrow_max_rows
                .unwrap_or(d.bf16_skinny_narrow_max_rows),
            other_gemv_max_rows: self.other_gemv_max_rows.unwrap_or(d.other_gemv_max_rows),
            q6k_gemv_max_rows: self.q6k_gemv_max_rows.unwrap_or(d.q6k_gemv_max_rows),
            expert_skinny_max_routes: self
                .expert_skinny_max_routes
                .unwrap_or(d.expert_skinny_max_routes),
            expert_skinny_int_routes_an_expert: self
                .expert_skinny_int_routes_an_expert
                .unwrap_or(d.expert_skinny_int_routes_an_expert),
            expert_int_deep_ring_routes_an_expert: self
                .expert_int_deep_ring_routes_an_expert
                .unwrap_or(d.expert_int_deep_ring_routes_an_expert),
            ..d
        };
        opts.validate().map_err(|e| {
            anyhow::anyhow!(
                "--hc-rows / XING4_HC_ROWS / --gemv-max-rows / --other-gemv-max-rows / --q6k-gemv-max-rows / --head-gemv-max-rows / --expert-int-gemv-max-routes / --expert-gemv-max-routes: {e}"
            )
        })?;
        Ok(opts)
    }
}

/// Where generated checkpoints and compiled kernels are cached:
/// `$XING4_CACHE_DIR`, else `$XDG_CACHE_HOME/xing4-rt`, else `~/.cache/xing4-rt`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("XING4_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("xing4-rt");
    }
    match std::env::var_os("HOME") {
        Some(h) => PathBuf::from(h).join(".cache/xing4-rt"),
        None => std::env::temp_dir().join("xing4-rt"),
    }
}

/// The embedded default model (`tools/default-model`, made by `scripts/gpu-train`): the
/// `trained` preset of the Xing4.0 architecture, trained on public-domain English (Jane
/// Austen's novels and the King James Bible). It writes readable text and knows nothing else.
const DEFAULT_MODEL: [(&str, &[u8]); 5] = [
    ("model.gguf", include_bytes!("../default-model/model.gguf")),
    (
        "config.json",
        include_bytes!("../default-model/config.json"),
    ),
    (
        "tokenizer.json",
        include_bytes!("../default-model/tokenizer.json"),
    ),
    (
        "tokenizer_config.json",
        include_bytes!("../default-model/tokenizer_config.json"),
    ),
    (
        "generation_config.json",
        include_bytes!("../default-model/generation_config.json"),
    ),
];

/// What `run-model` and `serve` print when they run the embedded default.
pub const DEFAULT_MODEL_NOTE: &str = "the embedded default model, 16M parameters of the \
Xing4.0 architecture trained on Jane Austen's novels and the King James Bible: it writes \
English of that kind and knows nothing else (pass --model for the released checkpoint)";

/// The embedded default model's directory: written once under the cache directory (and
/// rewritten where a file there differs from the embedded one), each file through a temporary
/// name, so a concurrent or interrupted start never leaves a partial file.
pub fn default_checkpoint() -> anyhow::Result<PathBuf> {
    use anyhow::Context;
    let dir = cache_dir().join("models/xing4_0-default");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    for (name, bytes) in DEFAULT_MODEL {
        let path = dir.join(name);
        if std::fs::read(&path).is_ok_and(|b| b == bytes) {
            continue;
        }
        let tmp = dir.join(format!("{name}.{}.partial", std::process::id()));
        std::fs::write(&tmp, bytes).with_context(|| format!("cannot write {}", tmp.display()))?;
        std::fs::rename(&tmp, &path)
            .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))?;
    }
    Ok(dir)
}

/// Uploads `engine`'s weights to its GPU now, with a progress bar (bytes and rate) on a
/// terminal, and prints the cache pool's size when done. Nothing to upload on the CPU.
pub fn upload_with_progress(engine: &mut engine::Engine, tool: &str) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    if engine.on_gpu() {
        let bar = indicatif::ProgressBar::new(0);
        if std::io::stderr().is_terminal() {
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{prefix} weights to the GPU [{bar:32}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}",
                )
                .map_err(|e| anyhow::anyhow!("progress template: {e}"))?
                .progress_chars("=> "),
            );
            bar.set_prefix(tool.to_string());
        } else {
            bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
        }
        let t0 = std::time::Instant::now();
        let mut last = 0;
        engine.upload_weights(&mut |done, total| {
            bar.set_length(total);
            bar.set_position(done);
            last = done;
        })?;
        bar.finish_and_clear();
        let s = t0.elapsed().as_secs_f64();
        eprintln!(
            "{tool}: uploaded {:.2} GiB of weights in {s:.1} s ({:.2} GiB/s)",
            last as f64 / (1u64 << 30) as f64,
            last as f64 / (1u64 << 30) as f64 / s.max(1e-9)
        );
    }
    let pool = engine.pool();
    eprintln!(
        "{tool}: KV cache: {} blocks = {} positions ({} sequences of --max-model-len {} at once)",
        pool.blocks,
        pool.rows(),
        pool.rows() / engine.config().max_model_len.max(1),
        engine.config().max_model_len
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lowering_flags_win_over_the_environment_and_bad_values_name_the_variable() {
        let env = |k: &str| match k {
            "XING4_HC_FUSION" => Some("0".to_string()),
            "XING4_HC_ROWS" => Some("3".to_string()),
            _ => None,
        };
        let o = LoweringArgs::default().options_with(env).unwrap();
        assert!(!o.fuse_hc && o.pdl_weights_first);
        assert_eq!(o.hc_rows_chunks_per_warp, 3);
        let flags = LoweringArgs {
            hc_rows: Some(0),
            no_weights_first: true,
            ..LoweringArgs::default()
        };
        let o = flags.options_with(env).unwrap();
        assert_eq!(o.hc_rows_chunks_per_warp, 0);
        assert!(!o.pdl_weights_first);
        let none = LoweringArgs::default().options_with(|_| None).unwrap();
        assert_eq!(none, LoweringOptions::default());
        assert!(none.attention_f16_split);
        let f32_env = |k: &str| (k == "XING4_ATTENTION_F32").then(|| "1".to_string());
        assert!(
            !LoweringArgs::default()
                .options_with(f32_env)
                .unwrap()
                .attention_f16_split
        );
        let f32_flag = LoweringArgs {
            attention_f32: true,
            ..LoweringArgs::default()
        };
        assert!(!f32_flag.options_with(|_| None).unwrap().attention_f16_split);
        let bad = |k: &str| (k == "XING4_HC_ROWS").then(|| "many".to_string());
        let err = LoweringArgs::default().options_with(bad).unwrap_err();
        assert!(err.to_string().contains("XING4_HC_ROWS=\"many\""), "{err}");
        let too_many = LoweringArgs {
            hc_rows: Some(65),
            ..LoweringArgs::default()
        };
        assert!(too_many.options_with(|_| None).is_err());
    }
}
