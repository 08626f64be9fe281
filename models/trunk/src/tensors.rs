//! The trunk's tensors (spec §2): names, shapes, the types a checkpoint may store them in, the
//! release's type, and how `make-model` draws their values. The schema check and the synthetic
//! writer both read this one table.
//!
//! The draws keep activations O(1) through every block: a matrix with input width `in` (its
//! `ne0`) is N(0, 1/in), so a unit-RMS input gives a unit-RMS output; norms are ≈ 1; router
//! logits are ≈ N(0, 1), far apart relative to float noise; `exp_probs_b` is small (std 0.02).

use loader::GgmlType::{self, BF16, F32, IQ4_NL, Q6_K};
use loader::hparams::{ExpertGating, HParams};
use loader::schema::{ANY, F32_ONLY, FLOAT, Init, TensorRule};

const NORM: Init = Init::Around {
    mean: 1.0,
    std: 0.05,
};

/// An embedding row is read as it is, so its values are unit-variance.
const EMBEDDING: Init = Init::Normal { std: 1.0 };

fn linear(fan_in: usize) -> Init {
    Init::Normal {
        std: 1.0 / (fan_in as f32).sqrt(),
    }
}

struct Table(Vec<TensorRule>);

impl Table {
    fn push(
        &mut self,
        name: String,
        ne: &[usize],
        allowed: &'static [GgmlType],
        release: GgmlType,
        init: Init,
    ) {
        self.0
            .push(TensorRule::new(name, ne, allowed, release, init));
    }

    fn matrix(&mut self, name: String, ne: &[usize], release: GgmlType) {
        self.push(name, ne, ANY, release, linear(ne[0]));
    }

    fn norm(&mut self, name: String, len: usize) {
        self.push(name, &[len], F32_ONLY, F32, NORM);
    }
}

/// Every tensor of a checkpoint of the trunk, in file order. `own_block_tensors(layer)` are the
/// architecture's own tensors of trunk block `layer`, which lead that block's. Blocks
/// `n_layer..n_block` are NextN (MTP) blocks: attention + MoE, plus the six `nextn.*` tensors.
pub fn tensors(
    h: &HParams,
    own_block_tensors: impl Fn(usize) -> Vec<TensorRule>,
) -> Vec<TensorRule> {
    let mut t = Table(Vec::new());
    let e = h.n_embd;
    t.push(
        "token_embd.weight".into(),
        &[e, h.n_vocab],
        ANY,
        BF16,
        EMBEDDING,
    );
    for i in 0..h.n_block {
        let b = |s: &str| format!("blk.{i}.{s}");
        let nextn = i >= h.n_layer;
        if !nextn {
            t.0.extend(own_block_tensors(i));
        }
        let qk = h.qk_nope + h.qk_rope;
        t.norm(b("attn_norm.weight"), e);
        if h.q_lora_rank > 0 {
            t.matrix(b("attn_q_a.weight"), &[e, h.q_lora_rank], BF16);
            t.norm(b("attn_q_a_norm.weight"), h.q_lora_rank);
            t.matrix(b("attn_q_b.weight"), &[h.q_lora_rank, h.n_head * qk], BF16);
        } else {
            t.matrix(b("attn_q.weight"), &[e, h.n_head * qk], BF16);
        }
        let kv_a = [e, h.kv_lora_rank + h.qk_rope];
        t.matrix(b("attn_kv_a_mqa.weight"), &kv_a, BF16);
        t.norm(b("attn_kv_a_norm.weight"), h.kv_lora_rank);
        let k_b = [h.qk_nope, h.kv_lora_rank, h.n_head];
        t.matrix(b("attn_k_b.weight"), &k_b, BF16);
        let v_b = [h.kv_lora_rank, h.v_head, h.n_head];
        t.matrix(b("attn_v_b.weight"), &v_b, BF16);
        t.matrix(b("attn_output.weight"), &[h.n_head * h.v_head, e], BF16);
        t.norm(b("ffn_norm.weight"), e);
        if h.is_dense(i) {
            t.matrix(b("ffn_gate.weight"), &[e, h.n_ff], IQ4_NL);
            t.matrix(b("ffn_up.weight"), &[e, h.n_ff], IQ4_NL);
            t.matrix(b("ffn_down.weight"), &[h.n_ff, e], IQ4_NL);
        } else {
            let (f, n) = (h.n_ff_exp, h.n_expert);
            t.push(b("ffn_gate_inp.weight"), &[e, n], FLOAT, F32, linear(e));
            // The selection bias of sigmoid (noaux_tc) routing; softmax-routed checkpoints
            // (DeepSeek-V2) have none.
            if h.expert_gating == ExpertGating::Sigmoid {
                let bias = Init::Normal { std: 0.02 };
                t.push(b("exp_probs_b.bias"), &[n], F32_ONLY, F32, bias);
            }
            t.matrix(b("ffn_gate_exps.weight"), &[e, f, n], IQ4_NL);
            t.matrix(b("ffn_up_exps.weight"), &[e, f, n], IQ4_NL);
            t.matrix(b("ffn_down_exps.weight"), &[f, e, n], IQ4_NL);
            if h.n_expert_shared > 0 {
                let fs = f * h.n_expert_shared;
                t.matrix(b("ffn_gate_shexp.weight"), &[e, fs], IQ4_NL);
                t.matrix(b("ffn_up_shexp.weight"), &[e, fs], IQ4_NL);
                t.matrix(b("ffn_down_shexp.weight"), &[fs, e], IQ4_NL);
            }
        }
        if nextn {
            t.matrix(b("nextn.eh_proj.weight"), &[2 * e, e], IQ4_NL);
            t.norm(b("nextn.enorm.weight"), e);
            t.norm(b("nextn.hnorm.weight"), e);
            let embed_tokens = b("nextn.embed_tokens.weight");
            t.push(embed_tokens, &[e, h.n_vocab], ANY, IQ4_NL, EMBEDDING);
            t.matrix(b("nextn.shared_head_head.weight"), &[e, h.n_vocab], IQ4_NL);
            t.norm(b("nextn.shared_head_norm.weight"), e);
        }
    }
    t.norm("output_norm.weight".into(), e);
    t.matrix("output.weight".into(), &[e, h.n_vocab], Q6_K);
    t.0
}
