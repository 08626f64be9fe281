//! The hyper-connection family's parity cases at the real width (hc = 4 streams of 3584):
//! `hc_pre`, `hc_pre_norm` and `hc_post_pre_norm` on the split-K partial pass (decode, and an
//! F32 `fn`) and the tensor-core rows pass (64 tokens, one and two chunks a warp), `hc_post`,
//! `hc_expand` and `stream_mean` at decode and prefill sizes. Inputs as the GPU tests'
//! `PreCase`: streams of magnitude 30, `fn` scaled so the mixes are O(1), scales that reach
//! the ±30 clamp. Then the stream counts a checkpoint may also have (hc = 1, 2, and 3 on the
//! run-time-count kernels) at a smaller width.
//!
//! Bounds. `hc_post`, `hc_expand`, `stream_mean`: [`NMSE_EXACT`] (the tests hold them
//! bit-identical). `hc_pre`: the tests give x, post and comb rel 1e-3 (x's abs part, 1e-4 of
//! max|H|, is ~2e-4 of x's rms): [`nmse_bound`]`(1e-3, 2e-4)`. The normed forms: x's abs part is
//! 1e-3 of max|w| = 2, against a normalised x of rms ~|w|'s 1.15: `nmse_bound(1e-3, 1.8e-3)`.

use half::bf16;

use super::{
    HcExpand, HcPost, HcPostPreNorm, HcPre, HcPreKernel, HcPreNorm, HcRoutedPostPreNorm, StreamMean,
};
use crate::moe::{TopKKernel, TopKSum};
use crate::parity::{HostValue, ParityCase, Rng, uniform};
use crate::parity::{NMSE_EXACT, nmse_bound};
use crate::tensor::{DType, TensorMeta};

const HC: usize = 4;
const D: usize = 3584;

fn pre(kernel: HcPreKernel, hc: usize) -> HcPre {
    HcPre {
        hc,
        sinkhorn_iters: 20,
        rms_eps: 1e-6,
        hc_eps: 1e-6,
        clamp: 30.0,
        kernel,
    }
}

/// H, fn, base and scale for `n` tokens of `hc` streams of `d` (the GPU tests'
/// `PreCase::random`).
fn pre_inputs(
    r: &mut Rng,
    (hc, d): (usize, usize),
    n: usize,
    dtype: DType,
    h_mag: f32,
) -> Vec<HostValue> {
    let (k, w) = (2 * hc + hc * hc, hc * d);
    let a = 2.0 / (w as f32).sqrt();
    let fnw = r.vec(k * w, -a, a);
    let fn_bytes: Vec<u8> = match dtype {
        DType::BF16 => fnw
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect(),
        _ => fnw.iter().flat_map(|v| v.to_le_bytes()).collect(),
    };
    let h = uniform(r, &[n, hc, d], -h_mag, h_mag);
    vec![
        h,
        HostValue::from_bytes(TensorMeta::new([k, w], dtype), &fn_bytes),
        uniform(r, &[k], -3.0, 3.0),
        HostValue::f32(
            [3],
            &[
                r.uniform(-3.0, 3.0),
                r.uniform(-3.0, 3.0),
                r.uniform(-20.0, 20.0),
            ],
        ),
    ]
}

fn label(kernel: HcPreKernel) -> String {
    match kernel {
        HcPreKernel::Rows { chunks_per_warp } => format!("rows x{chunks_per_warp}"),
        _ => "split-k".to_string(),
    }
}

pub fn cases() -> Vec<ParityCase> {
    let mut v = family((HC, D), "");
    for hc in [1, 2, 3] {
        v.extend(family((hc, 512), &format!(" hc={hc} D=512")));
    }
    v
}

/// Every case of the family for `hc` streams of width `d`; the rows pass only where it runs
/// (hc = 4). `tag` tells the shapes apart in the case names.
fn family((hc, d): (usize, usize), tag: &str) -> Vec<ParityCase> {
    let pre_bound = nmse_bound(1e-3, 2e-4);
    let norm_bound = nmse_bound(1e-3, 1.8e-3);
    let mut variants = vec![
        (HcPreKernel::SplitK, 1, DType::BF16),
        (HcPreKernel::SplitK, 9, DType::F32),
    ];
    if hc == HC {
        variants.extend([
            (HcPreKernel::Rows { chunks_per_warp: 1 }, 64, DType::BF16),
            (HcPreKernel::Rows { chunks_per_warp: 2 }, 64, DType::BF16),
            // A 32-row decode step (the lowering's threshold) and rows that fill no tile.
            (HcPreKernel::Rows { chunks_per_warp: 1 }, 32, DType::BF16),
            (HcPreKernel::Rows { chunks_per_warp: 1 }, 37, DType::BF16),
        ]);
    }
    let mut v = Vec::new();
    for (kernel, n, dtype) in variants {
        v.push(ParityCase::new(
            format!("hc_pre/{} {dtype} n={n}{tag}", label(kernel)),
            pre(kernel, hc),
            40 + n as u64,
            pre_bound,
            move |r| pre_inputs(r, (hc, d), n, dtype, 30.0),
        ));
        if dtype != DType::BF16 {
            continue;
        }
        v.push(ParityCase::new(
            format!("hc_pre_norm/{} n={n}{tag}", label(kernel)),
            HcPreNorm {
                pre: pre(kernel, hc),
                norm_eps: 1e-6,
            },
            0x5eed + n as u64,
            norm_bound,
            move |r| {
                let mut ins = pre_inputs(r, (hc, d), n, DType::BF16, 20.0);
                ins.push(uniform(r, &[d], -2.0, 2.0));
                ins
            },
        ));
        v.push(ParityCase::new(
            format!("hc_post_pre_norm/{} n={n}{tag}", label(kernel)),
            HcPostPreNorm {
                post: HcPost { hc },
                pre_norm: HcPreNorm {
                    pre: pre(kernel, hc),
                    norm_eps: 1e-6,
                },
            },
            0xfeed + n as u64,
            norm_bound,
            move |r| {
                let p = pre_inputs(r, (hc, d), n, DType::BF16, 20.0);
                let mut ins = vec![
                    uniform(r, &[n, d], -20.0, 20.0),
                    p[0].clone(),
                    uniform(r, &[n, hc], 0.0, 2.0),
                    uniform(r, &[n, hc, hc], 0.0, 1.0),
                ];
                ins.extend(p[1..].iter().cloned());
                ins.push(uniform(r, &[d], -2.0, 2.0));
                ins
            },
        ));
    }
    // The top-k sum formed inside the boundary: one token and nine (the pair kernel's 1- and
    // 8-token blocks, the second block ragged), and 32 rows (the rows pass: y formed first).
    let routed = [
        (HcPreKernel::SplitK, 1),
        (HcPreKernel::SplitK, 9),
        (HcPreKernel::Rows { chunks_per_warp: 1 }, 32),
    ];
    for (kernel, n) in routed.into_iter().filter(|_| hc == HC) {
        const TOP_K: usize = 4;
        v.push(ParityCase::new(
            format!("hc_routed_post_pre_norm/{} n={n}{tag}", label(kernel)),
            HcRoutedPostPreNorm {
                sum: TopKSum {
                    top_k: TOP_K,
                    kernel: TopKKernel::Scan,
                },
                boundary: HcPostPreNorm {
                    post: HcPost { hc },
                    pre_norm: HcPreNorm {
                        pre: pre(kernel, hc),
                        norm_eps: 1e-6,
                    },
                },
            },
            0xbead + n as u64,
            norm_bound,
            move |r| {
                let routes = n * TOP_K;
                let slots: Vec<i32> = r.distinct(routes, routes);
                let p = pre_inputs(r, (hc, d), n, DType::BF16, 20.0);
                let mut ins = vec![
                    uniform(r, &[routes, d], -20.0, 20.0),
                    HostValue::i32([routes], &slots),
                    uniform(r, &[n, TOP_K], 0.0, 0.5),
                    uniform(r, &[n, d], -5.0, 5.0),
                    p[0].clone(),
                    uniform(r, &[n, hc], 0.0, 2.0),
                    uniform(r, &[n, hc, hc], 0.0, 1.0),
                ];
                ins.extend(p[1..].iter().cloned());
                ins.push(uniform(r, &[d], -2.0, 2.0));
                ins
            },
        ));
    }
    for n in [1, 64] {
        v.push(ParityCase::new(
            format!("hc_post/n={n}{tag}"),
            HcPost { hc },
            7 + n as u64,
            NMSE_EXACT,
            move |r| {
                vec![
                    uniform(r, &[n, d], -20.0, 20.0),
                    uniform(r, &[n, hc, d], -20.0, 20.0),
                    uniform(r, &[n, hc], 0.0, 2.0),
                    uniform(r, &[n, hc, hc], 0.0, 1.0),
                ]
            },
        ));
        v.push(ParityCase::new(
            format!("hc_expand/n={n}{tag}"),
            HcExpand { hc },
            11 + n as u64,
            NMSE_EXACT,
            move |r| vec![uniform(r, &[n, d], -1e4, 1e4)],
        ));
        v.push(ParityCase::new(
            format!("stream_mean/n={n}{tag}"),
            StreamMean { hc },
            13 + n as u64,
            NMSE_EXACT,
            move |r| vec![uniform(r, &[n, hc, d], -1e5, 1e5)],
        ));
    }
    v
}
