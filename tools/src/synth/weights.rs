//! The tensors of a synthetic checkpoint: names, shapes and storage types as the release
//! (spec §2), and how each one's random values are drawn.
//!
//! Scaling keeps activations O(1) through every block: a matrix with input width `in` is
//! N(0, 1/in), so a unit-RMS input gives a unit-RMS output; norms are ≈ 1; the hyper-connection
//! projection is small (its 24 mixes have std ≈ 0.5 for a normalised input) so the sigmoid
//! gates are not saturated; router logits are ≈ N(0, 1), far apart relative to float noise;
//! `exp_probs_b` is small (std 0.02).

use loader::GgmlType;
use loader::hparams::HParams;

use super::rng::{SplitMix64, name_key};

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// N(0, std²).
    Normal { std: f32 },
    /// `mean + std · N(0, 1)`.
    Around { mean: f32, std: f32 },
}

#[derive(Clone, Debug, PartialEq)]
pub struct PlannedTensor {
    pub name: String,
    pub ne: Vec<u64>,
    pub ty: GgmlType,
    pub init: Init,
}

impl PlannedTensor {
    pub fn row_len(&self) -> usize {
        self.ne.first().copied().unwrap_or(1) as usize
    }

    pub fn n_rows(&self) -> usize {
        self.ne.iter().skip(1).product::<u64>() as usize
    }

    /// Values of rows `rows` (each from its own stream, so any split of the rows across threads
    /// yields the same tensor).
    pub fn generate_rows(&self, seed: u64, rows: std::ops::Range<usize>, out: &mut [f32]) {
        let n = self.row_len();
        let key = name_key(&self.name);
        for (r, o) in rows.zip(out.chunks_exact_mut(n)) {
            let mut rng = SplitMix64::derive(seed, key, r as u64);
            rng.fill_normal(o);
            let (mean, std) = match self.init {
                Init::Normal { std } => (0.0, std),
                Init::Around { mean, std } => (mean, std),
            };
            for v in o.iter_mut() {
                *v = mean + std * *v;
            }
        }
    }
}

fn linear(fan_in: usize) -> Init {
    Init::Normal {
        std: 1.0 / (fan_in as f32).sqrt(),
    }
}

const NORM: Init = Init::Around {
    mean: 1.0,
    std: 0.05,
};

/// Every tensor of the checkpoint, in file order. Blocks `n_layer..n_block` are NextN (MTP)
/// blocks: attention + MoE without hyper-connections, plus the six `nextn.*` tensors.
pub fn plan(h: &HParams) -> Vec<PlannedTensor> {
    use GgmlType::{BF16, F32, IQ4_NL, Q6_K};
    let mut out = Vec::new();
    let mut t = |name: String, ne: &[usize], ty: GgmlType, init: Init| {
        out.push(PlannedTensor {
            name,
            ne: ne.iter().map(|&n| n as u64).collect(),
            ty,
            init,
        })
    };
    let e = h.n_embd;
    t(
        "token_embd.weight".into(),
        &[e, h.n_vocab],
        BF16,
        Init::Normal { std: 1.0 },
    );
    for i in 0..h.n_block {
        let b = |s: &str| format!("blk.{i}.{s}");
        let trunk = i < h.n_layer;
        if let Some(hc) = h.hc.filter(|_| trunk) {
            let mix = (2 + hc.count) * hc.count;
            for site in ["attn", "ffn"] {
                // m = Fn·f̂ with f̂ of unit RMS over count·e values: std 0.5.
                let fn_init = Init::Normal {
                    std: 0.5 / ((hc.count * e) as f32).sqrt(),
                };
                t(
                    b(&format!("hc_{site}_fn.weight")),
                    &[hc.count * e, mix],
                    BF16,
                    fn_init,
                );
                t(
                    b(&format!("hc_{site}_base.weight")),
                    &[mix],
                    F32,
                    Init::Normal { std: 0.5 },
                );
                t(
                    b(&format!("hc_{site}_scale.weight")),
                    &[3],
                    F32,
                    Init::Around {
                        mean: 1.0,
                        std: 0.2,
                    },
                );
            }
        }
        let qk = h.qk_nope + h.qk_rope;
        t(b("attn_norm.weight"), &[e], F32, NORM);
        t(b("attn_q_a.weight"), &[e, h.q_lora_rank], BF16, linear(e));
        t(b("attn_q_a_norm.weight"), &[h.q_lora_rank], F32, NORM);
        t(
            b("attn_q_b.weight"),
            &[h.q_lora_rank, h.n_head * qk],
            BF16,
            linear(h.q_lora_rank),
        );
        t(
            b("attn_kv_a_mqa.weight"),
            &[e, h.kv_lora_rank + h.qk_rope],
            BF16,
            linear(e),
        );
        t(b("attn_kv_a_norm.weight"), &[h.kv_lora_rank], F32, NORM);
        t(
            b("attn_k_b.weight"),
            &[h.qk_nope, h.kv_lora_rank, h.n_head],
            BF16,
            linear(h.qk_nope),
        );
        t(
            b("attn_v_b.weight"),
            &[h.kv_lora_rank, h.v_head, h.n_head],
            BF16,
            linear(h.kv_lora_rank),
        );
        t(
            b("attn_output.weight"),
            &[h.n_head * h.v_head, e],
            BF16,
            linear(h.n_head * h.v_head),
        );
        t(b("ffn_norm.weight"), &[e], F32, NORM);
        if h.is_dense(i) {
            t(b("ffn_gate.weight"), &[e, h.n_ff], IQ4_NL, linear(e));
            t(b("ffn_up.weight"), &[e, h.n_ff], IQ4_NL, linear(e));
            t(b("ffn_down.weight"), &[h.n_ff, e], IQ4_NL, linear(h.n_ff));
        } else {
            let (f, n) = (h.n_ff_exp, h.n_expert);
            t(b("ffn_gate_inp.weight"), &[e, n], F32, linear(e));
            t(b("exp_probs_b.bias"), &[n], F32, Init::Normal { std: 0.02 });
            t(b("ffn_gate_exps.weight"), &[e, f, n], IQ4_NL, linear(e));
            t(b("ffn_up_exps.weight"), &[e, f, n], IQ4_NL, linear(e));
            t(b("ffn_down_exps.weight"), &[f, e, n], IQ4_NL, linear(f));
            if h.n_expert_shared > 0 {
                let fs = f * h.n_expert_shared;
                t(b("ffn_gate_shexp.weight"), &[e, fs], IQ4_NL, linear(e));
                t(b("ffn_up_shexp.weight"), &[e, fs], IQ4_NL, linear(e));
                t(b("ffn_down_shexp.weight"), &[fs, e], IQ4_NL, linear(fs));
            }
        }
        if !trunk {
            t(
                b("nextn.eh_proj.weight"),
                &[2 * e, e],
                IQ4_NL,
                linear(2 * e),
            );
            t(b("nextn.enorm.weight"), &[e], F32, NORM);
            t(b("nextn.hnorm.weight"), &[e], F32, NORM);
            t(
                b("nextn.embed_tokens.weight"),
                &[e, h.n_vocab],
                IQ4_NL,
                Init::Normal { std: 1.0 },
            );
            t(
                b("nextn.shared_head_head.weight"),
                &[e, h.n_vocab],
                IQ4_NL,
                linear(e),
            );
            t(b("nextn.shared_head_norm.weight"), &[e], F32, NORM);
        }
    }
    t("output_norm.weight".into(), &[e], F32, NORM);
    t("output.weight".into(), &[e, h.n_vocab], Q6_K, linear(e));
    out
}
