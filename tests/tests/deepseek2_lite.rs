//! deepseek2 as DeepSeek-V2-Lite has it (`make-model --preset lite`): no low-rank query
//! (`attn_q`), softmax routing without a selection bias, top-6 routing, 2 shared experts, one
//! leading dense block, expert width 1,408, YaRN with mscale_all_dim 0.707. The full shapes are
//! checked as a table; a checkpoint of the same structure at small widths is run on the CPU
//! against `train/xing4.py`'s forward (reference/deepseek2-lite-shaped, written by
//! `python3 train/reference.py DIR --out tests/tests/reference/deepseek2-lite-shaped --prompt
//! "Hello world, the model reads text and code data."` on `make-model --arch deepseek2 --preset
//! lite --n-embd 256 --n-layer 3 --n-head 4 --kv-lora 64 --qk-nope 32 --v-head 32 --n-ff 512
//! --n-ff-exp 96 --n-expert 16 --vocab 2048`).

mod support;

use loader::GgmlType;
use loader::hparams::{Arch, ExpertGating};
use models::synth::{Dims, Preset, plan};

fn lite_shaped() -> Dims {
    let mut d = Dims::preset(Preset::Lite);
    d.n_embd = 256;
    d.n_layer = 3;
    d.n_head = 4;
    d.kv_lora = 64;
    d.qk_nope = 32;
    d.v_head = 32;
    d.n_ff = 512;
    d.n_ff_exp = 96;
    d.n_expert = 16;
    d.n_vocab = 2048;
    d
}

#[test]
fn the_lite_preset_has_deepseek_v2_lite_shapes() {
    let d = Dims::preset(Preset::Lite);
    let h = d.hparams(Arch::Deepseek2).unwrap();
    assert_eq!(
        (
            h.q_lora_rank,
            h.n_expert,
            h.n_expert_used,
            h.n_expert_shared
        ),
        (0, 64, 6, 2)
    );
    assert_eq!((h.n_dense_lead, h.n_ff_exp, h.n_vocab), (1, 1408, 102400));
    assert_eq!(h.expert_gating, ExpertGating::Softmax);
    assert!(!h.expert_weights_norm);
    let tensors = plan(&h);
    let find = |n: &str| tensors.iter().find(|t| t.name == n);
    let q = find("blk.0.attn_q.weight").expect("attn_q");
    assert_eq!(q.ne, vec![2048, 16 * 192]);
    assert!(find("blk.0.attn_q_a.weight").is_none());
    assert!(find("blk.1.exp_probs_b.bias").is_none());
    let gate = find("blk.1.ffn_gate_exps.weight").unwrap();
    assert_eq!(
        (gate.ne.clone(), gate.ty),
        (vec![2048, 1408, 64], GgmlType::IQ4_NL)
    );
    let shexp = find("blk.1.ffn_up_shexp.weight").unwrap();
    assert_eq!(shexp.ne, vec![2048, 2 * 1408]);
    let bytes: u64 = tensors
        .iter()
        .map(|t| t.ty.row_bytes(t.row_len()).unwrap() as u64 * t.n_rows() as u64)
        .sum();
    eprintln!("lite: {} tensors, {bytes} bytes", tensors.len());
    assert!((8_000_000_000..11_000_000_000).contains(&bytes), "{bytes}");
}

#[test]
fn a_lite_shaped_checkpoint_matches_the_pytorch_forward_on_the_cpu() {
    // (Its config.json passes the cross-check: mscale == mscale_all_dim.)
    let rel =
        support::cpu_against_oracle(Arch::Deepseek2, lite_shaped(), 1, "deepseek2-lite-shaped");
    eprintln!("lite-shaped: relative RMS against the PyTorch forward {rel:e}");
    // Both sides compute in f32 from the same dequantized weights: summation order only.
    assert!(rel < 1e-4, "relative RMS {rel:e}");
}
