//! The MoE family's parity cases: `router` on the split-K slices (decode) and the tiled
//! logits (prefill) at the real 64 experts, top 4, width 3584; `route_plan` over one to
//! several 1024-slot passes; `expert_swiglu` and `expert_down` on the GEMV (8 routes) and the
//! grouped GEMM (256 routes; `mma.sync` anywhere, `wgmma` only on compute capability 9.0) over
//! 16 IQ4_NL experts; `topk_sum` on the scan and the inverse table; `gate_up_swiglu` on its
//! one-launch decode kernel and the tensor-core chain. Route tables are the CPU `route_plan` of
//! router-like ids (distinct per token), so every consumer sees a consistent plan.
//!
//! Bounds, from the tests' tolerances against the outputs' expected rms (T = √n·rms(w)·rms(x),
//! a typical dot; SwiGLU outputs ~0.7·T²): router weights rel `1e-5 + 4·logit` and abs
//! `4·logit` (logit = `16·d·ε·rms(w)·rms(x)`) on weights of rms ~scale/top_k; the GEMV experts
//! `dot_tol` ([`nmse_f32_dot`]) and `swiglu_tol` (abs `2·T·dot_abs`); the grouped GEMM f16
//! rel 4e-3 with abs `6·2⁻¹¹·T` (down) and `8.4·T·6·2⁻¹¹·T` (SwiGLU); `route_plan` and
//! `topk_sum` [`NMSE_EXACT`] (I32 equality, the sum's roundings repeated); `gate_up_swiglu`'s
//! decode kernel `swiglu_tol`, its tensor-core chain two BF16-narrowed products (2·4e-2 rel).

use half::f16;

use super::prefill::TcKernel;
use super::{
    ExpertDown, ExpertKernel, ExpertSwiGlu, GateUpSwiGlu, Gating, RoutePlan, Router, RouterKernel,
    RouterRoutes, TopKKernel, TopKSum,
};
use crate::linear::LinearKernel;
use crate::parity::{
    HostValue, NMSE_EXACT, ParityCase, Rng, cpu_outputs, nmse_bound, nmse_f32_dot, uniform, weight,
};
use crate::tensor::{DType, TensorMeta};

const NE: usize = 64;
const TOPK: usize = 4;
const EMBD: usize = 3584;
/// The expert cases' smaller stacks (the CPU reference stays quick).
const X_NE: usize = 16;
const X_D: usize = 1024;
const X_FF: usize = 512;
/// rms of U(−1, 1).
const U_RMS: f64 = 0.577_350_3;
/// Largest IQ4_NL scale the random expert weights use, and their rms.
const IQ4_D: f32 = 0.004;
const IQ4_WRMS: f64 = 0.004 / 1.732_050_8 * 67.44;
const EPS: f64 = f32::EPSILON as f64;

/// A stacked `[e, rows, cols]` IQ4_NL weight: random nibbles, a random f16 scale per block.
fn iq4_weight(r: &mut Rng, e: usize, rows: usize, cols: usize) -> HostValue {
    let meta = TensorMeta::new([e, rows, cols], DType::IQ4_NL);
    let len = meta.bytes().expect("whole blocks");
    let mut bytes = vec![0u8; len];
    for c in bytes.chunks_mut(8) {
        let v = r.next_u64().to_le_bytes();
        c.copy_from_slice(&v[..c.len()]);
    }
    for b in bytes.chunks_exact_mut(18) {
        let d = f16::from_f32(r.uniform(-IQ4_D, IQ4_D));
        b[..2].copy_from_slice(&d.to_le_bytes());
    }
    HostValue::from_bytes(meta, &bytes)
}

fn iq4_matrix(r: &mut Rng, rows: usize, cols: usize) -> HostValue {
    let w = iq4_weight(r, 1, rows, cols);
    HostValue::from_bytes(TensorMeta::new([rows, cols], DType::IQ4_NL), w.data.bytes())
}

/// Router-like ids for `n` tokens (distinct per token) and the CPU's plan of them: offsets,
/// route_token, route_slot.
fn plan_for(r: &mut Rng, n: usize, ne: usize, k: usize) -> Vec<HostValue> {
    let ids: Vec<i32> = (0..n).flat_map(|_| r.distinct(k, ne)).collect();
    cpu_outputs(
        &RoutePlan {
            n_expert: ne,
            top_k: k,
        },
        &[HostValue::i32([n, k], &ids)],
    )
}

fn swiglu_gemv_bound(n: usize) -> f64 {
    // abs 2·T·16·n·ε·w·x against 0.7·T², T = √n·w·x.
    nmse_bound(1e-5, 2.0 * 16.0 * (n as f64).sqrt() * EPS / 0.7)
}

fn expert_label(kernel: ExpertKernel) -> &'static str {
    match kernel {
        ExpertKernel::Gemv => "gemv",
        ExpertKernel::IntGemv => "int gemv",
        ExpertKernel::IntLanes { .. } => "int lanes",
        ExpertKernel::Skinny => "skinny",
        ExpertKernel::SkinnyInt => "skinny int",
        ExpertKernel::SkinnyIntDeep => "skinny int deep",
        ExpertKernel::SkinnyIntStaged => "skinny int staged",
        ExpertKernel::SkinnyIntStream { bulk: false } => "skinny int stream",
        ExpertKernel::SkinnyIntStream { bulk: true } => "skinny int stream bulk",
        ExpertKernel::Generic => "generic",
        ExpertKernel::Grouped(TcKernel::MmaSync) => "grouped mma.sync",
        _ => "grouped wgmma",
    }
}

fn router_cases(v: &mut Vec<ParityCase>) {
    let wmax = 1.0 / (EMBD as f32).sqrt();
    let logit = 16.0 * EMBD as f64 * EPS * (f64::from(wmax) / 3f64.sqrt()) * U_RMS;
    let scale = 2.0;
    // Normalised weights of rms about scale/top_k.
    let bound = nmse_bound(1e-5 + 4.0 * logit, 4.0 * logit / (scale / TOPK as f64));
    let router = |kernel, gating| Router {
        n_expert: NE,
        top_k: TOPK,
        gating,
        norm_topk: true,
        scale: scale as f32,
        kernel,
    };
    let inputs = move |n: usize| {
        move |r: &mut Rng| {
            vec![
                uniform(r, &[n, EMBD], -1.0, 1.0),
                uniform(r, &[NE, EMBD], -wmax, wmax),
                uniform(r, &[NE], -0.05, 0.05),
            ]
        }
    };
    for (kernel, n, gating) in [
        (RouterKernel::Slices, 1, Gating::Sigmoid),
        (RouterKernel::Slices, 4, Gating::Softmax),
        // Tiles of 4 tokens with a ragged last one, and a step of 64 sequences.
        (RouterKernel::Slices, 7, Gating::Sigmoid),
        (RouterKernel::Slices, 64, Gating::Sigmoid),
        (RouterKernel::Tiled, 64, Gating::Sigmoid),
        (RouterKernel::Tiled, 150, Gating::Softmax),
    ] {
        let name = if kernel == RouterKernel::Tiled {
            "tiled"
        } else {
            "slices"
        };
        v.push(ParityCase::new(
            format!("router/{name} {gating:?} n={n}"),
            router(kernel, gating),
            2024 + n as u64,
            bound,
            inputs(n),
        ));
    }
    // The fused selection and plan: one token, a few, one a warp, and more tokens than the
    // block's eight warps (each takes several in turn); the plan's I32 outputs exactly.
    for (n, gating) in [
        (1, Gating::Sigmoid),
        (3, Gating::Softmax),
        (8, Gating::Sigmoid),
        (33, Gating::Sigmoid),
    ] {
        v.push(ParityCase::new(
            format!("router_routes/slices {gating:?} n={n}"),
            RouterRoutes {
                router: router(RouterKernel::Slices, gating),
                plan: RoutePlan {
                    n_expert: NE,
                    top_k: TOPK,
                },
            },
            3024 + n as u64,
            bound,
            inputs(n),
        ));
    }
}

fn expert_cases(v: &mut Vec<ParityCase>) {
    let t_sw = (X_D as f64).sqrt() * IQ4_WRMS * U_RMS;
    let f16_dot = |n: usize| 6.0 / 2048.0 * (n as f64).sqrt() * IQ4_WRMS * U_RMS;
    for (kernel, n) in [
        (ExpertKernel::Gemv, 2),
        (ExpertKernel::Grouped(TcKernel::MmaSync), 64),
        (ExpertKernel::Grouped(TcKernel::Wgmma), 64),
    ] {
        let (sw_bound, down_bound) = if kernel == ExpertKernel::Gemv {
            (swiglu_gemv_bound(X_D), nmse_f32_dot(X_FF))
        } else {
            let t_down = (X_FF as f64).sqrt() * IQ4_WRMS * U_RMS;
            (
                nmse_bound(4e-3, 8.4 * t_sw * f16_dot(X_D) / (0.7 * t_sw * t_sw)),
                nmse_bound(4e-3, f16_dot(X_FF) / t_down),
            )
        };
        let wgmma = kernel == ExpertKernel::Grouped(TcKernel::Wgmma);
        let mut sw = ParityCase::new(
            format!("expert_swiglu/{} routes={}", expert_label(kernel), n * TOPK),
            ExpertSwiGlu {
                n_expert: X_NE,
                n_ff: X_FF,
                kernel,
            },
            8 + n as u64,
            sw_bound,
            move |r| {
                let plan = plan_for(r, n, X_NE, TOPK);
                vec![
                    uniform(r, &[n, X_D], -1.0, 1.0),
                    iq4_weight(r, X_NE, X_FF, X_D),
                    iq4_weight(r, X_NE, X_FF, X_D),
                    plan[0].clone(),
                    plan[1].clone(),
                ]
            },
        );
        let mut down = ParityCase::new(
            format!("expert_down/{} routes={}", expert_label(kernel), n * TOPK),
            ExpertDown {
                n_expert: X_NE,
                n_embd: X_D,
                kernel,
            },
            9 + n as u64,
            down_bound,
            move |r| {
                let plan = plan_for(r, n, X_NE, TOPK);
                vec![
                    uniform(r, &[n * TOPK, X_FF], -1.0, 1.0),
                    iq4_weight(r, X_NE, X_D, X_FF),
                    plan[0].clone(),
                ]
            },
        );
        if wgmma {
            sw = sw.only_on((9, 0));
            down = down.only_on((9, 0));
        }
        v.push(sw);
        v.push(down);
    }
}

/// Ids of `n` tokens, `k` distinct each: drawn from all `ne` experts, or (`crowd`) from the
/// first `k + 1` only, so those experts have many routes (several skinny tiles) and the rest
/// none.
fn ids_for(r: &mut Rng, n: usize, ne: usize, k: usize, crowd: bool) -> Vec<i32> {
    let pool = if crowd { (k + 1).min(ne) } else { ne };
    (0..n).flat_map(|_| r.distinct(k, pool)).collect()
}

/// The skinny grouped kernel (a decode step's few routes an expert) at M = 1, 2, 7, 32, 129 and
/// 512 routes over 16 experts: most experts have zero or one route at the small counts, many
/// at the large ones, and the crowded plans put every route on five experts. With `shared`
/// the launches carry the shared expert beside the routed ones (the lowering's shared-expert
/// fusion): its tiles follow the routed ones in the grid and read the tokens' rows (gate+up)
/// or their own activation rows after the routes' (down).
///
/// The integer GEMV (at most [`crate::moe::GEMV_ROUTES_LIMIT`] routes) takes the same cases up
/// to 32 routes, among them a crowded one, with its inputs quantized to 16 bits a value
/// (within the f16 inputs' bounds); the shared down projection of 7 tokens, 2 routes a round,
/// takes four rounds. The skinny kernel's integer path takes every case the f16 path does: its
/// 8-route tiles with one or two n8 tiles of routes, and the crowded and 512-route plans' experts
/// over many tiles.
fn grouped_expert_cases(v: &mut Vec<ParityCase>, kernel: ExpertKernel, shared: bool) {
    let t_sw = (X_D as f64).sqrt() * IQ4_WRMS * U_RMS;
    let t_down = (X_FF as f64).sqrt() * IQ4_WRMS * U_RMS;
    let f16_dot = |n: usize| 6.0 / 2048.0 * (n as f64).sqrt() * IQ4_WRMS * U_RMS;
    let sw_bound = nmse_bound(4e-3, 8.4 * t_sw * f16_dot(X_D) / (0.7 * t_sw * t_sw));
    let down_bound = nmse_bound(4e-3, f16_dot(X_FF) / t_down);
    let (label, mut seed_sw, mut seed_down) = if shared {
        (" +shared", 0x5e1, 0x5f1)
    } else {
        ("", 0x5c1, 0x5d1)
    };
    if kernel == ExpertKernel::IntGemv {
        seed_sw += 0x400;
        seed_down += 0x400;
    }
    if kernel == ExpertKernel::SkinnyInt {
        seed_sw += 0x800;
        seed_down += 0x800;
    }
    if kernel == ExpertKernel::SkinnyIntDeep {
        seed_sw += 0xc00;
        seed_down += 0xc00;
    }
    if kernel == ExpertKernel::SkinnyIntStaged {
        seed_sw += 0x1400;
        seed_down += 0x1400;
    }
    if let ExpertKernel::SkinnyIntStream { bulk } = kernel {
        let k = if bulk { 0x2000 } else { 0x1c00 };
        seed_sw += k;
        seed_down += k;
    }
    let gemv_only = matches!(
        kernel,
        ExpertKernel::IntGemv | ExpertKernel::IntLanes { .. }
    );
    if gemv_only && kernel != ExpertKernel::IntGemv {
        seed_sw += 0x1800;
        seed_down += 0x1800;
    }
    let name = expert_label(kernel);
    // The streamed kernel's bulk copies exist from compute capability 9.0.
    let on_its_card = move |c: ParityCase| {
        if matches!(kernel, ExpertKernel::SkinnyIntStream { .. }) {
            c.only_on((9, 0))
        } else {
            c
        }
    };
    for (n, k, crowd) in [
        (1, 1, false),
        (2, 1, false),
        (7, 1, false),
        (8, TOPK, false),
        (129, 1, false),
        (128, TOPK, false),
        (40, TOPK, true),
        (6, TOPK, true),
    ] {
        let routes = n * k;
        if gemv_only && routes > crate::moe::GEMV_ROUTES_LIMIT {
            continue;
        }
        // The skinny kernel's crowded case is the 160-route one.
        if kernel.is_skinny() && crowd && routes <= crate::moe::GEMV_ROUTES_LIMIT {
            continue;
        }
        let tag = if crowd { " crowded" } else { "" };
        let plan_of = move |r: &mut Rng| {
            let ids = ids_for(r, n, X_NE, k, crowd);
            cpu_outputs(
                &RoutePlan {
                    n_expert: X_NE,
                    top_k: k,
                },
                &[HostValue::i32([n, k], &ids)],
            )
        };
        v.push(on_its_card(ParityCase::new(
            format!("expert_swiglu/{name}{label} routes={routes}{tag}"),
            ExpertSwiGlu {
                n_expert: X_NE,
                n_ff: X_FF,
                kernel,
            },
            seed_sw + routes as u64,
            sw_bound,
            move |r| {
                let plan = plan_of(r);
                let mut ins = vec![
                    uniform(r, &[n, X_D], -1.0, 1.0),
                    iq4_weight(r, X_NE, X_FF, X_D),
                    iq4_weight(r, X_NE, X_FF, X_D),
                    plan[0].clone(),
                    plan[1].clone(),
                ];
                if shared {
                    ins.push(iq4_matrix(r, X_FF, X_D));
                    ins.push(iq4_matrix(r, X_FF, X_D));
                }
                ins
            },
        )));
        v.push(on_its_card(ParityCase::new(
            format!("expert_down/{name}{label} routes={routes}{tag}"),
            ExpertDown {
                n_expert: X_NE,
                n_embd: X_D,
                kernel,
            },
            seed_down + routes as u64,
            down_bound,
            move |r| {
                let plan = plan_of(r);
                let mut ins = vec![
                    uniform(r, &[routes, X_FF], -1.0, 1.0),
                    iq4_weight(r, X_NE, X_D, X_FF),
                    plan[0].clone(),
                ];
                if shared {
                    ins.push(uniform(r, &[n, X_FF], -1.0, 1.0));
                    ins.push(iq4_matrix(r, X_D, X_FF));
                }
                ins
            },
        )));
    }
}

/// The generic kernel on what the others cannot take: input widths that are not whole
/// 256-value chunks (DeepSeek-V2-Lite's 1,408 and small test models' 96 or 160) with 1, 2, 7,
/// 32 and 129 tokens' routes (experts with none, one and many routes), and expert weights
/// stored in the other types the CPU reads (a Q8_0 or BF16 quantization of a model, F16/F32
/// conversions, Q6_K) with 2 and 33 tokens' routes. IQ4_NL weights are drawn as the other
/// expert cases' (random nibbles and scales).
fn generic_expert_cases(v: &mut Vec<ParityCase>) {
    let kernel = ExpertKernel::Generic;
    let mut shapes: Vec<(DType, usize, usize, usize, u64)> = [
        (160, 96, 1),
        (160, 96, 2),
        (256, 1408, 7),
        (96, 160, 32),
        (160, 96, 129),
    ]
    .into_iter()
    .map(|(d, ff, n)| (DType::IQ4_NL, d, ff, n, 41))
    .collect();
    for (dtype, d, ff) in [
        (DType::Q8_0, 160, 96),
        (DType::BF16, 96, 64),
        (DType::F16, 64, 96),
        (DType::F32, 96, 32),
        (DType::Q6_K, 256, 512),
    ] {
        shapes.extend([2, 33].map(|n| (dtype, d, ff, n, 61)));
    }
    let stacked = |r: &mut Rng, dtype: DType, e: usize, rows: usize, cols: usize| match dtype {
        DType::IQ4_NL => iq4_weight(r, e, rows, cols),
        _ => weight(r, dtype, &[e, rows, cols]),
    };
    for (dtype, d, ff, n, seed) in shapes {
        let tag = if dtype == DType::IQ4_NL {
            String::new()
        } else {
            format!(" {dtype}")
        };
        v.push(ParityCase::new(
            format!(
                "expert_swiglu/generic{tag} d={d} ff={ff} routes={}",
                n * TOPK
            ),
            ExpertSwiGlu {
                n_expert: X_NE,
                n_ff: ff,
                kernel,
            },
            seed + n as u64,
            swiglu_gemv_bound(d),
            move |r| {
                let plan = plan_for(r, n, X_NE, TOPK);
                vec![
                    uniform(r, &[n, d], -1.0, 1.0),
                    stacked(r, dtype, X_NE, ff, d),
                    stacked(r, dtype, X_NE, ff, d),
                    plan[0].clone(),
                    plan[1].clone(),
                ]
            },
        ));
        v.push(ParityCase::new(
            format!("expert_down/generic{tag} d={d} ff={ff} routes={}", n * TOPK),
            ExpertDown {
                n_expert: X_NE,
                n_embd: d,
                kernel,
            },
            seed + 10 + n as u64,
            nmse_f32_dot(ff),
            move |r| {
                let plan = plan_for(r, n, X_NE, TOPK);
                vec![
                    uniform(r, &[n * TOPK, ff], -1.0, 1.0),
                    stacked(r, dtype, X_NE, d, ff),
                    plan[0].clone(),
                ]
            },
        ));
    }
}

pub fn cases() -> Vec<ParityCase> {
    let mut v = Vec::new();
    router_cases(&mut v);
    for kernel in [
        ExpertKernel::Skinny,
        ExpertKernel::SkinnyInt,
        ExpertKernel::SkinnyIntDeep,
        ExpertKernel::SkinnyIntStaged,
        ExpertKernel::SkinnyIntStream { bulk: false },
        ExpertKernel::SkinnyIntStream { bulk: true },
        ExpertKernel::IntGemv,
        ExpertKernel::IntLanes {
            weights_first: true,
        },
    ] {
        grouped_expert_cases(&mut v, kernel, false);
        grouped_expert_cases(&mut v, kernel, true);
    }
    int_lanes_width_cases(&mut v);
    for n in [1, 64, 600] {
        v.push(ParityCase::new(
            format!("route_plan/n={n} routes={}", n * TOPK),
            RoutePlan {
                n_expert: NE,
                top_k: TOPK,
            },
            31 + n as u64,
            NMSE_EXACT,
            move |r| {
                let ids: Vec<i32> = (0..n).flat_map(|_| r.distinct(TOPK, NE)).collect();
                vec![HostValue::i32([n, TOPK], &ids)]
            },
        ));
    }
    expert_cases(&mut v);
    generic_expert_cases(&mut v);
    for (kernel, n, shared) in [
        (TopKKernel::Scan, 1, true),
        (TopKKernel::Scan, 4, false),
        (TopKKernel::InverseTable, 200, true),
    ] {
        let name = if kernel == TopKKernel::Scan {
            "scan"
        } else {
            "inverse-table"
        };
        v.push(ParityCase::new(
            format!(
                "topk_sum/{name} n={n}{}",
                if shared { " +shared" } else { "" }
            ),
            TopKSum {
                top_k: TOPK,
                kernel,
            },
            77 + n as u64,
            NMSE_EXACT,
            move |r| {
                let plan = plan_for(r, n, NE, TOPK);
                let mut ins = vec![
                    uniform(r, &[n * TOPK, EMBD], -50.0, 50.0),
                    plan[2].clone(),
                    uniform(r, &[n, TOPK], 0.0, 2.0),
                ];
                if shared {
                    ins.push(uniform(r, &[n, EMBD], -50.0, 50.0));
                }
                ins
            },
        ));
    }
    let gemv = LinearKernel::Gemv {
        weights_first: true,
    };
    for (kernel, n) in [
        (gemv, 1),
        (gemv, 4),
        (LinearKernel::Skinny, 2),
        (LinearKernel::Skinny, 32),
        (LinearKernel::Skinny, 100),
        (LinearKernel::TensorCore, 100),
    ] {
        let (d, ff) = (EMBD, 1024);
        let (bound, name) = match kernel {
            LinearKernel::TensorCore => (nmse_bound(2.0 * 4e-2, 0.0), "tensor-core chain"),
            LinearKernel::Skinny => (nmse_bound(2.0 * 4e-3, 0.0), "skinny"),
            _ => (swiglu_gemv_bound(d), "gemv fused"),
        };
        v.push(ParityCase::new(
            format!("gate_up_swiglu/{name} IQ4_NL n={n}"),
            GateUpSwiGlu { kernel },
            0x5a + n as u64,
            bound,
            move |r| {
                vec![
                    uniform(r, &[n, d], -1.0, 1.0),
                    iq4_matrix(r, ff, d),
                    iq4_matrix(r, ff, d),
                ]
            },
        ));
    }
    v
}

/// The lane-chunk integer GEMV at the widths its warp layout turns on: the release's expert
/// (3,584 inputs to 1,024 SwiGLU outputs, 14 chunks a row so a warp has one gate and one up
/// row and four idle lanes; 1,024 back to 3,584, eight rows of four chunks a warp) and an odd
/// one (768 inputs, three chunks a row: five outputs a warp for SwiGLU, ten for the down
/// projection; 1,000 outputs, ending inside a block's tile), each with the shared expert
/// beside the routed ones, at one token's four routes and two tokens' eight on the same four
/// experts (two routes each: a round of two, or two rounds of one).
fn int_lanes_width_cases(v: &mut Vec<ParityCase>) {
    const NE: usize = 8;
    let kernel = ExpertKernel::IntLanes {
        weights_first: true,
    };
    let f16_dot = |n: usize| 6.0 / 2048.0 * (n as f64).sqrt() * IQ4_WRMS * U_RMS;
    // (SwiGLU inputs, its outputs, down inputs, its outputs)
    for (sw_in, sw_out, dn_in, dn_out) in [(EMBD, 1024, 1024, EMBD), (768, 1000, 768, 1000)] {
        let t_sw = (sw_in as f64).sqrt() * IQ4_WRMS * U_RMS;
        let t_down = (dn_in as f64).sqrt() * IQ4_WRMS * U_RMS;
        let sw_bound = nmse_bound(4e-3, 8.4 * t_sw * f16_dot(sw_in) / (0.7 * t_sw * t_sw));
        let down_bound = nmse_bound(4e-3, f16_dot(dn_in) / t_down);
        for n in [1usize, 2] {
            let routes = n * TOPK;
            let seed = 0x7100 + (sw_in + sw_out + n) as u64;
            // Every token on experts 0..TOPK: two tokens give each of them two routes.
            let same_experts = move || {
                let ids: Vec<i32> = (0..n).flat_map(|_| 0..TOPK as i32).collect();
                cpu_outputs(
                    &RoutePlan {
                        n_expert: NE,
                        top_k: TOPK,
                    },
                    &[HostValue::i32([n, TOPK], &ids)],
                )
            };
            v.push(ParityCase::new(
                format!("expert_swiglu/int lanes +shared {sw_in}→{sw_out} routes={routes}"),
                ExpertSwiGlu {
                    n_expert: NE,
                    n_ff: sw_out,
                    kernel,
                },
                seed,
                sw_bound,
                move |r| {
                    let plan = same_experts();
                    vec![
                        uniform(r, &[n, sw_in], -1.0, 1.0),
                        iq4_weight(r, NE, sw_out, sw_in),
                        iq4_weight(r, NE, sw_out, sw_in),
                        plan[0].clone(),
                        plan[1].clone(),
                        iq4_matrix(r, sw_out, sw_in),
                        iq4_matrix(r, sw_out, sw_in),
                    ]
                },
            ));
            v.push(ParityCase::new(
                format!("expert_down/int lanes +shared {dn_in}→{dn_out} routes={routes}"),
                ExpertDown {
                    n_expert: NE,
                    n_embd: dn_out,
                    kernel,
                },
                seed + 1,
                down_bound,
                move |r| {
                    let plan = same_experts();
                    vec![
                        uniform(r, &[routes, dn_in], -1.0, 1.0),
                        iq4_weight(r, NE, dn_out, dn_in),
                        plan[0].clone(),
                        uniform(r, &[n, dn_in], -1.0, 1.0),
                        iq4_matrix(r, dn_out, dn_in),
                    ]
                },
            ));
        }
    }
}
