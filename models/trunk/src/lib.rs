//! The DeepSeek-V2/V3 trunk: MLA attention over an absorbed latent cache and a sigmoid-routed
//! MoE with a shared expert. `deepseek2` puts it on an ordinary residual and Xing4.0 wraps it in
//! hyper-connections, so its sub-layers are declared here once, for both.
//!
//! Declarations only: no kernels, no loops over data. [`tensors`] is the trunk's part of an
//! architecture's tensor table.

mod tensors;

pub use tensors::tensors;

use graph::{GraphBuilder, GraphError, StepShape, ValueId};
use loader::hparams::{ExpertGating, HParams};
use ops::TensorMeta;
use ops::elementwise::{Add, SwiGlu};
use ops::embedding::Embedding;
use ops::head::SliceRows;
use ops::linear::Linear;
use ops::mla::{KvCacheWrite, MlaAttention, MlaKv, MlaQuery, MlaValueOut};
use ops::moe::{ExpertDown, ExpertSwiGlu, RoutePlan, Router, TopKSum};
use ops::norm::RmsNorm;
use ops::rope::{RopeParams, Yarn, kq_scale};

/// The values a step's rows and sequences bring (see [`Trunk::inputs`]).
#[derive(Clone, Copy, Debug)]
pub struct StepInputs {
    pub tokens: ValueId,
    pub positions: ValueId,
    pub kv_slots: ValueId,
    pub block_table: ValueId,
    pub row_seq: ValueId,
}

/// The query projection's weights: low-rank with a norm between (`attn_q_a`, `attn_q_a_norm`,
/// `attn_q_b`), or one matrix (`attn_q`) where `q_lora_rank` is 0.
enum QueryWeights {
    LowRank {
        a: ValueId,
        norm: ValueId,
        b: ValueId,
    },
    Direct(ValueId),
}

/// The per-model constants every sub-layer declaration needs.
#[derive(Clone, Debug)]
pub struct Trunk {
    pub h: HParams,
    pub rope: RopeParams,
    pub kq_scale: f32,
}

impl Trunk {
    pub fn new(h: HParams) -> Trunk {
        let (rope, mscale_all_dim) = match &h.yarn {
            Some(y) => {
                // The header stores 0.1·mscale_all_dim (spec §1.1). HF's mscale is not in the
                // header: it equals mscale_all_dim in every DeepSeek-V2/V3 and Xing4.0 config
                // (checked at load against config.json), so cos/sin keep magnitude 1 and the
                // attention scale is mscale(factor, mscale_all_dim)², as HF computes them.
                let mscale_all_dim = y.log_multiplier / 0.1;
                let yarn = Yarn {
                    factor: y.factor,
                    n_ctx_orig: y.orig_ctx as usize,
                    beta_fast: y.beta_fast,
                    beta_slow: y.beta_slow,
                    mscale: if mscale_all_dim != 0.0 {
                        mscale_all_dim
                    } else {
                        1.0
                    },
                    mscale_all_dim,
                };
                (
                    RopeParams::yarn(h.rope_dim, h.rope_freq_base, &yarn),
                    mscale_all_dim,
                )
            }
            None => (
                RopeParams {
                    n_rot: h.rope_dim,
                    freq_base: h.rope_freq_base,
                    freq_scale: 1.0,
                    ext_factor: 0.0,
                    attn_factor: 1.0,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                    n_ctx_orig: h.n_ctx_train,
                },
                0.0,
            ),
        };
        // The scale uses the per-head qk width (192 in Xing4.0), not the absorbed 576.
        let kq_scale = kq_scale(&rope, mscale_all_dim, h.qk_nope + h.qk_rope);
        Trunk { h, rope, kq_scale }
    }

    /// Width of one cached row: the normalised latent and the shared rope key.
    pub fn kv_width(&self) -> usize {
        self.h.kv_lora_rank + self.h.qk_rope
    }

    /// Block `layer`'s weight `blk.{layer}.{name}.weight`.
    pub fn w(
        &self,
        b: &mut GraphBuilder<'_>,
        layer: usize,
        name: &str,
    ) -> Result<ValueId, GraphError> {
        b.weight(&format!("blk.{layer}.{name}.weight"))
    }

    /// `rms(x) · w`.
    pub fn rms(
        &self,
        b: &mut GraphBuilder<'_>,
        name: &str,
        x: ValueId,
        w: ValueId,
    ) -> Result<ValueId, GraphError> {
        b.op1(
            name,
            RmsNorm {
                eps: self.h.rms_eps,
            },
            &[x, w],
        )
    }

    /// The step's inputs: per row its token id, absolute position, cache slot (the pool row
    /// its latent goes to; negative for a padding row) and sequence; per sequence its block
    /// table.
    pub fn inputs(&self, b: &mut GraphBuilder<'_>, shape: &StepShape) -> StepInputs {
        let n = shape.bucket.n_tokens();
        StepInputs {
            tokens: b.input("tokens", TensorMeta::i32([n])),
            positions: b.input("positions", TensorMeta::i32([n])),
            kv_slots: b.input("kv_slots", TensorMeta::i32([n])),
            block_table: b.input(
                "block_table",
                TensorMeta::i32([shape.bucket.seqs(), shape.table_width()]),
            ),
            row_seq: b.input("row_seq", TensorMeta::i32([n])),
        }
    }

    /// `E[token]`, f32 `[n, n_embd]`.
    pub fn embed(&self, b: &mut GraphBuilder<'_>, tokens: ValueId) -> Result<ValueId, GraphError> {
        let table = b.weight("token_embd.weight")?;
        b.op1("token_embd", Embedding, &[table, tokens])
    }

    /// MLA attention of layer `layer` over `a = rms(x; attn_norm)` (spec §3.5), in the
    /// absorbed form: the cache row is the normalised latent ‖ the roped shared key.
    pub fn attention(
        &self,
        b: &mut GraphBuilder<'_>,
        layer: usize,
        a: ValueId,
        step: &StepInputs,
        shape: &StepShape,
    ) -> Result<ValueId, GraphError> {
        let h = &self.h;
        let positions = step.positions;
        // The layer's cache is the session's whole pool of blocks.
        let cache = b.state(
            &format!("blk.{layer}.kv"),
            TensorMeta::f32([shape.pool.rows(), self.kv_width()]),
        );
        // The query: through the low rank and its norm, or (q_lora_rank 0) directly.
        let w_q = if h.q_lora_rank > 0 {
            QueryWeights::LowRank {
                a: self.w(b, layer, "attn_q_a")?,
                norm: self.w(b, layer, "attn_q_a_norm")?,
                b: self.w(b, layer, "attn_q_b")?,
            }
        } else {
            QueryWeights::Direct(self.w(b, layer, "attn_q")?)
        };
        let w_kva = self.w(b, layer, "attn_kv_a_mqa")?;
        let w_kva_norm = self.w(b, layer, "attn_kv_a_norm")?;
        let w_kb = self.w(b, layer, "attn_k_b")?;
        let w_vb = self.w(b, layer, "attn_v_b")?;
        let w_o = self.w(b, layer, "attn_output")?;
        b.scope("attn", |b| {
            let q = match w_q {
                QueryWeights::LowRank {
                    a: w_qa,
                    norm,
                    b: w_qb,
                } => {
                    let qa = b.op1("q_a", Linear::default(), &[a, w_qa])?;
                    let qa = self.rms(b, "q_a_norm", qa, norm)?;
                    b.op1("q_b", Linear::default(), &[qa, w_qb])?
                }
                QueryWeights::Direct(w_q) => b.op1("q", Linear::default(), &[a, w_q])?,
            };
            let kv = b.op1("kv_a", Linear::default(), &[a, w_kva])?;
            let query = MlaQuery {
                n_head: h.n_head,
                qk_nope: h.qk_nope,
                qk_rope: h.qk_rope,
                kv_lora: h.kv_lora_rank,
                rope: self.rope,
                kernel: Default::default(),
            };
            let q_abs = b.op1("q_absorbed", query, &[q, w_kb, positions])?;
            // The cache row: the normalised latent ‖ the roped shared key, at its position.
            let kv_row = MlaKv {
                kv_lora: h.kv_lora_rank,
                qk_rope: h.qk_rope,
                eps: h.rms_eps,
                rope: self.rope,
            };
            let row = b.op1("kv_row", kv_row, &[kv, w_kva_norm, positions])?;
            let cache = b.op1("kv_to_cache", KvCacheWrite, &[cache, row, step.kv_slots])?;
            let attend = MlaAttention {
                n_head: h.n_head,
                kv_lora: h.kv_lora_rank,
                kq_scale: self.kq_scale,
                block_size: shape.pool.block_size,
                kernel: Default::default(),
            };
            let o_lat = b.op1(
                "attend",
                attend,
                &[q_abs, cache, positions, step.block_table, step.row_seq],
            )?;
            let v_out = MlaValueOut {
                n_head: h.n_head,
                kv_lora: h.kv_lora_rank,
                v_head: h.v_head,
                kernel: Default::default(),
            };
            let o = b.op1("v_out", v_out, &[o_lat, w_vb])?;
            b.op1("out", Linear::default(), &[o, w_o])
        })
    }

    /// `W_down · (silu(W_gate·z) ⊙ W_up·z)` over weights `{prefix}_{gate,up,down}{suffix}`.
    fn swiglu_ffn(
        &self,
        b: &mut GraphBuilder<'_>,
        layer: usize,
        suffix: &str,
        z: ValueId,
    ) -> Result<ValueId, GraphError> {
        let wg = self.w(b, layer, &format!("ffn_gate{suffix}"))?;
        let wu = self.w(b, layer, &format!("ffn_up{suffix}"))?;
        let wd = self.w(b, layer, &format!("ffn_down{suffix}"))?;
        let gate = b.op1("gate", Linear::default(), &[z, wg])?;
        let up = b.op1("up", Linear::default(), &[z, wu])?;
        let act = b.op1("act", SwiGlu, &[gate, up])?;
        b.op1("down", Linear::default(), &[act, wd])
    }

    /// The FFN of layer `layer` over `z = rms(x; ffn_norm)` (spec §3.7): dense for the
    /// leading blocks, otherwise routed experts (reproducible sum) plus the shared expert.
    pub fn ffn(
        &self,
        b: &mut GraphBuilder<'_>,
        layer: usize,
        z: ValueId,
    ) -> Result<ValueId, GraphError> {
        let h = &self.h;
        if layer < h.n_dense_lead {
            return b.scope("ffn", |b| self.swiglu_ffn(b, layer, "", z));
        }
        let w_router = self.w(b, layer, "ffn_gate_inp")?;
        let bias = match h.expert_gating {
            ExpertGating::Sigmoid => Some(b.weight(&format!("blk.{layer}.exp_probs_b.bias"))?),
            ExpertGating::Softmax => None,
        };
        let w_gate = self.w(b, layer, "ffn_gate_exps")?;
        let w_up = self.w(b, layer, "ffn_up_exps")?;
        let w_down = self.w(b, layer, "ffn_down_exps")?;
        b.scope("moe", |b| {
            let router = Router {
                n_expert: h.n_expert,
                top_k: h.n_expert_used,
                gating: h.expert_gating,
                norm_topk: h.expert_weights_norm,
                scale: h.expert_weights_scale,
                kernel: Default::default(),
            };
            let inputs: Vec<ValueId> = [z, w_router].into_iter().chain(bias).collect();
            let [ids, weights] = b.opn("router", router, &inputs)?;
            // Routes grouped by expert: where each expert's routes start, and each route's
            // token and top-k slot.
            let plan = RoutePlan {
                n_expert: h.n_expert,
                top_k: h.n_expert_used,
            };
            let [offsets, route_token, route_slot] = b.opn("routes", plan, &[ids])?;
            let experts = ExpertSwiGlu {
                n_expert: h.n_expert,
                n_ff: h.n_ff_exp,
                kernel: Default::default(),
            };
            let act = b.op1(
                "experts_act",
                experts,
                &[z, w_gate, w_up, offsets, route_token],
            )?;
            let down = ExpertDown {
                n_expert: h.n_expert,
                n_embd: h.n_embd,
                kernel: Default::default(),
            };
            let per_route = b.op1("experts_down", down, &[act, w_down, offsets])?;
            // The routed sum in top-k slot order (one writer an element: the same bits every run).
            let sum = TopKSum {
                top_k: h.n_expert_used,
                kernel: Default::default(),
            };
            let routed = b.op1("routed_sum", sum, &[per_route, route_slot, weights])?;
            if h.n_expert_shared == 0 {
                return Ok(routed);
            }
            let shared = b.scope("shared", |b| self.swiglu_ffn(b, layer, "_shexp", z))?;
            b.op1("plus_shared", Add, &[routed, shared])
        })
    }

    /// Final norm and lm head over `x` (`[n, n_embd]`): logits of every row, or of each
    /// sequence's last row (every row of a decode step, the last of a prefill chunk, the
    /// chunk's last and the decode rows of a mixed step).
    pub fn head(
        &self,
        b: &mut GraphBuilder<'_>,
        x: ValueId,
        shape: &StepShape,
    ) -> Result<ValueId, GraphError> {
        let n = shape.bucket.n_tokens();
        let rows = shape.logit_rows();
        let x = if rows < n {
            b.op1(
                "last_row",
                SliceRows {
                    start: shape.first_logit_row(),
                    len: rows,
                },
                &[x],
            )?
        } else {
            x
        };
        let w_norm = b.weight("output_norm.weight")?;
        let w_out = b.weight("output.weight")?;
        let normed = self.rms(b, "output_norm", x, w_norm)?;
        let logits = b.op1("logits", Linear::default(), &[normed, w_out])?;
        b.output("logits", logits);
        Ok(logits)
    }
}
