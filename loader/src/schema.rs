//! What a checkpoint of each architecture must contain: metadata keys with their types, and
//! tensors with their shapes (computed from the hyper-parameters) and allowed storage types
//! (spec §1.1, §2). [`check`] compares a file against it and reports every problem at once.
//!
//! The tensor table itself belongs to the architecture (`models/*`), which sits above this
//! crate, so [`check`] is handed it.

use std::collections::{HashMap, HashSet};
use std::fmt;

use crate::GgmlType;
use crate::gguf::{Metadata, MetadataError, TensorInfo};
use crate::hparams::{Arch, HParams, kind_check};

/// The type a metadata key must hold. Integer keys accept any unsigned width that fits in
/// u32 and float keys f32 or f64, as llama.cpp's loader does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyKind {
    U32,
    F32,
    Bool,
    Str,
}

impl KeyKind {
    pub fn name(self) -> &'static str {
        match self {
            KeyKind::U32 => "u32",
            KeyKind::F32 => "f32",
            KeyKind::Bool => "bool",
            KeyKind::Str => "string",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyRule {
    pub name: String,
    pub kind: KeyKind,
    /// Optional keys are type-checked when present.
    pub required: bool,
}

impl KeyRule {
    /// The problem with this key in `meta`, if any.
    pub fn check(&self, meta: &Metadata) -> Option<Problem> {
        if !meta.contains(&self.name) {
            return self.required.then(|| Problem::MissingKey {
                key: self.name.clone(),
                expected: self.kind.name(),
            });
        }
        kind_check(meta, &self.name, self.kind)
            .err()
            .map(Problem::from)
    }
}

use KeyKind::{Bool, F32, Str, U32};

/// Keys after the `{arch}.` prefix: (suffix, kind, required).
const COMMON_KEYS: &[(&str, KeyKind, bool)] = &[
    ("vocab_size", U32, false),
    ("context_length", U32, true),
    ("embedding_length", U32, true),
    ("feed_forward_length", U32, true),
    ("expert_feed_forward_length", U32, true),
    ("block_count", U32, true),
    ("nextn_predict_layers", U32, false),
    ("leading_dense_block_count", U32, true),
    ("attention.head_count", U32, true),
    ("attention.head_count_kv", U32, true),
    ("attention.key_length", U32, true),
    ("attention.value_length", U32, true),
    ("attention.key_length_mla", U32, true),
    ("attention.value_length_mla", U32, true),
    // Absent: no low-rank query (`attn_q` instead of `attn_q_a`/`attn_q_a_norm`/`attn_q_b`).
    ("attention.q_lora_rank", U32, false),
    ("attention.kv_lora_rank", U32, true),
    ("attention.layer_norm_rms_epsilon", F32, true),
    ("rope.dimension_count", U32, true),
    ("rope.freq_base", F32, true),
    ("rope.scaling.type", Str, false),
    ("expert_count", U32, true),
    ("expert_used_count", U32, true),
    ("expert_shared_count", U32, true),
    // Absent, llama.cpp silently uses softmax; the release routes by sigmoid (spec §1.1).
    ("expert_gating_func", U32, true),
    ("expert_weights_norm", Bool, true),
    ("expert_weights_scale", F32, true),
    ("expert_group_count", U32, false),
    ("expert_group_used_count", U32, false),
];

/// Required when `rope.scaling.type` is `"yarn"`. llama.cpp defaults the betas and the log
/// multiplier when absent; the default multiplier (0) would change the attention scale, so we
/// insist on every one.
const YARN_KEYS: &[(&str, KeyKind)] = &[
    ("rope.scaling.factor", F32),
    ("rope.scaling.original_context_length", U32),
    ("rope.scaling.yarn_beta_fast", F32),
    ("rope.scaling.yarn_beta_slow", F32),
    ("rope.scaling.yarn_log_multiplier", F32),
];

const HC_KEYS: &[(&str, KeyKind)] = &[
    ("hyper_connection.count", U32),
    ("hyper_connection.sinkhorn_iterations", U32),
    ("hyper_connection.epsilon", F32),
];

/// The metadata keys of `arch` (`general.architecture` itself is checked before dispatch).
/// `yarn` adds the YaRN keys, required when `rope.scaling.type` is `"yarn"`.
pub fn key_rules(arch: Arch, yarn: bool) -> Vec<KeyRule> {
    let p = arch.name();
    let rule = |s: &str, kind, required| KeyRule {
        name: format!("{p}.{s}"),
        kind,
        required,
    };
    let mut rules: Vec<KeyRule> = COMMON_KEYS.iter().map(|&(s, k, r)| rule(s, k, r)).collect();
    if yarn {
        rules.extend(YARN_KEYS.iter().map(|&(s, k)| rule(s, k, true)));
    }
    if arch == Arch::Xing4_0 {
        rules.extend(HC_KEYS.iter().map(|&(s, k)| rule(s, k, true)));
    }
    rules
}

/// Norms, biases and hyper-connection base/scale vectors: read as f32 by every backend.
pub const F32_ONLY: &[GgmlType] = &[GgmlType::F32];
/// The router stays in a float type: its top-k decisions are sensitive (spec §4).
pub const FLOAT: &[GgmlType] = &[GgmlType::F32, GgmlType::F16, GgmlType::BF16];
/// Matrices: any storage type (the release uses BF16, IQ4_NL and Q6_K; spec §2).
pub const ANY: &[GgmlType] = &GgmlType::ALL;

/// How `make-model` draws a tensor's random values. Kept beside the shapes so an architecture's
/// tensor table is written once, for the schema check and the synthetic writer alike.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// N(0, std²).
    Normal { std: f32 },
    /// `mean + std · N(0, 1)`.
    Around { mean: f32, std: f32 },
}

/// One row of an architecture's tensor table: a tensor a checkpoint contains.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorRule {
    pub name: String,
    /// `ne0` first.
    pub ne: Vec<u64>,
    pub allowed: &'static [GgmlType],
    /// The released checkpoint's type, which `make-model` writes (one of `allowed`).
    pub release: GgmlType,
    pub init: Init,
}

impl TensorRule {
    pub fn new(
        name: String,
        ne: &[usize],
        allowed: &'static [GgmlType],
        release: GgmlType,
        init: Init,
    ) -> TensorRule {
        TensorRule {
            name,
            ne: ne.iter().map(|&n| n as u64).collect(),
            allowed,
            release,
            init,
        }
    }
}

/// One way a checkpoint departs from its schema.
#[derive(Clone, Debug, PartialEq)]
pub enum Problem {
    MissingKey {
        key: String,
        expected: &'static str,
    },
    WrongKeyType {
        key: String,
        expected: &'static str,
        found: String,
    },
    /// A key of the right type whose value this runtime cannot run.
    BadValue {
        key: String,
        expected: String,
        found: String,
    },
    MissingTensor {
        name: String,
        ne: Vec<u64>,
        allowed: &'static [GgmlType],
    },
    WrongShape {
        name: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },
    DisallowedType {
        name: String,
        allowed: &'static [GgmlType],
        found: GgmlType,
    },
    NotWholeBlocks {
        name: String,
        ty: GgmlType,
        ne0: u64,
    },
    /// A tensor outside the schema that is not part of a NextN block.
    UnexpectedTensor {
        name: String,
    },
}

impl From<MetadataError> for Problem {
    fn from(e: MetadataError) -> Problem {
        match e {
            MetadataError::Missing { key, expected } => Problem::MissingKey { key, expected },
            MetadataError::WrongType {
                key,
                expected,
                found,
            } => Problem::WrongKeyType {
                key,
                expected,
                found,
            },
        }
    }
}

fn types(t: &[GgmlType]) -> String {
    t.iter().map(|t| t.name()).collect::<Vec<_>>().join("|")
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::MissingKey { key, expected } => {
                write!(f, "metadata key `{key}` is missing (expected {expected})")
            }
            Problem::WrongKeyType {
                key,
                expected,
                found,
            } => write!(
                f,
                "metadata key `{key}`: expected {expected}, found {found}"
            ),
            Problem::BadValue {
                key,
                expected,
                found,
            } => write!(
                f,
                "metadata key `{key}`: expected {expected}, found {found}"
            ),
            Problem::MissingTensor { name, ne, allowed } => write!(
                f,
                "tensor `{name}` is missing (expected ne {ne:?}, type {})",
                types(allowed)
            ),
            Problem::WrongShape {
                name,
                expected,
                found,
            } => write!(
                f,
                "tensor `{name}`: expected ne {expected:?}, found {found:?}"
            ),
            Problem::DisallowedType {
                name,
                allowed,
                found,
            } => write!(
                f,
                "tensor `{name}`: expected type {}, found {found}",
                types(allowed)
            ),
            Problem::NotWholeBlocks { name, ty, ne0 } => write!(
                f,
                "tensor `{name}`: ne0 = {ne0} is not a multiple of the {ty} block size {}",
                ty.block_size()
            ),
            Problem::UnexpectedTensor { name } => {
                write!(f, "tensor `{name}` is not part of the schema")
            }
        }
    }
}

/// Every way a checkpoint departs from its architecture's schema.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{}", render(problems))]
pub struct SchemaError {
    pub problems: Vec<Problem>,
}

fn render(problems: &[Problem]) -> String {
    let mut s = format!(
        "checkpoint does not match its architecture's schema ({} problem{}):",
        problems.len(),
        if problems.len() == 1 { "" } else { "s" }
    );
    for p in problems {
        s.push_str("\n  - ");
        s.push_str(&p.to_string());
    }
    s
}

/// The block index of a `blk.N.` tensor name.
fn block_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// Checks metadata and tensors against the schema of the file's architecture and returns its
/// hyper-parameters; `tensor_table` gives the architecture's tensors for those hyper-parameters.
/// When keys are missing the tensor shapes cannot be computed, so only the key problems are
/// reported. NextN blocks (`blk.N` with `n_layer <= N < n_block`) are optional and ignored:
/// the next-token forward never reads them.
pub fn check(
    meta: &Metadata,
    tensors: &[TensorInfo],
    tensor_table: impl FnOnce(&HParams) -> Vec<TensorRule>,
) -> Result<HParams, SchemaError> {
    let h = HParams::from_metadata(meta)?;
    let mut problems = Vec::new();
    let present: HashMap<&str, &TensorInfo> =
        tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let in_nextn_block =
        |name: &str| block_of(name).is_some_and(|b| b >= h.n_layer && b < h.n_block);
    let rules = tensor_table(&h);
    let expected: HashSet<&str> = rules.iter().map(|r| r.name.as_str()).collect();
    for rule in rules.iter().filter(|r| !in_nextn_block(&r.name)) {
        let Some(t) = present.get(rule.name.as_str()) else {
            problems.push(Problem::MissingTensor {
                name: rule.name.clone(),
                ne: rule.ne.clone(),
                allowed: rule.allowed,
            });
            continue;
        };
        if t.ne != rule.ne {
            problems.push(Problem::WrongShape {
                name: rule.name.clone(),
                expected: rule.ne.clone(),
                found: t.ne.clone(),
            });
        }
        if !rule.allowed.contains(&t.ty) {
            problems.push(Problem::DisallowedType {
                name: rule.name.clone(),
                allowed: rule.allowed,
                found: t.ty,
            });
        }
        let ne0 = t.ne.first().copied().unwrap_or(1);
        if ne0 % t.ty.block_size() as u64 != 0 {
            problems.push(Problem::NotWholeBlocks {
                name: rule.name.clone(),
                ty: t.ty,
                ne0,
            });
        }
    }
    for t in tensors {
        if !expected.contains(t.name.as_str()) && !in_nextn_block(&t.name) {
            problems.push(Problem::UnexpectedTensor {
                name: t.name.clone(),
            });
        }
    }
    if problems.is_empty() {
        Ok(h)
    } else {
        Err(SchemaError { problems })
    }
}
