//! Routed experts (spec §3.7, seed §4): router selection and weights, the CSR route plan,
//! the grouped expert path against a dense f64 loop, and the reproducibility regressions
//! carried over from the seed (`test_the_moe_does_not_narrow_its_own_sum`,
//! `test_the_grouped_kernel_is_bit_reproducible_at_top_four`,
//! `test_a_permuted_route_table_gives_the_same_answer`).

use half::f16;
use ops::moe::{
    ExpertDown, ExpertSwiGlu, Gating, NORM_GUARD, RoutePlan, Router, RouterRoutes, TopKSum,
};
use ops::{DType, OpError, TensorMeta};

mod support;
use ops::parity::Rng;
use support::{Buf, run};

impl Buf {
    fn i32s(&self) -> Vec<i32> {
        self.words.iter().map(|&w| w as i32).collect()
    }
}

fn sigmoid64(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

// ---- router --------------------------------------------------------------------------

/// Routes one token whose logits are exactly `logits` (D = 1, z = [1]).
fn route_one(router: &Router, logits: &[f32], bias: Option<&[f32]>) -> (Vec<i32>, Vec<f32>) {
    let z = Buf::f32(&[1, 1], &[1.0]);
    let w = Buf::f32(&[logits.len(), 1], logits);
    let b = bias.map(|b| Buf::f32(&[b.len()], b));
    let mut inputs = vec![&z, &w];
    if let Some(b) = &b {
        inputs.push(b);
    }
    let out = run(router, &inputs).unwrap();
    (out[0].i32s(), out[1].f32s())
}

fn sigmoid_router(n_expert: usize, top_k: usize, scale: f32) -> Router {
    Router {
        n_expert,
        top_k,
        gating: Gating::Sigmoid,
        norm_topk: true,
        scale,
        kernel: Default::default(),
    }
}

#[test]
fn the_router_selects_on_biased_scores_but_weights_with_unbiased_ones() {
    // p = σ([2, 1, 0, -1]) = [.881, .731, .5, .269]; the bias lifts expert 2 to 1.0, first.
    let (ids, w) = route_one(
        &sigmoid_router(4, 2, 2.0),
        &[2.0, 1.0, 0.0, -1.0],
        Some(&[0.0, 0.0, 0.5, 0.0]),
    );
    assert_eq!(ids, [2, 0]);
    let (p2, p0) = (sigmoid64(0.0), sigmoid64(2.0));
    let want = [p2 / (p2 + p0) * 2.0, p0 / (p2 + p0) * 2.0];
    for (g, w) in w.iter().zip(want) {
        assert!((*g as f64 - w).abs() < 1e-6, "{g} vs {w}");
    }
}

#[test]
fn router_ties_go_to_the_lower_expert_id() {
    let (ids, _) = route_one(&sigmoid_router(4, 3, 1.0), &[0.3; 4], None);
    assert_eq!(ids, [0, 1, 2]);
    let (ids, _) = route_one(
        &sigmoid_router(4, 2, 1.0),
        &[0.3; 4],
        Some(&[0.0, 0.25, 0.0, 0.25]),
    );
    assert_eq!(ids, [1, 3]);
}

#[test]
fn router_normalisation_is_floored_at_6_103515625e_5() {
    assert_eq!(NORM_GUARD as f64, 6.103515625e-5);
    let (ids, w) = route_one(
        &sigmoid_router(4, 2, 1.0),
        &[-20.0, -21.0, -22.0, -23.0],
        None,
    );
    assert_eq!(ids, [0, 1]);
    // Σp ≈ 2.8e-9 is below the floor, so the weights are p / 6.103515625e-5, not p / Σp.
    for (g, l) in w.iter().zip([-20.0, -21.0]) {
        let want = sigmoid64(l) / 6.103515625e-5;
        assert!((*g as f64 / want - 1.0).abs() < 1e-5, "{g} vs {want}");
    }
    assert!(w.iter().sum::<f32>() < 1e-4);
}

#[test]
fn router_softmax_gating_renormalises_the_chosen_probabilities() {
    let router = Router {
        n_expert: 3,
        top_k: 2,
        gating: Gating::Softmax,
        norm_topk: true,
        scale: 1.5,
        kernel: Default::default(),
    };
    // softmax([0, ln 2, ln 3]) = [1/6, 2/6, 3/6]; top-2 = [2, 1]; renormalised [.6, .4]; ×1.5.
    let (ids, w) = route_one(&router, &[0.0, 2f32.ln(), 3f32.ln()], None);
    assert_eq!(ids, [2, 1]);
    assert!(
        (w[0] - 0.9).abs() < 1e-6 && (w[1] - 0.6).abs() < 1e-6,
        "{w:?}"
    );
    let plain = Router {
        norm_topk: false,
        ..router
    };
    let (_, w) = route_one(&plain, &[0.0, 2f32.ln(), 3f32.ln()], None);
    assert!(
        (w[0] - 0.75).abs() < 1e-6 && (w[1] - 0.5).abs() < 1e-6,
        "{w:?}"
    );
}

// ---- route plan ----------------------------------------------------------------------

#[test]
fn the_route_plan_sorts_routes_by_expert_in_slot_order() {
    let plan = RoutePlan {
        n_expert: 3,
        top_k: 2,
    };
    let out = run(&plan, &[&Buf::i32(&[2, 2], &[2, 0, 0, 1])]).unwrap();
    assert_eq!(out[0].i32s(), [0, 2, 3, 4]);
    assert_eq!(out[1].i32s(), [0, 1, 1, 0]);
    assert_eq!(out[2].i32s(), [1, 2, 3, 0]);
}

#[test]
fn the_route_plan_refuses_an_expert_id_out_of_range() {
    let plan = RoutePlan {
        n_expert: 3,
        top_k: 2,
    };
    for bad in [3, -1] {
        match run(&plan, &[&Buf::i32(&[1, 2], &[0, bad])]) {
            Err(OpError::Data { op, msg }) => {
                assert_eq!(op, "route_plan");
                assert!(msg.contains(&format!("expert id {bad}")), "{msg}");
            }
            other => panic!("expected a data error, got {other:?}"),
        }
    }
}

#[test]
fn the_fused_router_routes_are_the_router_then_its_plan() {
    // Two tokens over four experts, top 2: token 0 picks [3, 1], token 1 picks [1, 0].
    let z = Buf::f32(&[2, 2], &[1.0, 0.0, 0.0, 1.0]);
    let w = Buf::f32(&[4, 2], &[-1.0, 0.5, 0.5, 2.0, 0.0, -1.0, 1.0, -2.0]);
    let router = sigmoid_router(4, 2, 1.0);
    let alone = run(&router, &[&z, &w]).unwrap();
    assert_eq!(alone[0].i32s(), [3, 1, 1, 0]);
    let plan = RoutePlan {
        n_expert: 4,
        top_k: 2,
    };
    let planned = run(&plan, &[&alone[0]]).unwrap();
    let fused = RouterRoutes {
        router: router.clone(),
        plan: plan.clone(),
    };
    let out = run(&fused, &[&z, &w]).unwrap();
    assert_eq!(out.len(), 5);
    assert_eq!(out[0].i32s(), alone[0].i32s());
    assert_eq!(out[1].f32s(), alone[1].f32s());
    for k in 0..3 {
        assert_eq!(out[2 + k].i32s(), planned[k].i32s(), "plan output {k}");
    }
    // A plan of another expert count is refused when the shapes are inferred.
    let mismatched = RouterRoutes {
        router,
        plan: RoutePlan {
            n_expert: 5,
            top_k: 2,
        },
    };
    assert!(run(&mismatched, &[&z, &w]).is_err());
}

#[test]
fn topk_sum_refuses_a_slot_table_that_is_not_a_permutation() {
    let op = TopKSum {
        top_k: 2,
        kernel: Default::default(),
    };
    let ro = Buf::f32(&[2, 1], &[1.0, 2.0]);
    let w = Buf::f32(&[1, 2], &[1.0, 1.0]);
    for slots in [[0, 0], [0, 2], [-1, 1]] {
        let err = run(&op, &[&ro, &Buf::i32(&[2], &slots), &w]).unwrap_err();
        assert!(
            matches!(err, OpError::Data { op: "topk_sum", .. }),
            "{err:?}"
        );
    }
}

#[test]
fn the_expert_ops_refuse_offsets_that_do_not_cover_the_routes() {
    let op = ExpertSwiGlu {
        n_expert: 2,
        n_ff: 1,
        kernel: Default::default(),
    };
    let z = Buf::f32(&[1, 1], &[1.0]);
    let wt = Buf::f32(&[2, 1, 1], &[1.0, 1.0]);
    let tok = Buf::i32(&[2], &[0, 0]);
    for off in [[0, 3, 2], [0, 1, 1], [1, 1, 2], [0, 1, 3]] {
        let err = run(&op, &[&z, &wt, &wt, &Buf::i32(&[3], &off), &tok]).unwrap_err();
        assert!(
            matches!(
                err,
                OpError::Data {
                    op: "expert_swiglu",
                    ..
                }
            ),
            "{off:?}: {err:?}"
        );
    }
    let err = run(
        &op,
        &[
            &z,
            &wt,
            &wt,
            &Buf::i32(&[3], &[0, 1, 2]),
            &Buf::i32(&[2], &[0, 1]),
        ],
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            OpError::Data {
                op: "expert_swiglu",
                ..
            }
        ),
        "{err:?}"
    );
    let down = ExpertDown {
        n_expert: 2,
        n_embd: 1,
        kernel: Default::default(),
    };
    let act = Buf::f32(&[2, 1], &[1.0, 1.0]);
    let err = run(&down, &[&act, &wt, &Buf::i32(&[3], &[0, 1, 1])]).unwrap_err();
    assert!(
        matches!(
            err,
            OpError::Data {
                op: "expert_down",
                ..
            }
        ),
        "{err:?}"
    );
}

// ---- the whole chain -----------------------------------------------------------------

struct Moe {
    router: Router,
    n_ff: usize,
    d: usize,
    router_w: Buf,
    bias: Option<Buf>,
    gate: Buf,
    up: Buf,
    down: Buf,
}

/// Every intermediate of one pass, for bit comparisons.
#[derive(Debug, PartialEq)]
struct Pass {
    ids: Vec<u32>,
    weights: Vec<u32>,
    act: Vec<u32>,
    route_out: Vec<u32>,
    out: Vec<u32>,
}

impl Moe {
    /// Router → RoutePlan → ExpertSwiGlu → ExpertDown → TopKSum.
    fn pass(&self, z: &[f32]) -> Pass {
        let n = z.len() / self.d;
        let z = Buf::f32(&[n, self.d], z);
        let mut rin = vec![&z, &self.router_w];
        if let Some(b) = &self.bias {
            rin.push(b);
        }
        let r = run(&self.router, &rin).unwrap();
        self.after_router(&z, &r[0], &r[1])
    }

    fn after_router(&self, z: &Buf, ids: &Buf, weights: &Buf) -> Pass {
        let (ne, k) = (self.router.n_expert, self.router.top_k);
        let plan = run(
            &RoutePlan {
                n_expert: ne,
                top_k: k,
            },
            &[ids],
        )
        .unwrap();
        self.with_plan(z, ids, weights, &plan[0], &plan[1], &plan[2])
    }

    fn with_plan(
        &self,
        z: &Buf,
        ids: &Buf,
        weights: &Buf,
        off: &Buf,
        tok: &Buf,
        slot: &Buf,
    ) -> Pass {
        let ne = self.router.n_expert;
        let sw = ExpertSwiGlu {
            n_expert: ne,
            n_ff: self.n_ff,
            kernel: Default::default(),
        };
        let act = run(&sw, &[z, &self.gate, &self.up, off, tok])
            .unwrap()
            .remove(0);
        let dn = ExpertDown {
            n_expert: ne,
            n_embd: self.d,
            kernel: Default::default(),
        };
        let ro = run(&dn, &[&act, &self.down, off]).unwrap().remove(0);
        let out = run(
            &TopKSum {
                top_k: self.router.top_k,
                kernel: Default::default(),
            },
            &[&ro, slot, weights],
        )
        .unwrap()
        .remove(0);
        Pass {
            ids: ids.words.clone(),
            weights: weights.words.clone(),
            act: act.words,
            route_out: ro.words,
            out: out.words,
        }
    }
}

/// Random IQ4_NL rows: an f16 scale in [0.002, 0.01) then 16 random bytes per 32 values.
fn iq4nl(rng: &mut Rng, shape: [usize; 3]) -> Buf {
    let blocks = shape.iter().product::<usize>() / 32;
    let mut bytes = Vec::with_capacity(blocks * 18);
    for _ in 0..blocks {
        let d = 0.006 + 0.004 * rng.unit();
        bytes.extend(f16::from_f32(d).to_le_bytes());
        bytes.extend((0..16).map(|_| rng.next_u64() as u8));
    }
    Buf::raw(TensorMeta::new(shape, DType::IQ4_NL), &bytes)
}

fn dequant(b: &Buf) -> Vec<f32> {
    let mut out = vec![0f32; b.meta.numel()];
    let bytes = &b.bytes()[..b.meta.bytes().unwrap()];
    loader::quant::dequantize(b.meta.dtype.ggml().unwrap(), bytes, &mut out).unwrap();
    out
}

fn random_moe(rng: &mut Rng, router: Router, d: usize, n_ff: usize, bias: bool) -> Moe {
    let ne = router.n_expert;
    Moe {
        router_w: Buf::f32(&[ne, d], &rng.unit_vec(ne * d)),
        bias: bias.then(|| {
            Buf::f32(
                &[ne],
                &(0..ne).map(|_| 0.3 * rng.unit()).collect::<Vec<_>>(),
            )
        }),
        gate: iq4nl(rng, [ne, n_ff, d]),
        up: iq4nl(rng, [ne, n_ff, d]),
        down: iq4nl(rng, [ne, d, n_ff]),
        router,
        n_ff,
        d,
    }
}

/// The same MoE as a dense f64 loop over each token's selected experts.
fn dense_f64(m: &Moe, z: &[f32]) -> (Vec<i32>, Vec<f64>) {
    let (ne, k, d, nf) = (m.router.n_expert, m.router.top_k, m.d, m.n_ff);
    let rw = m.router_w.f32s();
    let bias = m.bias.as_ref().map(|b| b.f32s());
    let (g, u, dn) = (dequant(&m.gate), dequant(&m.up), dequant(&m.down));
    let mut ids = Vec::new();
    let mut out = Vec::new();
    for zt in z.chunks_exact(d) {
        let logits: Vec<f64> = (0..ne)
            .map(|e| (0..d).map(|i| rw[e * d + i] as f64 * zt[i] as f64).sum())
            .collect();
        let p: Vec<f64> = match m.router.gating {
            Gating::Sigmoid => logits.iter().map(|&l| sigmoid64(l)).collect(),
            Gating::Softmax => {
                let mx = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let s: f64 = logits.iter().map(|l| (l - mx).exp()).sum();
                logits.iter().map(|l| (l - mx).exp() / s).collect()
            }
        };
        let sel: Vec<f64> = (0..ne)
            .map(|e| p[e] + bias.as_ref().map_or(0.0, |b| b[e] as f64))
            .collect();
        let mut order: Vec<usize> = (0..ne).collect();
        order.sort_by(|&a, &b| sel[b].partial_cmp(&sel[a]).unwrap().then(a.cmp(&b)));
        let top = &order[..k];
        let mut w: Vec<f64> = top.iter().map(|&e| p[e]).collect();
        if m.router.norm_topk {
            let s = w.iter().sum::<f64>().max(6.103515625e-5);
            w.iter_mut().for_each(|x| *x /= s);
        }
        w.iter_mut().for_each(|x| *x *= m.router.scale as f64);
        let mut o = vec![0f64; d];
        for (&e, &we) in top.iter().zip(&w) {
            let act: Vec<f64> = (0..nf)
                .map(|f| {
                    let row = (e * nf + f) * d;
                    let gv: f64 = (0..d).map(|i| g[row + i] as f64 * zt[i] as f64).sum();
                    let uv: f64 = (0..d).map(|i| u[row + i] as f64 * zt[i] as f64).sum();
                    gv * sigmoid64(gv) * uv
                })
                .collect();
            for (i, oi) in o.iter_mut().enumerate() {
                let row = (e * d + i) * nf;
                *oi += we * (0..nf).map(|f| dn[row + f] as f64 * act[f]).sum::<f64>();
            }
        }
        ids.extend(top.iter().map(|&e| e as i32));
        out.extend(o);
    }
    (ids, out)
}

#[test]
fn the_moe_chain_matches_a_dense_f64_loop_over_the_selected_experts() {
    let configs = [
        (
            Router {
                n_expert: 8,
                top_k: 4,
                gating: Gating::Sigmoid,
                norm_topk: true,
                scale: 2.0,
                kernel: Default::default(),
            },
            true,
        ),
        (
            Router {
                n_expert: 6,
                top_k: 2,
                gating: Gating::Softmax,
                norm_topk: false,
                scale: 1.0,
                kernel: Default::default(),
            },
            false,
        ),
    ];
    for (seed, (router, bias)) in configs.into_iter().enumerate() {
        let mut rng = Rng(0x3e0 + seed as u64);
        let m = random_moe(&mut rng, router, 64, 32, bias);
        let z = rng.unit_vec(7 * 64);
        let got = m.pass(&z);
        let (ids, want) = dense_f64(&m, &z);
        assert_eq!(got.ids.iter().map(|&w| w as i32).collect::<Vec<_>>(), ids);
        let mag = want.iter().fold(1e-3f64, |a, &b| a.max(b.abs()));
        for (g, w) in got.out.iter().zip(&want) {
            let g = f32::from_bits(*g) as f64;
            assert!((g - w).abs() <= 1e-5 * mag, "{g} vs {w} (max {mag})");
        }
    }
}

#[test]
fn the_moe_does_not_narrow_its_own_sum() {
    // z = 1, gate = up = 10 → g = u = 320 → act = silu(320)·320 = 102400 (> f16's 65504);
    // down of expert e = e+1 → route out = 32·102400·(e+1), millions.
    let (ne, d, nf) = (4, 32, 32);
    let router = sigmoid_router(ne, 2, 2.0);
    let logits = [0.5f32, 2.0, -1.0, 1.0];
    let mut rw = vec![0f32; ne * d];
    for e in 0..ne {
        rw[e * d] = logits[e];
    }
    let stack = |f: &dyn Fn(usize) -> f32, rows: usize, cols: usize| {
        let v: Vec<f32> = (0..ne * rows * cols)
            .map(|i| f(i / (rows * cols)))
            .collect();
        Buf::f32(&[ne, rows, cols], &v)
    };
    let m = Moe {
        router,
        n_ff: nf,
        d,
        router_w: Buf::f32(&[ne, d], &rw),
        bias: None,
        gate: stack(&|_| 10.0, nf, d),
        up: stack(&|_| 10.0, nf, d),
        down: stack(&|e| (e + 1) as f32, d, nf),
    };
    let p = m.pass(&vec![1.0; d]);
    assert_eq!(p.ids, [1, 3]);
    assert!(p.act.iter().all(|&w| f32::from_bits(w) == 102400.0));
    let w: Vec<f64> = p
        .weights
        .iter()
        .map(|&w| f32::from_bits(w) as f64)
        .collect();
    let want = w[0] * 3276800.0 * 2.0 + w[1] * 3276800.0 * 4.0;
    for &o in &p.out {
        let o = f32::from_bits(o);
        assert!(o.is_finite() && o as f64 > f16::MAX.to_f64());
        assert!(
            (o as f64 / want - 1.0).abs() <= 2.0 * f32::EPSILON as f64,
            "{o} vs {want}"
        );
    }
}

#[test]
fn the_grouped_expert_path_is_bit_reproducible_at_top_four() {
    let mut rng = Rng(0xb175);
    let router = sigmoid_router(8, 4, 2.0);
    let m = random_moe(&mut rng, router, 64, 64, true);
    let z = rng.unit_vec(40 * 64);
    let first = m.pass(&z);
    assert_eq!(m.pass(&z), first, "a second run");
    for threads in [1, 2, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        assert_eq!(pool.install(|| m.pass(&z)), first, "{threads} threads");
    }
}

#[test]
fn a_permuted_route_table_gives_the_same_answer() {
    let mut rng = Rng(0x9e47);
    let m = random_moe(&mut rng, sigmoid_router(6, 4, 2.0), 32, 32, true);
    let n = 9;
    let z = rng.unit_vec(n * 32);
    let base = m.pass(&z);
    let zb = Buf::f32(&[n, 32], &z);
    let ids = Buf {
        meta: TensorMeta::i32([n, 4]),
        words: base.ids.clone(),
    };
    let wts = Buf {
        meta: TensorMeta::f32([n, 4]),
        words: base.weights.clone(),
    };

    // 1. Another valid order of the routes inside each expert's segment: each route is
    //    computed on its own and summed by slot, so the bits cannot move.
    let plan = run(
        &RoutePlan {
            n_expert: 6,
            top_k: 4,
        },
        &[&ids],
    )
    .unwrap();
    let off = plan[0].i32s();
    let (mut tok, mut slot) = (plan[1].i32s(), plan[2].i32s());
    for e in 0..6 {
        let r = off[e] as usize..off[e + 1] as usize;
        tok[r.clone()].reverse();
        slot[r].reverse();
    }
    let (tok, slot) = (Buf::i32(&[n * 4], &tok), Buf::i32(&[n * 4], &slot));
    let p = m.with_plan(&zb, &ids, &wts, &plan[0], &tok, &slot);
    assert_eq!(p.out, base.out);

    // 2. The tokens of the chunk in another order: each token's row keeps its bits.
    let perm: Vec<usize> = (0..n).map(|i| (i * 4 + 3) % n).collect();
    let zp: Vec<f32> = perm
        .iter()
        .flat_map(|&t| z[t * 32..(t + 1) * 32].to_vec())
        .collect();
    let p = m.pass(&zp);
    for (i, &t) in perm.iter().enumerate() {
        assert_eq!(
            p.out[i * 32..(i + 1) * 32],
            base.out[t * 32..(t + 1) * 32],
            "token {t}"
        );
    }

    // 3. At top-2 a token's two slots may swap: w0·r0 + w1·r1 = w1·r1 + w0·r0 exactly.
    let m2 = random_moe(&mut rng, sigmoid_router(6, 2, 2.0), 32, 32, true);
    let base2 = m2.pass(&z);
    let swap = |w: &[u32]| -> Vec<u32> { w.chunks_exact(2).flat_map(|c| [c[1], c[0]]).collect() };
    let ids2 = Buf {
        meta: TensorMeta::i32([n, 2]),
        words: swap(&base2.ids),
    };
    let wts2 = Buf {
        meta: TensorMeta::f32([n, 2]),
        words: swap(&base2.weights),
    };
    let slots = |ids: &Buf| {
        run(
            &RoutePlan {
                n_expert: 6,
                top_k: 2,
            },
            &[ids],
        )
        .unwrap()
        .remove(2)
    };
    let ids2_orig = Buf {
        meta: TensorMeta::i32([n, 2]),
        words: base2.ids.clone(),
    };
    assert_ne!(
        slots(&ids2).words,
        slots(&ids2_orig).words,
        "the route table did change"
    );
    let p = m2.after_router(&zb, &ids2, &wts2);
    assert_eq!(p.out, base2.out);
}
