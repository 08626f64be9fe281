//! The kernel variant an op carries is a CUDA-only choice: the CPU reference gives the same
//! bits on every variant (`Unlowered` included), a plan's text shows the variant once lowered
//! and nothing before, and the GPU tests' mirror of the lowering's defaults
//! (`support::*_for`) switches at the sizes `graph::LoweringOptions::default()` documents.
//! Needs no GPU.

use ops::hc::{HcPre, HcPreKernel};
use ops::linear::{GEMV_ROWS_LIMIT, Linear, LinearKernel, LinearPair, NormLinear};
use ops::mla::{AttentionPath, HEAD_GEMV_ROWS_LIMIT, HeadKernel, MlaAttention};
use ops::moe::{
    ExpertKernel, GEMV_ROUTES_LIMIT, GateUpSwiGlu, Gating, Router, RouterKernel, TopKKernel,
};
use ops::moe_prefill::TcKernel;
use ops::{DType, Op};

mod support;
use ops::parity::Rng;
use support::{
    ATTENTION_FLASH_MIN_ROWS, Buf, HC_ROWS_MIN_ROWS, ROUTER_TILED_MIN_ROWS, TOPK_INVERSE_MIN_ROWS,
    attention_for, expert_for, hc_pre_for, head_for, linear_for, router_for, run, topk_for,
};

const LINEAR_KERNELS: [LinearKernel; 4] = [
    LinearKernel::Unlowered,
    LinearKernel::Gemv {
        weights_first: true,
    },
    LinearKernel::Gemv {
        weights_first: false,
    },
    LinearKernel::TensorCore,
];

/// Every output of `op` on `inputs`, as bits.
fn bits(op: &dyn Op, inputs: &[&Buf]) -> Vec<Vec<u32>> {
    run(op, inputs)
        .unwrap_or_else(|e| panic!("{}: {e}", op.describe()))
        .into_iter()
        .map(|b| b.words)
        .collect()
}

#[test]
fn the_cpu_reference_gives_the_same_bits_on_every_kernel_variant() {
    let mut r = Rng(0x10e4);
    // Linear over 12 rows (more than the GEMV takes on the GPU: the CPU has no such limit).
    let (n, k, o) = (12, 64, 5);
    let x = Buf::f32(&[n, k], &r.unit_vec(n * k));
    let w = Buf::f32(&[o, k], &r.unit_vec(o * k));
    let want = bits(&Linear::default(), &[&x, &w]);
    assert!(want[0].iter().all(|&v| f32::from_bits(v).is_finite()));
    for kernel in LINEAR_KERNELS {
        assert_eq!(bits(&Linear::with(kernel), &[&x, &w]), want, "{kernel:?}");
    }

    // The router (sigmoid, biased, top-2 of 6) over 70 tokens, past the tiled kernel's start.
    let (n, d, ne) = (70, 16, 6);
    let z = Buf::f32(&[n, d], &r.unit_vec(n * d));
    let rw = Buf::f32(&[ne, d], &r.unit_vec(ne * d));
    let bias = Buf::f32(&[ne], &r.unit_vec(ne));
    let router = |kernel| Router {
        n_expert: ne,
        top_k: 2,
        gating: Gating::Sigmoid,
        norm_topk: true,
        scale: 2.5,
        kernel,
    };
    let want = bits(&router(RouterKernel::Unlowered), &[&z, &rw, &bias]);
    for kernel in [RouterKernel::Slices, RouterKernel::Tiled] {
        assert_eq!(bits(&router(kernel), &[&z, &rw, &bias]), want, "{kernel:?}");
    }

    // hc_pre at hc = 4 over 64 tokens of D = 32 (a shape the rows pass takes on the GPU).
    let (hc, n, d) = (4, 64, 32);
    let mixes = 2 * hc + hc * hc;
    let h = Buf::f32(&[n, hc, d], &r.unit_vec(n * hc * d));
    let f = Buf::f32(&[mixes, hc * d], &r.unit_vec(mixes * hc * d));
    let base = Buf::f32(&[mixes], &r.unit_vec(mixes));
    let scale = Buf::f32(&[3], &[0.5, -0.25, 2.0]);
    let pre = |kernel| HcPre {
        hc,
        sinkhorn_iters: 20,
        rms_eps: 1e-6,
        hc_eps: 1e-6,
        clamp: 30.0,
        kernel,
    };
    let want = bits(&pre(HcPreKernel::Unlowered), &[&h, &f, &base, &scale]);
    for kernel in [
        HcPreKernel::SplitK,
        HcPreKernel::Rows { chunks_per_warp: 1 },
        HcPreKernel::Rows { chunks_per_warp: 2 },
    ] {
        assert_eq!(
            bits(&pre(kernel), &[&h, &f, &base, &scale]),
            want,
            "{kernel:?}"
        );
    }
}

#[test]
fn describe_shows_the_variant_once_lowered_and_nothing_before() {
    // Unlowered ops describe themselves as before the variants existed.
    assert_eq!(Linear::default().describe(), "linear");
    assert_eq!(LinearPair::default().describe(), "linear_pair");
    assert_eq!(GateUpSwiGlu::default().describe(), "gate_up_swiglu");
    let lowered = [
        Linear::with(LinearKernel::TensorCore).describe(),
        Linear::with(LinearKernel::Gemv {
            weights_first: false,
        })
        .describe(),
        NormLinear {
            eps: 1e-6,
            kernel: LinearKernel::Gemv {
                weights_first: true,
            },
        }
        .describe(),
    ];
    for d in &lowered {
        assert!(d.contains(" ["), "{d}: no variant shown");
    }
    // Two variants of one op never describe alike.
    let mut all: Vec<String> = LINEAR_KERNELS
        .iter()
        .map(|&k| Linear::with(k).describe())
        .collect();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), LINEAR_KERNELS.len(), "{all:?}");
}

#[test]
fn the_lowering_mirror_switches_at_the_default_sizes() {
    let gemv = LinearKernel::Gemv {
        weights_first: true,
    };
    assert_eq!(linear_for(1), gemv);
    assert_eq!(linear_for(GEMV_ROWS_LIMIT), gemv);
    assert_eq!(linear_for(GEMV_ROWS_LIMIT + 1), LinearKernel::TensorCore);

    assert_eq!(head_for(HEAD_GEMV_ROWS_LIMIT), HeadKernel::Gemv);
    assert_eq!(head_for(HEAD_GEMV_ROWS_LIMIT + 1), HeadKernel::TensorCore);

    let hopper = (9, 0);
    assert_eq!(expert_for(GEMV_ROUTES_LIMIT, hopper), ExpertKernel::Gemv);
    assert_eq!(
        expert_for(GEMV_ROUTES_LIMIT + 1, hopper),
        ExpertKernel::Grouped(TcKernel::Wgmma)
    );
    for other in [(8, 0), (8, 9), (10, 0)] {
        assert_eq!(
            expert_for(GEMV_ROUTES_LIMIT + 1, other),
            ExpertKernel::Grouped(TcKernel::MmaSync),
            "compute capability {other:?}"
        );
    }

    assert_eq!(router_for(ROUTER_TILED_MIN_ROWS - 1), RouterKernel::Slices);
    assert_eq!(router_for(ROUTER_TILED_MIN_ROWS), RouterKernel::Tiled);
    assert_eq!(topk_for(TOPK_INVERSE_MIN_ROWS - 1), TopKKernel::Scan);
    assert_eq!(topk_for(TOPK_INVERSE_MIN_ROWS), TopKKernel::InverseTable);

    let pre = |hc| HcPre {
        hc,
        sinkhorn_iters: 20,
        rms_eps: 1e-6,
        hc_eps: 1e-6,
        clamp: 30.0,
        kernel: HcPreKernel::Unlowered,
    };
    let rows = HcPreKernel::Rows { chunks_per_warp: 1 };
    let p4 = pre(4);
    assert_eq!(hc_pre_for(&p4, HC_ROWS_MIN_ROWS, 3584, DType::BF16), rows);
    assert_eq!(
        hc_pre_for(&p4, HC_ROWS_MIN_ROWS - 1, 3584, DType::BF16),
        HcPreKernel::SplitK
    );
    // Shapes the rows pass does not take stay on split-K at any size.
    for (p, d, dtype) in [
        (&p4, 3584, DType::F32),
        (&p4, 3570, DType::BF16),
        (&pre(3), 3584, DType::BF16),
    ] {
        assert!(!p.rows_supports(d, dtype));
        assert_eq!(hc_pre_for(p, 4096, d, dtype), HcPreKernel::SplitK);
    }

    let att = MlaAttention {
        n_head: 32,
        kv_lora: 512,
        kq_scale: 0.1,
        block_size: 64,
        kernel: AttentionPath::Unlowered,
    };
    assert_eq!(
        attention_for(&att, ATTENTION_FLASH_MIN_ROWS, 576),
        AttentionPath::Flash
    );
    assert_eq!(
        attention_for(&att, ATTENTION_FLASH_MIN_ROWS - 1, 576),
        AttentionPath::SplitK
    );
    // A width the flash kernel does not take (rope of 32) stays on split-K.
    assert!(!att.flash_supports(544));
    assert_eq!(attention_for(&att, 4096, 544), AttentionPath::SplitK);
}
