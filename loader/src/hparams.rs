//! Architecture hyper-parameters read from (and written to) GGUF metadata (spec §1.1).

use std::fmt;

use crate::gguf::{Metadata, MetadataError, Value};
use crate::schema::{KeyKind, Problem, SchemaError, key_rules};

/// The architectures this runtime runs (`general.architecture`).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    /// The Xing4.0 trunk: MLA + MoE with 4-stream hyper-connections.
    Xing4_0,
    /// The same trunk without hyper-connections (llama.cpp's `deepseek2`).
    Deepseek2,
}

impl Arch {
    pub const ALL: [Arch; 2] = [Arch::Xing4_0, Arch::Deepseek2];

    /// The `general.architecture` string, also the prefix of every architecture key.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Xing4_0 => "xing4_0",
            Arch::Deepseek2 => "deepseek2",
        }
    }

    pub fn from_name(name: &str) -> Option<Arch> {
        Arch::ALL.into_iter().find(|a| a.name() == name)
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// YaRN rope scaling (spec §3.5).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct YarnParams {
    pub factor: f32,
    pub orig_ctx: u32,
    pub beta_fast: f32,
    pub beta_slow: f32,
    /// As stored: `0.1 · mscale_all_dim` (llama.cpp divides by 0.1 on load).
    pub log_multiplier: f32,
}

/// Hyper-connection settings (spec §3.2–3.3).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HcParams {
    pub count: usize,
    pub sinkhorn_iters: usize,
    pub eps: f32,
}

/// `expert_gating_func` values (llama.cpp `llama_expert_gating_func_type`).
/// Most hyper-connection streams a checkpoint may have (the release has 4).
pub const MAX_HC_STREAMS: usize = 8;
pub const GATING_SOFTMAX: u32 = 1;
pub const GATING_SIGMOID: u32 = 2;

/// How router logits become expert scores (`expert_gating_func`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExpertGating {
    /// `softmax` over the experts ([`GATING_SOFTMAX`]).
    Softmax,
    /// An independent `σ` per expert ([`GATING_SIGMOID`]).
    Sigmoid,
}

impl ExpertGating {
    /// The gating a GGUF `expert_gating_func` value names, if any.
    pub fn from_gguf(v: u32) -> Option<ExpertGating> {
        match v {
            GATING_SOFTMAX => Some(ExpertGating::Softmax),
            GATING_SIGMOID => Some(ExpertGating::Sigmoid),
            _ => None,
        }
    }

    /// The GGUF `expert_gating_func` value.
    pub fn gguf(self) -> u32 {
        match self {
            ExpertGating::Softmax => GATING_SOFTMAX,
            ExpertGating::Sigmoid => GATING_SIGMOID,
        }
    }

    /// `scoring_func` as a HF `config.json` spells it.
    pub fn name(self) -> &'static str {
        match self {
            ExpertGating::Softmax => "softmax",
            ExpertGating::Sigmoid => "sigmoid",
        }
    }
}

impl std::fmt::Display for ExpertGating {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct HParams {
    pub arch: Arch,
    pub n_vocab: usize,
    pub n_embd: usize,
    /// `block_count`: trunk blocks plus NextN (MTP) blocks.
    pub n_block: usize,
    pub n_nextn: usize,
    /// Trunk blocks, `n_block - n_nextn`.
    pub n_layer: usize,
    pub n_ctx_train: usize,
    pub n_head: usize,
    /// Heads of the absorbed cache (always 1).
    pub n_head_kv: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope: usize,
    pub qk_rope: usize,
    pub v_head: usize,
    /// Absorbed key width, `kv_lora_rank + qk_rope`.
    pub key_length: usize,
    /// Absorbed value width, `kv_lora_rank`.
    pub value_length: usize,
    pub n_ff: usize,
    pub n_ff_exp: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub n_expert_shared: usize,
    pub n_dense_lead: usize,
    pub expert_weights_scale: f32,
    pub expert_weights_norm: bool,
    /// `expert_gating_func`.
    pub expert_gating: ExpertGating,
    pub rms_eps: f32,
    pub rope_freq_base: f32,
    pub rope_dim: usize,
    pub yarn: Option<YarnParams>,
    pub hc: Option<HcParams>,
}

/// Reads keys the schema has already type-checked; anything still wrong is recorded, not
/// returned, so that every problem is reported at once.
struct KeyReader<'a> {
    meta: &'a Metadata,
    prefix: String,
    problems: Vec<Problem>,
}

impl KeyReader<'_> {
    fn key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.prefix)
    }

    fn note<T: Default>(&mut self, r: Result<T, MetadataError>) -> T {
        r.unwrap_or_else(|e| {
            self.problems.push(e.into());
            T::default()
        })
    }

    fn usize(&mut self, suffix: &str) -> usize {
        let r = self.meta.get_u32(&self.key(suffix));
        self.note(r) as usize
    }

    fn f32(&mut self, suffix: &str) -> f32 {
        let r = self.meta.get_f32(&self.key(suffix));
        self.note(r)
    }

    fn bool(&mut self, suffix: &str) -> bool {
        let r = self.meta.get_bool(&self.key(suffix));
        self.note(r)
    }

    fn opt_usize(&mut self, suffix: &str) -> Option<usize> {
        self.meta
            .contains(&self.key(suffix))
            .then(|| self.usize(suffix))
    }

    fn bad(&mut self, suffix: &str, expected: impl Into<String>, found: impl fmt::Display) {
        self.problems.push(Problem::BadValue {
            key: self.key(suffix),
            expected: expected.into(),
            found: found.to_string(),
        });
    }
}

impl HParams {
    /// Reads and validates the architecture keys. Every missing key, wrongly typed key and
    /// inconsistent value is listed in the error.
    pub fn from_metadata(meta: &Metadata) -> Result<HParams, SchemaError> {
        let arch_name = meta
            .get_str("general.architecture")
            .map_err(|e| SchemaError {
                problems: vec![e.into()],
            })?;
        let Some(arch) = Arch::from_name(arch_name) else {
            return Err(SchemaError {
                problems: vec![Problem::BadValue {
                    key: "general.architecture".into(),
                    expected: format!(
                        "one of {}",
                        Arch::ALL.map(|a| format!("{:?}", a.name())).join(", ")
                    ),
                    found: format!("{arch_name:?}"),
                }],
            });
        };

        // Presence and types first, from the declarative table.
        let yarn = meta.get_str(&format!("{arch}.rope.scaling.type")) == Ok("yarn");
        let mut problems = Vec::new();
        for rule in key_rules(arch, yarn) {
            if let Some(p) = rule.check(meta) {
                problems.push(p);
            }
        }
        if !problems.is_empty() {
            return Err(SchemaError { problems });
        }

        let mut r = KeyReader {
            meta,
            prefix: arch.name().to_string(),
            problems: Vec::new(),
        };
        let n_vocab = match r.opt_usize("vocab_size") {
            Some(n) => n,
            None => match meta.get_array("tokenizer.ggml.tokens") {
                Ok((_, tokens)) => tokens.len(),
                Err(_) => {
                    r.problems.push(Problem::MissingKey {
                        key: r.key("vocab_size"),
                        expected: "u32 (or a tokenizer.ggml.tokens array to count)",
                    });
                    0
                }
            },
        };
        let n_block = r.usize("block_count");
        let n_nextn = r.opt_usize("nextn_predict_layers").unwrap_or(0);
        let n_head = r.usize("attention.head_count");
        let n_head_kv = r.usize("attention.head_count_kv");
        // Absent (DeepSeek-V2-Lite): the query is projected directly (`attn_q`), no low rank.
        let q_lora_rank = r.opt_usize("attention.q_lora_rank").unwrap_or(0);
        let kv_lora_rank = r.usize("attention.kv_lora_rank");
        let key_length = r.usize("attention.key_length");
        let value_length = r.usize("attention.value_length");
        let key_length_mla = r.usize("attention.key_length_mla");
        let v_head = r.usize("attention.value_length_mla");
        let rope_dim = r.usize("rope.dimension_count");
        let n_expert = r.usize("expert_count");
        let n_expert_used = r.usize("expert_used_count");
        let n_dense_lead = r.usize("leading_dense_block_count");
        let expert_gating_func = r.usize("expert_gating_func") as u32;

        let mut h = HParams {
            arch,
            n_vocab,
            n_embd: r.usize("embedding_length"),
            n_block,
            n_nextn,
            n_layer: n_block.saturating_sub(n_nextn),
            n_ctx_train: r.usize("context_length"),
            n_head,
            n_head_kv,
            q_lora_rank,
            kv_lora_rank,
            qk_nope: key_length_mla.saturating_sub(rope_dim),
            qk_rope: rope_dim,
            v_head,
            key_length,
            value_length,
            n_ff: r.usize("feed_forward_length"),
            n_ff_exp: r.usize("expert_feed_forward_length"),
            n_expert,
            n_expert_used,
            n_expert_shared: r.usize("expert_shared_count"),
            n_dense_lead,
            expert_weights_scale: r.f32("expert_weights_scale"),
            expert_weights_norm: r.bool("expert_weights_norm"),
            expert_gating: ExpertGating::from_gguf(expert_gating_func)
                .unwrap_or(ExpertGating::Sigmoid),
            rms_eps: r.f32("attention.layer_norm_rms_epsilon"),
            rope_freq_base: r.f32("rope.freq_base"),
            rope_dim,
            yarn: None,
            hc: None,
        };

        let scaling = r.key("rope.scaling.type");
        match meta.get_str(&scaling) {
            Err(_) => {}
            Ok("none") => {}
            Ok("yarn") => {
                h.yarn = Some(YarnParams {
                    factor: r.f32("rope.scaling.factor"),
                    orig_ctx: r.usize("rope.scaling.original_context_length") as u32,
                    beta_fast: r.f32("rope.scaling.yarn_beta_fast"),
                    beta_slow: r.f32("rope.scaling.yarn_beta_slow"),
                    log_multiplier: r.f32("rope.scaling.yarn_log_multiplier"),
                })
            }
            Ok(other) => r.bad(
                "rope.scaling.type",
                "\"yarn\" or \"none\"",
                format!("{other:?}"),
            ),
        }
        if arch == Arch::Xing4_0 {
            h.hc = Some(HcParams {
                count: r.usize("hyper_connection.count"),
                sinkhorn_iters: r.usize("hyper_connection.sinkhorn_iterations"),
                eps: r.f32("hyper_connection.epsilon"),
            });
        }

        // Values this runtime's math depends on (spec §1.3, §9).
        if n_nextn >= n_block {
            r.bad(
                "nextn_predict_layers",
                format!("fewer than block_count ({n_block})"),
                n_nextn,
            );
        }
        if n_head_kv != 1 {
            r.bad(
                "attention.head_count_kv",
                "1 (the absorbed MLA cache)",
                n_head_kv,
            );
        }
        for (key, v) in [
            ("embedding_length", h.n_embd),
            ("attention.head_count", n_head),
            ("attention.kv_lora_rank", kv_lora_rank),
            ("attention.value_length_mla", v_head),
            ("rope.dimension_count", rope_dim),
            ("expert_count", n_expert),
            ("expert_used_count", n_expert_used),
        ] {
            if v == 0 {
                r.bad(key, "a positive value", 0);
            }
        }
        if !rope_dim.is_multiple_of(2) {
            r.bad(
                "rope.dimension_count",
                "an even number (rope rotates pairs)",
                rope_dim,
            );
        }
        if key_length_mla <= rope_dim {
            r.bad(
                "attention.key_length_mla",
                format!("more than rope.dimension_count ({rope_dim}): qk_nope + qk_rope"),
                key_length_mla,
            );
        }
        if key_length != kv_lora_rank + rope_dim {
            r.bad(
                "attention.key_length",
                format!(
                    "kv_lora_rank + rope.dimension_count = {}",
                    kv_lora_rank + rope_dim
                ),
                key_length,
            );
        }
        if value_length != kv_lora_rank {
            r.bad(
                "attention.value_length",
                format!("kv_lora_rank = {kv_lora_rank}"),
                value_length,
            );
        }
        if n_expert_used > n_expert {
            r.bad(
                "expert_used_count",
                format!("at most expert_count ({n_expert})"),
                n_expert_used,
            );
        }
        if n_dense_lead > h.n_layer {
            r.bad(
                "leading_dense_block_count",
                format!("at most the trunk block count ({})", h.n_layer),
                n_dense_lead,
            );
        }
        if ExpertGating::from_gguf(expert_gating_func).is_none() {
            r.bad(
                "expert_gating_func",
                "1 (softmax) or 2 (sigmoid)",
                expert_gating_func,
            );
        }
        // llama.cpp only routes by group when the group count is above 1; we do not route by group.
        for key in ["expert_group_count", "expert_group_used_count"] {
            if let Some(n) = r.opt_usize(key)
                && n > 1
            {
                r.bad(key, "1 (group routing is not supported)", n);
            }
        }
        // The release has 4 streams (llama.cpp asserts it); the kernels take any count, and
        // the rows pass of the boundaries runs only at 4.
        if let Some(hc) = h.hc
            && !(1..=MAX_HC_STREAMS).contains(&hc.count)
        {
            r.bad(
                "hyper_connection.count",
                format!("1..={MAX_HC_STREAMS} (hc_mult)"),
                hc.count,
            );
        }
        if h.n_vocab == 0 {
            r.bad("vocab_size", "a positive value", 0);
        }

        if r.problems.is_empty() {
            Ok(h)
        } else {
            Err(SchemaError {
                problems: r.problems,
            })
        }
    }

    /// Writes `general.architecture` and every architecture key (spec §1.1).
    pub fn to_metadata(&self, meta: &mut Metadata) {
        let p = self.arch.name();
        let u = |n: usize| Value::U32(n as u32);
        meta.insert("general.architecture", Value::String(p.into()));
        let mut put = |k: &str, v: Value| meta.insert(format!("{p}.{k}"), v);
        put("vocab_size", u(self.n_vocab));
        put("context_length", u(self.n_ctx_train));
        put("embedding_length", u(self.n_embd));
        put("feed_forward_length", u(self.n_ff));
        put("expert_feed_forward_length", u(self.n_ff_exp));
        put("block_count", u(self.n_block));
        put("nextn_predict_layers", u(self.n_nextn));
        put("leading_dense_block_count", u(self.n_dense_lead));
        put("attention.head_count", u(self.n_head));
        put("attention.head_count_kv", u(self.n_head_kv));
        put("attention.key_length", u(self.key_length));
        put("attention.value_length", u(self.value_length));
        put("attention.key_length_mla", u(self.qk_nope + self.qk_rope));
        put("attention.value_length_mla", u(self.v_head));
        if self.q_lora_rank > 0 {
            put("attention.q_lora_rank", u(self.q_lora_rank));
        }
        put("attention.kv_lora_rank", u(self.kv_lora_rank));
        put("attention.layer_norm_rms_epsilon", Value::F32(self.rms_eps));
        put("rope.dimension_count", u(self.rope_dim));
        put("rope.freq_base", Value::F32(self.rope_freq_base));
        if let Some(y) = self.yarn {
            put("rope.scaling.type", Value::String("yarn".into()));
            put("rope.scaling.factor", Value::F32(y.factor));
            put(
                "rope.scaling.original_context_length",
                Value::U32(y.orig_ctx),
            );
            put("rope.scaling.yarn_beta_fast", Value::F32(y.beta_fast));
            put("rope.scaling.yarn_beta_slow", Value::F32(y.beta_slow));
            put(
                "rope.scaling.yarn_log_multiplier",
                Value::F32(y.log_multiplier),
            );
        }
        put("expert_count", u(self.n_expert));
        put("expert_used_count", u(self.n_expert_used));
        put("expert_shared_count", u(self.n_expert_shared));
        put("expert_gating_func", Value::U32(self.expert_gating.gguf()));
        put("expert_weights_norm", Value::Bool(self.expert_weights_norm));
        put(
            "expert_weights_scale",
            Value::F32(self.expert_weights_scale),
        );
        put("expert_group_count", u(1));
        put("expert_group_used_count", u(1));
        if let Some(hc) = self.hc {
            put("hyper_connection.count", u(hc.count));
            put("hyper_connection.sinkhorn_iterations", u(hc.sinkhorn_iters));
            put("hyper_connection.epsilon", Value::F32(hc.eps));
        }
    }

    /// Whether trunk block `i` has a dense FFN (the others are MoE).
    pub fn is_dense(&self, i: usize) -> bool {
        i < self.n_dense_lead
    }
}

/// The expected type of a key, as the metadata getters check it.
pub(crate) fn kind_check(meta: &Metadata, key: &str, kind: KeyKind) -> Result<(), MetadataError> {
    match kind {
        KeyKind::U32 => meta.get_u32(key).map(drop),
        KeyKind::F32 => meta.get_f32(key).map(drop),
        KeyKind::Bool => meta.get_bool(key).map(drop),
        KeyKind::Str => meta.get_str(key).map(drop),
    }
}
