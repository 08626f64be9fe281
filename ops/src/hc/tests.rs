use half::bf16;
use proptest::prelude::*;

use super::*;
use crate::norm::rms_norm_rows;
use crate::testkit::Rng;
use crate::testkit::*;

/// f32 unit roundoff.
const U: f64 = f32::EPSILON as f64 / 2.0;

fn hc_pre_op(hc: usize) -> HcPre {
    HcPre {
        hc,
        sinkhorn_iters: 20,
        rms_eps: 1e-6,
        hc_eps: 1e-6,
        clamp: 30.0,
        kernel: HcPreKernel::Unlowered,
    }
}

/// Inputs of one `hc_pre` call; `fnw` holds the stored values (bf16-exact when BF16).
struct Case {
    hc: usize,
    n: usize,
    d: usize,
    h: Vec<f32>,
    fnw: Vec<f32>,
    fn_dtype: DType,
    base: Vec<f32>,
    scale: Vec<f32>,
}

impl Case {
    fn random(seed: u64, hc: usize, n: usize, d: usize, fn_dtype: DType, h_mag: f32) -> Case {
        let mut r = Rng::new(seed);
        let (k, w) = (2 * hc + hc * hc, hc * d);
        // Mixes of order one (f̂ has unit RMS), so S2 up to 20 reaches the ±30 clamp.
        let a = 2.0 / (w as f32).sqrt();
        let mut fnw = r.vec(k * w, -a, a);
        if fn_dtype == DType::BF16 {
            fnw.iter_mut()
                .for_each(|v| *v = bf16::from_f32(*v).to_f32());
        }
        Case {
            hc,
            n,
            d,
            h: r.vec(n * w, -h_mag, h_mag),
            fnw,
            fn_dtype,
            base: r.vec(k, -3.0, 3.0),
            scale: vec![
                r.uniform(-3.0, 3.0),
                r.uniform(-3.0, 3.0),
                r.uniform(-20.0, 20.0),
            ],
        }
    }

    fn fn_tensor(&self) -> Owned {
        let (k, w) = (2 * self.hc + self.hc * self.hc, self.hc * self.d);
        let bytes: Vec<u8> = match self.fn_dtype {
            DType::BF16 => self
                .fnw
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
            _ => self.fnw.iter().flat_map(|v| v.to_le_bytes()).collect(),
        };
        Owned::from_bytes(TensorMeta::new([k, w], self.fn_dtype), &bytes)
    }

    fn streams(&self) -> Owned {
        Owned::f32([self.n, self.hc, self.d], &self.h)
    }

    /// (x, post, comb) through the op.
    fn run(&self, p: &HcPre) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let k = 2 * self.hc + self.hc * self.hc;
        let out = run(
            p,
            &[
                &self.streams(),
                &self.fn_tensor(),
                &Owned::f32([k], &self.base),
                &Owned::f32([3], &self.scale),
            ],
        )
        .unwrap();
        (out[0].to_f32(), out[1].to_f32(), out[2].to_f32())
    }
}

fn sig(z: f64) -> f64 {
    1.0 / (1.0 + (-z).exp())
}

/// Spec §3.2–3.4 for one token in f64, with the f32 error bound of each output.
struct RefPre {
    x: Vec<f64>,
    pre: Vec<f64>,
    post: Vec<f64>,
    comb: Vec<f64>,
    tol_x: Vec<f64>,
    tol_pre: Vec<f64>,
    tol_post: Vec<f64>,
    tol_comb: f64,
}

fn reference_pre(p: &HcPre, c: &Case, t: usize) -> RefPre {
    let (hc, d) = (c.hc, c.d);
    let (k, w) = (2 * hc + hc * hc, hc * d);
    let f: Vec<f64> = c.h[t * w..(t + 1) * w].iter().map(|&v| v as f64).collect();
    let r = 1.0 / (f.iter().map(|v| v * v).sum::<f64>() / w as f64 + p.rms_eps as f64).sqrt();
    let fh: Vec<f64> = f.iter().map(|v| v * r).collect();
    let (mut m, mut abs) = (vec![0f64; k], vec![0f64; k]);
    for kk in 0..k {
        for (&fw, &fh) in c.fnw[kk * w..(kk + 1) * w].iter().zip(&fh) {
            let term = fw as f64 * fh;
            m[kk] += term;
            abs[kk] += term.abs();
        }
    }
    let (b, s) = (&c.base, &c.scale);
    let z = |kk: usize, sc: f32| m[kk] * sc as f64 + b[kk] as f64;
    // f32 error of a mix: the dot's γ_w·Σ|Fn·f̂| plus ~8 roundings in forming f̂
    // (square, mean, eps, sqrt, divide, scale), all relative to the same Σ|Fn·f̂|.
    let e_z = |kk: usize, sc: f32| {
        let em = (w as f64 + 8.0) * U / (1.0 - w as f64 * U) * abs[kk];
        sc.abs() as f64 * em + 2.0 * U * (m[kk] * sc as f64).abs() + 2.0 * U * z(kk, sc).abs()
    };
    let pre: Vec<f64> = (0..hc).map(|i| sig(z(i, s[0]))).collect();
    // σ' ≤ 1/4; the f32 σ itself costs a few ulp of a value below 1.
    let tol_pre: Vec<f64> = (0..hc).map(|i| e_z(i, s[0]) / 4.0 + 4.0 * U).collect();
    let post: Vec<f64> = (0..hc).map(|i| 2.0 * sig(z(hc + i, s[1]))).collect();
    let tol_post: Vec<f64> = (0..hc).map(|i| e_z(hc + i, s[1]) / 2.0 + 8.0 * U).collect();
    let clamp = p.clamp as f64;
    let mut comb = vec![0f64; hc * hc];
    let mut e_log = 0f64;
    for dd in 0..hc {
        let l: Vec<f64> = (0..hc)
            .map(|ss| z(2 * hc + hc * dd + ss, s[2]).clamp(-clamp, clamp))
            .collect();
        let mx = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        for ss in 0..hc {
            comb[hc * dd + ss] = (l[ss] - mx).exp();
            // Error in the exponent: the logit's, the row max's, the subtraction's and exp's.
            let e = 2.0 * e_z(2 * hc + hc * dd + ss, s[2]) + U * (2.0 * (l[ss] - mx).abs() + 4.0);
            e_log = e_log.max(e);
        }
    }
    for _ in 0..p.sinkhorn_iters {
        for dd in 0..hc {
            let den = (0..hc).map(|ss| comb[hc * dd + ss]).sum::<f64>() + p.hc_eps as f64;
            (0..hc).for_each(|ss| comb[hc * dd + ss] /= den);
        }
        for ss in 0..hc {
            let den = (0..hc).map(|dd| comb[hc * dd + ss]).sum::<f64>() + p.hc_eps as f64;
            (0..hc).for_each(|dd| comb[hc * dd + ss] /= den);
        }
    }
    // Each normalisation divides by a weighted mean of the entries it scales, so a
    // relative perturbation of the entries is carried, not amplified (a few times
    // e_log at most), and each of the 2·iters normalisations adds ~(hc + 2) roundings.
    // Entries are at most ~1, so relative and absolute coincide.
    let tol_comb = 4.0 * e_log + 2.0 * p.sinkhorn_iters as f64 * (hc as f64 + 2.0) * U + 1e-7;
    let hs = |ss: usize, i: usize| c.h[t * w + ss * d + i] as f64;
    let x: Vec<f64> = (0..d)
        .map(|i| (0..hc).map(|ss| pre[ss] * hs(ss, i)).sum())
        .collect();
    let tol_x = (0..d)
        .map(|i| {
            (0..hc)
                .map(|ss| hs(ss, i).abs() * (tol_pre[ss] + (hc as f64 + 1.0) * U * pre[ss]))
                .sum()
        })
        .collect();
    RefPre {
        x,
        pre,
        post,
        comb,
        tol_x,
        tol_pre,
        tol_post,
        tol_comb,
    }
}

/// Compares one `hc_pre` run with the f64 reference; the `pre` gates are only
/// visible through `x`, so they are checked by recomputing them from the f32 path.
fn check_pre_against_f64(p: &HcPre, c: &Case) -> Result<(), TestCaseError> {
    let (hc, d) = (c.hc, c.d);
    let (x, post, comb) = c.run(p);
    for t in 0..c.n {
        let r = reference_pre(p, c, t);
        for i in 0..d {
            let got = x[t * d + i] as f64;
            prop_assert!(
                got.is_finite() && (got - r.x[i]).abs() <= r.tol_x[i],
                "x[{t}][{i}] = {got}, f64 {} (tol {:e})",
                r.x[i],
                r.tol_x[i]
            );
        }
        for i in 0..hc {
            let got = post[t * hc + i] as f64;
            prop_assert!(
                (got - r.post[i]).abs() <= r.tol_post[i],
                "post[{t}][{i}] = {got}, f64 {} (tol {:e})",
                r.post[i],
                r.tol_post[i]
            );
        }
        for i in 0..hc * hc {
            let got = comb[t * hc * hc + i] as f64;
            prop_assert!(
                got >= 0.0 && (got - r.comb[i]).abs() <= r.tol_comb,
                "comb[{t}][{i}] = {got}, f64 {} (tol {:e})",
                r.comb[i],
                r.tol_comb
            );
        }
        prop_assert!(
            r.pre
                .iter()
                .zip(&r.tol_pre)
                .all(|(p, e)| *p > -e && *p < 1.0 + e)
        );
    }
    Ok(())
}

fn pick_hc(i: usize) -> usize {
    [1, 2, 4][i]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn hc_pre_matches_an_f64_reading_of_the_spec(
        seed in any::<u64>(),
        hc_i in 0usize..3,
        d in 1usize..48,
        n in 1usize..4,
        bf in any::<bool>(),
        mag_exp in 0i32..6,
        iters in prop::sample::select(vec![0usize, 1, 20]),
        rms_eps in prop::sample::select(vec![1e-6f32, 0.5]),
        hc_eps in prop::sample::select(vec![1e-6f32, 0.05]),
        clamp in prop::sample::select(vec![30f32, 4.0]),
    ) {
        // Besides the model's parameters, large epsilons and a tight clamp, so that
        // where ε enters (denominators only; none in `pre`) and the clamp are visible
        // far above the f32 tolerance.
        let dtype = if bf { DType::BF16 } else { DType::F32 };
        let c = Case::random(seed, pick_hc(hc_i), n, d, dtype, 10f32.powi(mag_exp));
        let p = HcPre { hc: c.hc, sinkhorn_iters: iters, rms_eps, hc_eps, clamp, kernel: HcPreKernel::Unlowered };
        check_pre_against_f64(&p, &c)?;
    }

    #[test]
    fn hc_post_matches_f64_within_the_rounding_of_its_sum(
        seed in any::<u64>(),
        hc_i in 0usize..3,
        d in 1usize..48,
        n in 1usize..4,
    ) {
        let hc = pick_hc(hc_i);
        let c = Case::random(seed, hc, n, d, DType::F32, 100.0);
        let (_, post, comb) = c.run(&hc_pre_op(hc));
        let y = Rng::new(seed ^ 0x5eed).vec(n * d, -50.0, 50.0);
        let out = run(&HcPost { hc }, &[
            &Owned::f32([n, d], &y),
            &c.streams(),
            &Owned::f32([n, hc], &post),
            &Owned::f32([n, hc, hc], &comb),
        ]).unwrap()[0].to_f32();
        for t in 0..n {
            for dst in 0..hc {
                for i in 0..d {
                    let terms: Vec<f64> = std::iter::once(post[t * hc + dst] as f64 * y[t * d + i] as f64)
                        .chain((0..hc).map(|s| {
                            comb[t * hc * hc + hc * dst + s] as f64 * c.h[(t * hc + s) * d + i] as f64
                        }))
                        .collect();
                    let want: f64 = terms.iter().sum();
                    // hc + 1 products and hc adds in f32: γ_{hc+1}·Σ|terms|.
                    let tol = (hc as f64 + 2.0) * U * terms.iter().map(|v| v.abs()).sum::<f64>();
                    let got = out[(t * hc + dst) * d + i] as f64;
                    prop_assert!((got - want).abs() <= tol, "H'[{t}][{dst}][{i}] = {got}, f64 {want}");
                }
            }
        }
    }

    #[test]
    fn stream_mean_matches_f64(seed in any::<u64>(), hc_i in 0usize..3, d in 1usize..48, n in 1usize..4) {
        let hc = pick_hc(hc_i);
        let h = Rng::new(seed).vec(n * hc * d, -1e5, 1e5);
        let out = run(&StreamMean { hc }, &[&Owned::f32([n, hc, d], &h)]).unwrap()[0].to_f32();
        for t in 0..n {
            for i in 0..d {
                let vals = (0..hc).map(|s| h[(t * hc + s) * d + i] as f64);
                let want = vals.clone().sum::<f64>() / hc as f64;
                let tol = (hc as f64 + 1.0) * U * vals.map(f64::abs).sum::<f64>() / hc as f64;
                prop_assert!((out[t * d + i] as f64 - want).abs() <= tol);
            }
        }
    }
}

/// Largest |column sum − 1| and |row sum − 1| of the comb matrices over 50
/// random tokens whose comb logits are `base` drawn from ±`range`.
fn stochastic_defects(range: f32) -> (f64, f64) {
    let p = hc_pre_op(4);
    let mut worst = (0f64, 0f64);
    for seed in 0..50 {
        let mut c = Case::random(seed, 4, 2, 64, DType::BF16, 1.0);
        c.scale[2] = 0.0;
        let mut r = Rng::new(seed + 1000);
        c.base[8..]
            .iter_mut()
            .for_each(|b| *b = r.uniform(-range, range));
        let (_, _, comb) = c.run(&p);
        for m in comb.chunks_exact(16) {
            for j in 0..4 {
                let col: f64 = (0..4).map(|i| m[4 * i + j] as f64).sum();
                let row: f64 = (0..4).map(|s| m[4 * j + s] as f64).sum();
                worst = (
                    worst.0.max((col - 1.0).abs()),
                    worst.1.max((row - 1.0).abs()),
                );
            }
        }
    }
    worst
}

#[test]
fn sinkhorn_output_is_doubly_stochastic() {
    // Logits within ±1: 20 iterations converge, rows and columns sum to 1 − O(ε).
    let (col, row) = stochastic_defects(1.0);
    assert!(col <= 1e-5 && row <= 1e-5, "column {col:e}, row {row:e}");
}

#[test]
fn sinkhorn_columns_sum_to_one_even_where_rows_have_not_converged() {
    // The last normalisation is over destinations, so columns sum to S/(S + ε)
    // whatever the logits; with logits over ±3, 20 iterations leave rows off by up
    // to ~1e-2 (an f64 run of the same recurrence over 3000 draws: 9.2e-3).
    let (col, row) = stochastic_defects(3.0);
    assert!(col <= 1e-5, "column {col:e}");
    assert!(row <= 2e-2, "row {row:e}");
}

/// Streams `e_s` (stream `s` is the unit vector along `s`) and `fn = 0`, so the
/// logits are exactly `base`.
fn unit_streams_case(comb_base: &[(usize, usize, f32)]) -> Case {
    let hc = 4;
    let mut h = vec![0f32; hc * hc];
    (0..hc).for_each(|s| h[s * hc + s] = 1.0);
    let mut base = vec![0f32; 24];
    for &(d, s, v) in comb_base {
        base[8 + 4 * d + s] = v;
    }
    Case {
        hc,
        n: 1,
        d: hc,
        h,
        fnw: vec![0.0; 24 * 16],
        fn_dtype: DType::F32,
        base,
        scale: vec![1.0, 1.0, 1.0],
    }
}

#[test]
fn comb_flat_index_4d_plus_s_moves_source_s_into_destination_d() {
    // Only the logit at 4·d + s for (d, s) = (1, 3) is large: stream 3 must land in
    // stream 1. The transposed reading would put stream 1 into stream 3 instead.
    let c = unit_streams_case(&[(1, 3, 20.0)]);
    let (_, post, comb) = c.run(&hc_pre_op(4));
    // A lone large logit makes Sinkhorn converge slowly (the limit has zeros):
    // after 20 iterations the weight is ~0.96, not 1.
    assert!(comb[4 + 3] > 0.9 && comb[4 * 3 + 1] < 0.5, "comb {comb:?}");
    let new = run(
        &HcPost { hc: 4 },
        &[
            &Owned::f32([1, 4], &[0.0; 4]),
            &c.streams(),
            &Owned::f32([1, 4], &post),
            &Owned::f32([1, 4, 4], &comb),
        ],
    )
    .unwrap()[0]
        .to_f32();
    let stream = |d: usize| &new[4 * d..4 * d + 4];
    assert!(stream(1)[3] > 0.9, "stream 1 = {:?}", stream(1));
    assert!(
        stream(1)[..3].iter().all(|v| *v < 0.01),
        "stream 1 = {:?}",
        stream(1)
    );
    assert!(stream(3)[1] < 0.5, "stream 3 = {:?}", stream(3));
}

#[test]
fn comb_logits_beyond_the_clamp_act_as_the_clamp() {
    let beyond = unit_streams_case(&[(0, 2, 50.0), (2, 1, -45.0), (3, 3, 31.0)]);
    let at = unit_streams_case(&[(0, 2, 30.0), (2, 1, -30.0), (3, 3, 30.0)]);
    let p = hc_pre_op(4);
    let (b, a) = (beyond.run(&p), at.run(&p));
    assert_eq!(
        b.2.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        a.2.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    assert_eq!((b.0, b.1), (a.0, a.1));
    // Without the clamp the same logits give another matrix: the clamp is doing work.
    let loose = HcPre { clamp: 1000.0, ..p };
    assert_ne!(beyond.run(&loose).2, a.2);
}

#[test]
fn the_residual_stream_is_wider_than_the_sublayer_post_keeps_values_beyond_f16() {
    // Every value here is an exact f32 integer, so the f32 result is exact; 2e5 + 75000
    // is far outside f16 (65504), the width that produced NaN in the seed's §2.
    let (hc, d) = (4, 8);
    let y = vec![1e5f32; d];
    let h: Vec<f32> = (0..hc)
        .flat_map(|s| vec![6e4 + 1e4 * s as f32; d])
        .collect();
    let post = [1.5f32, 2.0, 0.5, 1.0];
    let out = run(
        &HcPost { hc },
        &[
            &Owned::f32([1, d], &y),
            &Owned::f32([1, hc, d], &h),
            &Owned::f32([1, hc], &post),
            &Owned::f32([1, hc, hc], &[0.25; 16]),
        ],
    )
    .unwrap()[0]
        .to_f32();
    for (dst, p) in post.iter().enumerate() {
        let want = p * 1e5 + 0.25 * (6e4 + 7e4 + 8e4 + 9e4);
        assert!(
            out[dst * d..(dst + 1) * d].iter().all(|v| *v == want),
            "stream {dst}"
        );
    }
    assert!(out.iter().all(|v| *v > 65504.0));
}

#[test]
fn the_residual_stream_is_wider_than_the_sublayer_pre_collapses_large_streams_like_f64() {
    let p = hc_pre_op(4);
    for seed in 0..8 {
        let mut c = Case::random(seed, 4, 2, 64, DType::BF16, 1.0);
        let mut r = Rng::new(seed + 100);
        // |H| in [6e4, 1e5], random sign: beyond f16 in every element.
        c.h.iter_mut()
            .for_each(|v| *v = r.uniform(6e4, 1e5).copysign(r.uniform(-1.0, 1.0)));
        check_pre_against_f64(&p, &c).unwrap();
        // The narrow half: what the sub-layer is handed after its norm is O(1).
        let (x, _, _) = c.run(&p);
        let mut y = vec![0f32; x.len()];
        rms_norm_rows(&x, None, c.d, 1e-6, &mut y);
        assert!(y.iter().all(|v| v.abs() <= (c.d as f32).sqrt()));
    }
}

#[test]
fn stream_mean_adds_streams_in_order_then_scales() {
    // ((1e8 + −1e8) + 1) + 0 = 1 → 0.25; a pairwise order would give (1e8+1) − 1e8 = 0.
    let out = run(
        &StreamMean { hc: 4 },
        &[&Owned::f32([1, 4, 1], &[1e8, -1e8, 1.0, 0.0])],
    )
    .unwrap();
    assert_eq!(out[0].to_f32(), vec![0.25]);
}

#[test]
fn hc_expand_copies_the_row_into_every_stream() {
    let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
    for hc in [1, 2, 4] {
        let out = run(&HcExpand { hc }, &[&Owned::f32([2, 3], &x)]).unwrap()[0].to_f32();
        for t in 0..2 {
            for s in 0..hc {
                assert_eq!(
                    out[(t * hc + s) * 3..(t * hc + s + 1) * 3],
                    x[t * 3..t * 3 + 3]
                );
            }
        }
    }
}

#[test]
fn hc_pre_with_zero_iterations_leaves_the_row_softmax_numerators() {
    // iters = 0: comb is exp(L − rowmax), un-normalised (spec §3.3).
    let c = unit_streams_case(&[(0, 1, 2.0), (0, 2, -1.0)]);
    let (_, _, comb) = c.run(&HcPre {
        sinkhorn_iters: 0,
        ..hc_pre_op(4)
    });
    let want = [(-2f32).exp(), 1.0, (-3f32).exp(), (-2f32).exp()];
    assert_eq!(&comb[..4], &want);
    assert!(comb[4..].iter().all(|v| *v == 1.0));
}

#[test]
fn hc_ops_refuse_wrong_widths_types_and_stream_counts() {
    let p = hc_pre_op(4);
    let good = [
        TensorMeta::f32([2, 4, 8]),
        TensorMeta::new([24, 32], DType::BF16),
        TensorMeta::f32([24]),
        TensorMeta::f32([3]),
    ];
    assert_eq!(
        infer(&p, &good),
        Ok(vec![
            TensorMeta::f32([2, 8]),
            TensorMeta::f32([2, 4]),
            TensorMeta::f32([2, 4, 4])
        ])
    );
    let bad = |i: usize, m: TensorMeta| {
        let mut v = good.to_vec();
        v[i] = m;
        v
    };
    for metas in [
        bad(0, TensorMeta::f32([2, 2, 8])), // 2 streams for hc = 4
        bad(0, TensorMeta::new([2, 4, 8], DType::BF16)), // narrow streams
        bad(1, TensorMeta::new([24, 31], DType::BF16)), // fn width ≠ hc·D
        bad(1, TensorMeta::new([16, 32], DType::BF16)), // "4 streams × 4" rows
        bad(1, TensorMeta::new([24, 32], DType::Q8_0)), // quantized fn
        bad(2, TensorMeta::f32([16])),
        bad(3, TensorMeta::f32([2])),
    ] {
        let e = infer(&p, &metas).unwrap_err();
        assert!(matches!(e, OpError::Shape { op: "hc_pre", .. }), "{e}");
    }
    assert!(
        infer(
            &HcPre {
                clamp: f32::NAN,
                ..p.clone()
            },
            &good
        )
        .is_err()
    );
    assert!(infer(&HcPre { hc: 0, ..p.clone() }, &good).is_err());

    let post = HcPost { hc: 4 };
    let good = [
        TensorMeta::f32([2, 8]),
        TensorMeta::f32([2, 4, 8]),
        TensorMeta::f32([2, 4]),
        TensorMeta::f32([2, 4, 4]),
    ];
    assert_eq!(infer(&post, &good), Ok(vec![TensorMeta::f32([2, 4, 8])]));
    for (i, m) in [
        (0, TensorMeta::f32([2, 9])),
        (0, TensorMeta::new([2, 8], DType::BF16)),
        (2, TensorMeta::f32([2, 3])),
        (3, TensorMeta::f32([2, 16])),
    ] {
        let mut v = good.to_vec();
        v[i] = m;
        let e = infer(&post, &v).unwrap_err();
        assert!(matches!(e, OpError::Shape { op: "hc_post", .. }), "{e}");
    }
    let e = infer(&StreamMean { hc: 4 }, &[TensorMeta::f32([2, 2, 8])]).unwrap_err();
    assert!(
        matches!(
            e,
            OpError::Shape {
                op: "stream_mean",
                ..
            }
        ),
        "{e}"
    );
    let e = infer(&HcExpand { hc: 4 }, &[TensorMeta::f32([2, 4, 8])]).unwrap_err();
    assert!(
        matches!(
            e,
            OpError::Shape {
                op: "hc_expand",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn describe_lines_name_every_parameter() {
    assert_eq!(
        hc_pre_op(4).describe(),
        "hc_pre(hc=4, iters=20, rms_eps=1e-6, hc_eps=1e-6, clamp=30)"
    );
    assert_eq!(HcPost { hc: 2 }.describe(), "hc_post(hc=2)");
    assert_eq!(StreamMean { hc: 4 }.describe(), "stream_mean(hc=4)");
    assert_eq!(HcExpand { hc: 1 }.describe(), "hc_expand(hc=1)");
}
