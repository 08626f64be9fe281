//! The release directory beside a GGUF: `config.json` (and its cross-check against the GGUF
//! header, MODEL.md §1.3), `generation_config.json`, `tokenizer.json`, the chat template, and
//! resolution of the two paths a launch names (the `.gguf`, and the directory with everything else).

use std::fmt;
use std::fs;
use std::io::{BufReader, Read, Seek};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::gguf::{Metadata, MetadataError, Value};

/// llama.cpp hard-codes the comb-logit clamp; no GGUF key carries it (MODEL.md §1.2).
pub const DEFAULT_HC_CLAMP: f64 = 30.0;

#[derive(Debug, thiserror::Error)]
pub enum ReleaseError {
    #[error("release directory {path} is not a directory")]
    NotADirectory { path: PathBuf },
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not valid: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// A token id or a list of them (`eos_token_id` is either in HF configs).
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    pub fn ids(&self) -> &[u32] {
        match self {
            TokenIds::One(id) => std::slice::from_ref(id),
            TokenIds::Many(ids) => ids,
        }
    }

    pub fn contains(&self, id: u32) -> bool {
        self.ids().contains(&id)
    }
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub struct RopeScaling {
    pub r#type: Option<String>,
    /// Newer HF configs spell `type` this way; some carry both.
    pub rope_type: Option<String>,
    pub factor: Option<f64>,
    pub original_max_position_embeddings: Option<u64>,
    pub beta_fast: Option<f64>,
    pub beta_slow: Option<f64>,
    pub mscale: Option<f64>,
    pub mscale_all_dim: Option<f64>,
}

impl RopeScaling {
    pub fn kind(&self) -> Option<&str> {
        self.r#type.as_deref().or(self.rope_type.as_deref())
    }
}

/// `config.json` of an HF DeepSeek-V2/V3-style release (MODEL.md §1.2, §1.3). Unknown keys are ignored.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct ReleaseConfig {
    pub model_type: Option<String>,
    pub hidden_size: u64,
    pub num_hidden_layers: u64,
    #[serde(default)]
    pub num_nextn_predict_layers: u64,
    pub num_attention_heads: u64,
    pub q_lora_rank: Option<u64>,
    pub kv_lora_rank: u64,
    pub qk_nope_head_dim: u64,
    pub qk_rope_head_dim: u64,
    pub v_head_dim: u64,
    pub rms_norm_eps: f64,
    pub n_routed_experts: Option<u64>,
    pub num_experts_per_tok: Option<u64>,
    pub n_shared_experts: Option<u64>,
    pub moe_intermediate_size: Option<u64>,
    pub intermediate_size: u64,
    pub first_k_dense_replace: Option<u64>,
    pub routed_scaling_factor: Option<f64>,
    pub norm_topk_prob: Option<bool>,
    pub n_group: Option<u64>,
    pub topk_group: Option<u64>,
    pub scoring_func: Option<String>,
    pub hc_mult: Option<u64>,
    pub hc_sinkhorn_iters: Option<u64>,
    pub hc_eps: Option<f64>,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: u64,
    pub vocab_size: u64,
    pub mhc_h_res_clamp_min: Option<f64>,
    pub mhc_h_res_clamp_max: Option<f64>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<TokenIds>,
}

/// Bounds of the hyper-connection comb-logit clamp.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HcClamp {
    pub min: f64,
    pub max: f64,
    /// At least one bound was not in `config.json` (or there was no `config.json`) and the
    /// llama.cpp default ±30 was used; callers should log this.
    pub defaulted: bool,
}

impl HcClamp {
    pub const DEFAULT: HcClamp = HcClamp {
        min: -DEFAULT_HC_CLAMP,
        max: DEFAULT_HC_CLAMP,
        defaulted: true,
    };
}

impl ReleaseConfig {
    pub fn from_file(path: &Path) -> Result<ReleaseConfig, ReleaseError> {
        let text = read(path)?;
        let cfg: ReleaseConfig =
            serde_json::from_str(&text).map_err(|source| ReleaseError::Json {
                path: path.to_path_buf(),
                source,
            })?;
        let clamp = cfg.hc_clamp();
        if clamp.min.partial_cmp(&clamp.max) != Some(std::cmp::Ordering::Less) {
            return Err(ReleaseError::Invalid {
                path: path.to_path_buf(),
                message: format!(
                    "mhc_h_res_clamp_min ({}) must be below mhc_h_res_clamp_max ({})",
                    clamp.min, clamp.max
                ),
            });
        }
        Ok(cfg)
    }

    pub fn hc_clamp(&self) -> HcClamp {
        HcClamp {
            min: self.mhc_h_res_clamp_min.unwrap_or(-DEFAULT_HC_CLAMP),
            max: self.mhc_h_res_clamp_max.unwrap_or(DEFAULT_HC_CLAMP),
            defaulted: self.mhc_h_res_clamp_min.is_none() || self.mhc_h_res_clamp_max.is_none(),
        }
    }
}

/// `generation_config.json`: the release's recommended sampling; every field optional.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub struct GenerationConfig {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub repetition_penalty: Option<f64>,
    pub eos_token_id: Option<TokenIds>,
    pub bos_token_id: Option<u32>,
}

fn read(path: &Path) -> Result<String, ReleaseError> {
    fs::read_to_string(path).map_err(|source| ReleaseError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ReleaseError> {
    serde_json::from_str(&read(path)?).map_err(|source| ReleaseError::Json {
        path: path.to_path_buf(),
        source,
    })
}

// ---------------------------------------------------------------------------------------------
// Cross-check

#[derive(Clone, Debug, PartialEq)]
pub enum Mismatch {
    /// A GGUF key and the `config.json` key it must agree with.
    Differ {
        gguf_key: String,
        config_key: String,
        gguf_value: String,
        config_value: String,
    },
    /// A value the runtime's math assumes (e.g. `rope_scaling.mscale == mscale_all_dim`).
    Requirement {
        key: String,
        value: String,
        required: String,
    },
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mismatch::Differ {
                gguf_key,
                config_key,
                gguf_value,
                config_value,
            } => write!(
                f,
                "GGUF `{gguf_key}` = {gguf_value} but config.json `{config_key}` = {config_value}"
            ),
            Mismatch::Requirement {
                key,
                value,
                required,
            } => write!(f, "`{key}` = {value} but the runtime requires {required}"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CrossCheckError {
    #[error(transparent)]
    Metadata(#[from] MetadataError),
    #[error("architecture {0:?} has no config.json cross-check (supported: xing4_0, deepseek2)")]
    Architecture(String),
    #[error("GGUF header and config.json disagree ({} problems):\n{}", .0.len(), list(.0))]
    Mismatches(Vec<Mismatch>),
}

fn list(ms: &[Mismatch]) -> String {
    ms.iter()
        .map(|m| format!("  - {m}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Whether a pair may be absent on both sides.
#[derive(Clone, Copy, PartialEq)]
enum Need {
    Both,
    Optional,
}

struct Checker<'m> {
    meta: &'m Metadata,
    prefix: String,
    found: Vec<Mismatch>,
}

const ABSENT: &str = "absent";

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * a.abs().max(b.abs())
}

impl Checker<'_> {
    fn key(&self, suffix: &str) -> String {
        format!("{}{suffix}", self.prefix)
    }

    fn differ(&mut self, gguf_key: String, config_key: &str, g: String, c: String) {
        self.found.push(Mismatch::Differ {
            gguf_key,
            config_key: config_key.to_string(),
            gguf_value: g,
            config_value: c,
        });
    }

    /// Shared shape of every comparison: `same` decides agreement of two present values.
    fn pair<C: fmt::Display>(
        &mut self,
        gguf_key: String,
        config_key: &str,
        config: Option<C>,
        need: Need,
        same: impl Fn(&Value, &C) -> bool,
    ) {
        let g = self.meta.get(&gguf_key);
        match (g, config) {
            (Some(g), Some(c)) if !same(g, &c) => {
                self.differ(gguf_key, config_key, g.describe(), c.to_string())
            }
            (Some(_), Some(_)) => {}
            (None, None) if need == Need::Optional => {}
            (g, c) => {
                let g = g.map_or(ABSENT.to_string(), Value::describe);
                let c = c.map_or(ABSENT.to_string(), |c| c.to_string());
                self.differ(gguf_key, config_key, g, c)
            }
        }
    }

    fn int(&mut self, suffix: &str, config_key: &str, c: Option<u64>, need: Need) {
        let key = self.key(suffix);
        self.pair(key, config_key, c, need, |g, c| g.as_u64() == Some(*c));
    }

    fn float(&mut self, suffix: &str, config_key: &str, c: Option<f64>, need: Need) {
        let key = self.key(suffix);
        self.pair(key, config_key, c, need, |g, c| {
            g.as_f64().is_some_and(|g| close(g, *c))
        });
    }

    fn boolean(&mut self, suffix: &str, config_key: &str, c: Option<bool>, need: Need) {
        let key = self.key(suffix);
        self.pair(key, config_key, c, need, |g, c| *g == Value::Bool(*c));
    }

    fn string(&mut self, suffix: &str, config_key: &str, c: Option<&str>, need: Need) {
        let key = self.key(suffix);
        let c = c.map(|s| format!("{s:?}"));
        self.pair(
            key,
            config_key,
            c,
            need,
            |g, c| matches!(g, Value::String(s) if format!("{s:?}") == *c),
        );
    }

    fn require(&mut self, key: String, value: Option<String>, ok: bool, required: &str) {
        if !ok {
            self.found.push(Mismatch::Requirement {
                key,
                value: value.unwrap_or_else(|| ABSENT.to_string()),
                required: required.to_string(),
            });
        }
    }
}

/// MODEL.md §1.3: every GGUF hyper-parameter that `config.json` also states must agree (integers
/// exactly, floats to 1e-6 relative); all disagreements are reported together.
pub fn cross_check(meta: &Metadata, cfg: &ReleaseConfig) -> Result<(), CrossCheckError> {
    let arch = meta.get_str("general.architecture")?;
    let is_xing = match arch {
        "xing4_0" => true,
        "deepseek2" => false,
        other => return Err(CrossCheckError::Architecture(other.to_string())),
    };
    let mut c = Checker {
        meta,
        prefix: format!("{arch}."),
        found: Vec::new(),
    };
    use Need::{Both, Optional};

    if let Some(mt) = cfg.model_type.as_deref() {
        let ok = if is_xing {
            mt == "xing4_0"
        } else {
            matches!(mt, "deepseek_v2" | "deepseek_v3")
        };
        if !ok {
            c.differ(
                "general.architecture".into(),
                "model_type",
                format!("{arch:?}"),
                format!("{mt:?}"),
            );
        }
    }

    c.int(
        "embedding_length",
        "hidden_size",
        Some(cfg.hidden_size),
        Both,
    );
    c.int(
        "block_count",
        "num_hidden_layers+num_nextn_predict_layers",
        Some(cfg.num_hidden_layers + cfg.num_nextn_predict_layers),
        Both,
    );
    // The converter writes no `nextn_predict_layers` when there is no MTP block.
    if meta.contains(&c.key("nextn_predict_layers")) || cfg.num_nextn_predict_layers != 0 {
        c.int(
            "nextn_predict_layers",
            "num_nextn_predict_layers",
            Some(cfg.num_nextn_predict_layers),
            Both,
        );
    }
    c.int(
        "attention.head_count",
        "num_attention_heads",
        Some(cfg.num_attention_heads),
        Both,
    );
    c.int(
        "attention.q_lora_rank",
        "q_lora_rank",
        cfg.q_lora_rank,
        Optional,
    );
    c.int(
        "attention.kv_lora_rank",
        "kv_lora_rank",
        Some(cfg.kv_lora_rank),
        Both,
    );
    c.int(
        "attention.key_length_mla",
        "qk_nope_head_dim+qk_rope_head_dim",
        Some(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim),
        Both,
    );
    c.int(
        "attention.value_length_mla",
        "v_head_dim",
        Some(cfg.v_head_dim),
        Both,
    );
    c.float(
        "attention.layer_norm_rms_epsilon",
        "rms_norm_eps",
        Some(cfg.rms_norm_eps),
        Both,
    );
    c.int(
        "expert_count",
        "n_routed_experts",
        cfg.n_routed_experts,
        Both,
    );
    c.int(
        "expert_used_count",
        "num_experts_per_tok",
        cfg.num_experts_per_tok,
        Both,
    );
    c.int(
        "expert_shared_count",
        "n_shared_experts",
        cfg.n_shared_experts,
        Both,
    );
    c.int(
        "expert_feed_forward_length",
        "moe_intermediate_size",
        cfg.moe_intermediate_size,
        Both,
    );
    c.int(
        "feed_forward_length",
        "intermediate_size",
        Some(cfg.intermediate_size),
        Both,
    );
    c.int(
        "leading_dense_block_count",
        "first_k_dense_replace",
        cfg.first_k_dense_replace,
        Both,
    );
    c.float(
        "expert_weights_scale",
        "routed_scaling_factor",
        cfg.routed_scaling_factor,
        Both,
    );
    c.boolean(
        "expert_weights_norm",
        "norm_topk_prob",
        cfg.norm_topk_prob,
        Both,
    );
    c.int("expert_group_count", "n_group", cfg.n_group, Optional);
    c.int(
        "expert_group_used_count",
        "topk_group",
        cfg.topk_group,
        Optional,
    );
    c.float("rope.freq_base", "rope_theta", Some(cfg.rope_theta), Both);
    c.int(
        "rope.dimension_count",
        "qk_rope_head_dim",
        Some(cfg.qk_rope_head_dim),
        Both,
    );
    c.int(
        "context_length",
        "max_position_embeddings",
        Some(cfg.max_position_embeddings),
        Both,
    );

    // llama.cpp takes the vocabulary size from the token list when the key is absent.
    let vocab_key = c.key("vocab_size");
    if meta.contains(&vocab_key) {
        c.int("vocab_size", "vocab_size", Some(cfg.vocab_size), Both);
    } else {
        let n = meta
            .get_array("tokenizer.ggml.tokens")
            .ok()
            .map(|(_, t)| t.len() as u64);
        if n != Some(cfg.vocab_size) {
            c.differ(
                format!("{vocab_key} (or the length of tokenizer.ggml.tokens)"),
                "vocab_size",
                n.map_or(ABSENT.to_string(), |n| n.to_string()),
                cfg.vocab_size.to_string(),
            );
        }
    }

    // 2 = sigmoid, 1 = softmax; llama.cpp silently uses softmax when the key is absent.
    let gating_key = c.key("expert_gating_func");
    let gating = meta.get(&gating_key);
    let gating_func = gating.and_then(Value::as_u64).map(|g| match g {
        1 => "softmax",
        2 => "sigmoid",
        _ => "?",
    });
    match (gating_func, cfg.scoring_func.as_deref()) {
        (Some(g), Some(s)) if g == s => {}
        (g, s) => c.differ(
            gating_key,
            "scoring_func",
            gating.map_or(ABSENT.to_string(), |v| {
                format!("{} ({})", v.describe(), g.unwrap_or("?"))
            }),
            s.map_or(ABSENT.to_string(), |s| format!("{s:?}")),
        ),
    }

    let rs = cfg.rope_scaling.clone().unwrap_or_default();
    c.string(
        "rope.scaling.type",
        "rope_scaling.type",
        rs.kind(),
        Optional,
    );
    c.float(
        "rope.scaling.factor",
        "rope_scaling.factor",
        rs.factor,
        Optional,
    );
    c.int(
        "rope.scaling.original_context_length",
        "rope_scaling.original_max_position_embeddings",
        rs.original_max_position_embeddings,
        Optional,
    );
    c.float(
        "rope.scaling.yarn_beta_fast",
        "rope_scaling.beta_fast",
        rs.beta_fast,
        Optional,
    );
    c.float(
        "rope.scaling.yarn_beta_slow",
        "rope_scaling.beta_slow",
        rs.beta_slow,
        Optional,
    );
    // The converter stores 0.1·mscale_all_dim; either side absent means 0 (llama.cpp and HF defaults).
    let ylm_key = c.key("rope.scaling.yarn_log_multiplier");
    let ylm = meta.get(&ylm_key);
    let g = ylm.and_then(Value::as_f64).unwrap_or(0.0);
    let want = 0.1 * rs.mscale_all_dim.unwrap_or(0.0);
    if (ylm.is_some() && ylm.and_then(Value::as_f64).is_none()) || !close(g, want) {
        c.differ(
            ylm_key,
            "0.1*rope_scaling.mscale_all_dim",
            ylm.map_or(ABSENT.to_string(), Value::describe),
            want.to_string(),
        );
    }
    // The header cannot carry HF's mscale; the runtime takes it equal to mscale_all_dim (1.0
    // where that is absent), as every DeepSeek-V2/V3 and Xing4.0 config has it.
    let msad = rs.mscale_all_dim.filter(|&m| m != 0.0).unwrap_or(1.0);
    if let Some(m) = rs.mscale.filter(|&m| !close(m, msad)) {
        c.require(
            "config.json rope_scaling.mscale".into(),
            Some(m.to_string()),
            false,
            &format!(
                "{msad} (rope_scaling.mscale_all_dim: the YaRN magnitudes assume they are equal)"
            ),
        );
    }

    let kv_key = c.key("attention.head_count_kv");
    let kv = meta.get(&kv_key);
    c.require(
        kv_key,
        kv.map(Value::describe),
        kv.and_then(Value::as_u64) == Some(1),
        "1 (the absorbed MLA cache)",
    );

    if is_xing {
        c.int("hyper_connection.count", "hc_mult", cfg.hc_mult, Both);
        c.int(
            "hyper_connection.sinkhorn_iterations",
            "hc_sinkhorn_iters",
            cfg.hc_sinkhorn_iters,
            Both,
        );
        c.float("hyper_connection.epsilon", "hc_eps", cfg.hc_eps, Both);
        let hc_key = c.key("hyper_connection.count");
        if let Some(v) = meta.get(&hc_key) {
            let max = crate::hparams::MAX_HC_STREAMS as u64;
            c.require(
                hc_key,
                Some(v.describe()),
                v.as_u64().is_some_and(|n| (1..=max).contains(&n)),
                &format!("1..={max}"),
            );
        }
    }

    if let (Some(g), Some(cb)) = (meta.get("tokenizer.ggml.bos_token_id"), cfg.bos_token_id)
        && g.as_u64() != Some(cb as u64)
    {
        c.differ(
            "tokenizer.ggml.bos_token_id".into(),
            "bos_token_id",
            g.describe(),
            cb.to_string(),
        );
    }
    if let (Some(g), Some(ce)) = (meta.get("tokenizer.ggml.eos_token_id"), &cfg.eos_token_id) {
        let ok = g
            .as_u64()
            .and_then(|g| u32::try_from(g).ok())
            .is_some_and(|g| ce.contains(g));
        if !ok {
            c.differ(
                "tokenizer.ggml.eos_token_id".into(),
                "eos_token_id",
                g.describe(),
                format!("{:?}", ce.ids()),
            );
        }
    }

    if c.found.is_empty() {
        Ok(())
    } else {
        Err(CrossCheckError::Mismatches(c.found))
    }
}

// ---------------------------------------------------------------------------------------------
// The release directory

#[derive(Clone, Debug)]
pub struct Release {
    pub dir: PathBuf,
    pub config: Option<ReleaseConfig>,
    pub generation: Option<GenerationConfig>,
    pub tokenizer_json: Option<PathBuf>,
    /// From `tokenizer_config.json` `chat_template` (a string, or a list of `{name, template}` of
    /// which "default" is taken), else from `chat_template.jinja`.
    pub chat_template: Option<String>,
    /// `bos_token` / `eos_token` of `tokenizer_config.json` (string or `{content}`), for templates.
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

impl Release {
    pub fn open(dir: &Path) -> Result<Release, ReleaseError> {
        if !dir.is_dir() {
            return Err(ReleaseError::NotADirectory {
                path: dir.to_path_buf(),
            });
        }
        let config = dir.join("config.json");
        let config = match config.is_file() {
            true => Some(ReleaseConfig::from_file(&config)?),
            false => None,
        };
        let generation = dir.join("generation_config.json");
        let generation = match generation.is_file() {
            true => Some(read_json::<GenerationConfig>(&generation)?),
            false => None,
        };
        let tokenizer_json = Some(dir.join("tokenizer.json")).filter(|p| p.is_file());

        let (mut chat_template, mut bos_token, mut eos_token) = (None, None, None);
        let tc_path = dir.join("tokenizer_config.json");
        if tc_path.is_file() {
            let tc: serde_json::Value = read_json(&tc_path)?;
            chat_template = template_of(&tc, &tc_path)?;
            bos_token = token_text(tc.get("bos_token"));
            eos_token = token_text(tc.get("eos_token"));
        }
        let jinja = dir.join("chat_template.jinja");
        if chat_template.is_none() && jinja.is_file() {
            chat_template = Some(read(&jinja)?);
        }
        Ok(Release {
            dir: dir.to_path_buf(),
            config,
            generation,
            tokenizer_json,
            chat_template,
            bos_token,
            eos_token,
        })
    }

    /// The comb-logit clamp: from `config.json`, or ±30 (flagged) without one.
    pub fn hc_clamp(&self) -> HcClamp {
        self.config
            .as_ref()
            .map_or(HcClamp::DEFAULT, ReleaseConfig::hc_clamp)
    }
}

fn token_text(v: Option<&serde_json::Value>) -> Option<String> {
    let v = v?;
    v.as_str()
        .or_else(|| v.get("content").and_then(|c| c.as_str()))
        .map(str::to_string)
}

fn template_of(tc: &serde_json::Value, path: &Path) -> Result<Option<String>, ReleaseError> {
    let invalid = |message: String| ReleaseError::Invalid {
        path: path.to_path_buf(),
        message,
    };
    match tc.get("chat_template") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(serde_json::Value::Array(items)) => {
            let mut names = Vec::new();
            for item in items {
                let name = item.get("name").and_then(|n| n.as_str());
                let template = item.get("template").and_then(|t| t.as_str());
                match (name, template) {
                    (Some("default"), Some(t)) => return Ok(Some(t.to_string())),
                    (Some(n), Some(_)) => names.push(n.to_string()),
                    _ => {
                        return Err(invalid(
                            "chat_template list entries must be {\"name\": string, \"template\": string}"
                                .into(),
                        ));
                    }
                }
            }
            Err(invalid(format!(
                "chat_template list has no \"default\" entry (found {names:?})"
            )))
        }
        Some(_) => Err(invalid(
            "chat_template must be a string or a list of {name, template}".into(),
        )),
    }
}

// ---------------------------------------------------------------------------------------------
// Path resolution (seed §7)

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedPaths {
    pub gguf: PathBuf,
    pub release_dir: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("no model path given")]
    NoModel,
    #[error("{path} does not exist")]
    NotFound { path: PathBuf },
    #[error("{path} is {kind}, not a .gguf file or a directory holding one")]
    NotRegular { path: PathBuf, kind: &'static str },
    #[error("no .gguf file in {dir}")]
    NoGguf { dir: PathBuf },
    #[error("{dir} holds several .gguf files; name one: {}", paths(.found))]
    SeveralGguf { dir: PathBuf, found: Vec<PathBuf> },
    #[error("cannot read the architecture from the GGUF header of {path}: {message}")]
    Header { path: PathBuf, message: String },
    #[error(
        "no `{arch}` release directory (tokenizer, chat template, config.json) found; looked at: {}; pass the release directory explicitly",
        paths(.looked_at)
    )]
    NoRelease {
        arch: String,
        looked_at: Vec<PathBuf>,
    },
    #[error("several `{arch}` release directories: {}; pass one explicitly", paths(.found))]
    SeveralReleases { arch: String, found: Vec<PathBuf> },
    #[error("cannot list {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

fn paths(ps: &[PathBuf]) -> String {
    ps.iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn model_type(dir: &Path) -> Option<String> {
    let text = fs::read_to_string(dir.join("config.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v.get("model_type")?.as_str().map(str::to_string)
}

/// Whether `dir` is the release of a GGUF of architecture `arch`. A marker rather than "has a
/// config.json": release directories sit beside other checkpoints, and taking the wrong one would
/// tokenize with the wrong vocabulary.
pub fn is_release_dir(dir: &Path, arch: &str) -> bool {
    let mt = model_type(dir);
    match arch {
        "xing4_0" => {
            dir.join("tokenization_xing4_0.py").is_file() || mt.as_deref() == Some("xing4_0")
        }
        "deepseek2" => matches!(mt.as_deref(), Some("deepseek_v2" | "deepseek_v3")),
        other => mt.as_deref() == Some(other),
    }
}

fn marker_paths(dir: &Path, arch: &str) -> Vec<PathBuf> {
    let mut v = Vec::new();
    if arch == "xing4_0" {
        v.push(dir.join("tokenization_xing4_0.py"));
    }
    v.push(dir.join("config.json"));
    v
}

fn sorted_entries(dir: &Path) -> Result<Vec<PathBuf>, ResolveError> {
    let io = |source| ResolveError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).map_err(io)? {
        out.push(entry.map_err(io)?.path());
    }
    out.sort();
    Ok(out)
}

/// Reads `general.architecture` from a GGUF header without loading the rest.
pub fn gguf_architecture(path: &Path) -> Result<String, ResolveError> {
    let header_err = |message: String| ResolveError::Header {
        path: path.to_path_buf(),
        message,
    };
    let file = fs::File::open(path).map_err(|e| header_err(e.to_string()))?;
    let mut r = HeaderReader {
        r: BufReader::new(file),
    };
    r.arch().map_err(header_err)
}

struct HeaderReader<R> {
    r: BufReader<R>,
}

impl<R: Read + Seek> HeaderReader<R> {
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut b = [0u8; N];
        self.r
            .read_exact(&mut b)
            .map_err(|e| format!("truncated header ({e})"))?;
        Ok(b)
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }

    fn skip(&mut self, n: u64) -> Result<(), String> {
        let n = i64::try_from(n).map_err(|_| format!("length {n} is implausible"))?;
        self.r.seek_relative(n).map_err(|e| e.to_string())
    }

    fn string(&mut self, limit: u64) -> Result<String, String> {
        let n = self.u64()?;
        if n > limit {
            return Err(format!(
                "string of {n} bytes where at most {limit} is expected"
            ));
        }
        let mut buf = vec![0u8; n as usize];
        self.r
            .read_exact(&mut buf)
            .map_err(|e| format!("truncated header ({e})"))?;
        String::from_utf8(buf).map_err(|_| "a key is not UTF-8".to_string())
    }

    fn skip_value(&mut self, ty: u32, depth: u32) -> Result<(), String> {
        let fixed = |ty: u32| match ty {
            0 | 1 | 7 => Some(1u64),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        };
        match ty {
            8 => {
                let n = self.u64()?;
                self.skip(n)
            }
            9 if depth < 4 => {
                let elem = self.u32()?;
                let count = self.u64()?;
                if let Some(size) = fixed(elem) {
                    let total = count
                        .checked_mul(size)
                        .ok_or_else(|| format!("array of {count} elements is implausible"))?;
                    self.skip(total)
                } else {
                    for _ in 0..count {
                        self.skip_value(elem, depth + 1)?;
                    }
                    Ok(())
                }
            }
            _ => match fixed(ty) {
                Some(n) => self.skip(n),
                None => Err(format!("unknown value type {ty}")),
            },
        }
    }

    fn arch(&mut self) -> Result<String, String> {
        if &self.bytes::<4>()? != b"GGUF" {
            return Err("not a GGUF file (bad magic)".into());
        }
        let version = self.u32()?;
        if !(2..=3).contains(&version) {
            return Err(format!("GGUF version {version}; expected 2 or 3"));
        }
        let _n_tensors = self.u64()?;
        let n_kv = self.u64()?;
        for _ in 0..n_kv {
            let key = self.string(1 << 16)?;
            let ty = self.u32()?;
            if key == "general.architecture" {
                if ty != 8 {
                    return Err(format!(
                        "`general.architecture` has value type {ty}, expected string (8)"
                    ));
                }
                return self.string(1 << 10);
            }
            self.skip_value(ty, 0)?;
        }
        Err("`general.architecture` is missing".into())
    }
}

fn single_gguf(dir: &Path) -> Result<PathBuf, ResolveError> {
    let found: Vec<PathBuf> = sorted_entries(dir)?
        .into_iter()
        .filter(|p| {
            p.is_file()
                && p.extension()
                    .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        })
        .collect();
    match <[PathBuf; 1]>::try_from(found) {
        Ok([one]) => Ok(one),
        Err(found) if found.is_empty() => Err(ResolveError::NoGguf {
            dir: dir.to_path_buf(),
        }),
        Err(found) => Err(ResolveError::SeveralGguf {
            dir: dir.to_path_buf(),
            found,
        }),
    }
}

/// `tokenizer_path` given explicitly: a file names its directory; a release directory is taken
/// as is; otherwise the one sub-directory carrying the release marker for `arch`.
fn explicit_release(t: &Path, arch: &str) -> Result<PathBuf, ResolveError> {
    if t.is_file() {
        return Ok(t
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf());
    }
    if !t.is_dir() {
        return Err(ResolveError::NotFound {
            path: t.to_path_buf(),
        });
    }
    if is_release_dir(t, arch) {
        return Ok(t.to_path_buf());
    }
    let mut looked_at = marker_paths(t, arch);
    let mut found = Vec::new();
    for sub in sorted_entries(t)?.into_iter().filter(|p| p.is_dir()) {
        looked_at.extend(marker_paths(&sub, arch));
        if is_release_dir(&sub, arch) {
            found.push(sub);
        }
    }
    match found.len() {
        1 => Ok(found.remove(0)),
        0 if t.join("tokenizer.json").is_file() => Ok(t.to_path_buf()),
        0 => Err(ResolveError::NoRelease {
            arch: arch.to_string(),
            looked_at,
        }),
        _ => Err(ResolveError::SeveralReleases {
            arch: arch.to_string(),
            found,
        }),
    }
}

/// Why a path that is neither a file nor a directory cannot be a model: it is missing, or it
/// is something else (a device such as `/dev/null`, a pipe, a socket).
fn not_usable(path: &Path) -> ResolveError {
    let Ok(meta) = std::fs::metadata(path) else {
        return ResolveError::NotFound {
            path: path.to_path_buf(),
        };
    };
    #[cfg(unix)]
    let kind = {
        use std::os::unix::fs::FileTypeExt;
        let t = meta.file_type();
        if t.is_char_device() {
            "a character device"
        } else if t.is_block_device() {
            "a block device"
        } else if t.is_fifo() {
            "a named pipe"
        } else if t.is_socket() {
            "a socket"
        } else {
            "not a regular file"
        }
    };
    #[cfg(not(unix))]
    let kind = {
        let _ = meta;
        "not a regular file"
    };
    ResolveError::NotRegular {
        path: path.to_path_buf(),
        kind,
    }
}

/// Seed §7: the weights come from wherever the `.gguf` is, everything else from a release
/// directory. `model` is a `.gguf` or a directory holding exactly one; without `tokenizer_path` a
/// directory model is its own release, and a file model's directory must carry the release marker.
pub fn resolve(
    model: Option<&Path>,
    tokenizer_path: Option<&Path>,
) -> Result<ResolvedPaths, ResolveError> {
    let model = model.or(tokenizer_path).ok_or(ResolveError::NoModel)?;
    let gguf = if model.is_dir() {
        single_gguf(model)?
    } else if model.is_file() {
        model.to_path_buf()
    } else {
        return Err(not_usable(model));
    };
    let arch = gguf_architecture(&gguf)?;
    let release_dir = match tokenizer_path {
        Some(t) if t != model => explicit_release(t, &arch)?,
        _ if model.is_dir() => model.to_path_buf(),
        _ => {
            let dir = gguf
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            if !is_release_dir(dir, &arch) {
                let looked_at = marker_paths(dir, &arch);
                return Err(ResolveError::NoRelease { arch, looked_at });
            }
            dir.to_path_buf()
        }
    };
    Ok(ResolvedPaths { gguf, release_dir })
}
