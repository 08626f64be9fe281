//! YaRN rope (spec §3.5): correction dims, magnitudes, the score scale, and the rotation
//! against an f64 rendering of the spec's formulas.

use ops::rope::{RopeParams, Yarn, corr_dims, kq_scale, rope_norm_in_place};
use proptest::prelude::*;

/// The released model's YaRN block (spec §1.1).
fn xing4() -> RopeParams {
    RopeParams::yarn(
        64,
        10000.0,
        &Yarn {
            factor: 64.0,
            n_ctx_orig: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: 1.0,
            mscale_all_dim: 1.0,
        },
    )
}

/// The deepseek2-tiny reference checkpoint's (shared/reference/deepseek2-tiny/README.md).
fn tiny() -> RopeParams {
    RopeParams::yarn(
        8,
        10000.0,
        &Yarn {
            factor: 4.0,
            n_ctx_orig: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: 1.0,
            mscale_all_dim: 1.0,
        },
    )
}

#[test]
fn the_real_models_correction_dims_are_10_and_23() {
    assert_eq!(corr_dims(64, 4096, 10000.0, 32.0, 1.0), [10.0, 23.0]);
    assert_eq!(xing4().corr_dims(), [10.0, 23.0]);
}

#[test]
fn the_tiny_references_correction_dims_are_1_and_3() {
    // By hand: 8·ln(4096/(2π·32))/(2·ln 1e4) = 1.309 → floor 1; 8·ln(4096/2π)/(2·ln 1e4) = 2.814 → ceil 3.
    assert_eq!(tiny().corr_dims(), [1.0, 3.0]);
}

#[test]
fn correction_dims_are_clamped_to_the_rotated_range() {
    // A short original context pushes the fast end below 0, a long one the slow end past n_rot-1.
    assert_eq!(corr_dims(8, 16, 10000.0, 32.0, 1.0)[0], 0.0);
    assert_eq!(corr_dims(8, 1 << 30, 10.0, 32.0, 1.0)[1], 7.0);
}

#[test]
fn yarn_magnitude_cancels_to_one_when_mscale_equals_mscale_all_dim() {
    for (p, factor) in [(xing4(), 64f64), (tiny(), 4f64)] {
        // llama.cpp hands rope 1/(1+0.1·ln f) (0.70627 for f = 64) and rope multiplies it back.
        let want_attn = 1.0 / (1.0 + 0.1 * factor.ln());
        assert!((p.attn_factor as f64 - want_attn).abs() < 1e-7, "{p:?}");
        assert!(
            (p.magnitude() - 1.0).abs() <= 2.0 * f32::EPSILON,
            "{}",
            p.magnitude()
        );
        assert_eq!(p.freq_scale as f64, 1.0 / factor);
        assert_eq!(p.ext_factor, 1.0);
    }
}

#[test]
fn kq_scale_is_mscale_squared_over_root_192_for_the_real_model() {
    // Spec §1.4: 0.14467962580268925.
    let s = kq_scale(&xing4(), 1.0, 192) as f64;
    assert!((s / 0.14467962580268925 - 1.0).abs() < 3e-7, "{s}");
}

#[test]
fn kq_scale_of_the_tiny_reference_uses_qk_nope_plus_qk_rope() {
    let m = 1.0 + 0.1 * 4f64.ln();
    let want = m * m / 24f64.sqrt();
    let s = kq_scale(&tiny(), 1.0, 16 + 8) as f64;
    assert!((s / want - 1.0).abs() < 3e-7, "{s} vs {want}");
}

/// The spec's rope in f64: angles `p·base^(−2i/n)`, YaRN blend over pair indices, magnitude 1.
fn rope_f64(v: &[f32], pos: i32, n_rot: usize, base: f64, factor: f64, corr: [f64; 2]) -> Vec<f64> {
    let mut out: Vec<f64> = v.iter().map(|&x| x as f64).collect();
    for i in 0..n_rot / 2 {
        let theta_x = pos as f64 * base.powf(-2.0 * i as f64 / n_rot as f64);
        let y = (i as f64 - corr[0]) / (corr[1] - corr[0]).max(0.001);
        let ramp = 1.0 - y.clamp(0.0, 1.0);
        let theta = theta_x / factor * (1.0 - ramp) + theta_x * ramp;
        let (a, b) = (out[2 * i], out[2 * i + 1]);
        out[2 * i] = a * theta.cos() - b * theta.sin();
        out[2 * i + 1] = a * theta.sin() + b * theta.cos();
    }
    out
}

/// Spec §3.5's correction dims in f64.
fn corr_f64(n_rot: usize, base: f64) -> [f64; 2] {
    let c = |beta: f64| {
        n_rot as f64 * (4096.0 / (2.0 * std::f64::consts::PI * beta)).ln() / (2.0 * base.ln())
    };
    [
        c(32.0).floor().max(0.0),
        c(1.0).ceil().min(n_rot as f64 - 1.0),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn rope_matches_an_f64_rendering_of_the_spec(
        real in any::<bool>(),
        pos in 0i32..70_000,
        seed in any::<u64>(),
    ) {
        let (p, factor) = if real { (xing4(), 64.0) } else { (tiny(), 4.0) };
        let n = p.n_rot;
        let corr = corr_f64(n, 1e4);
        prop_assert_eq!([p.corr_dims()[0] as f64, p.corr_dims()[1] as f64], corr);
        let mut s = seed | 1;
        let v: Vec<f32> = (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect();
        let mut got = v.clone();
        rope_norm_in_place(&mut got, pos, &p);
        let want = rope_f64(&v, pos, n, 1e4, factor, corr);
        for i in 0..n / 2 {
            // ggml builds angle i with i f32 products (and theta_scale carries one rounding
            // that compounds i times), so its error grows with the angle and the pair index.
            let theta_x = pos as f64 * 1e4f64.powf(-2.0 * i as f64 / n as f64);
            let norm = ((v[2 * i] as f64).powi(2) + (v[2 * i + 1] as f64).powi(2)).sqrt();
            let tol = norm * ((2 * i + 6) as f64 * 6e-8 * theta_x + 1e-6) + 1e-7;
            for c in 0..2 {
                let d = (got[2 * i + c] as f64 - want[2 * i + c]).abs();
                prop_assert!(d <= tol, "pair {} elem {}: {} vs {} (tol {})", i, c, got[2*i+c], want[2*i+c], tol);
            }
        }
    }

    #[test]
    fn the_rotation_preserves_pair_norms(pos in 0i32..300_000, a in -4f32..4.0, b in -4f32..4.0) {
        let p = xing4();
        let mut v: Vec<f32> = (0..p.n_rot).map(|i| if i % 2 == 0 { a } else { b }).collect();
        rope_norm_in_place(&mut v, pos, &p);
        let n0 = ((a as f64).powi(2) + (b as f64).powi(2)).sqrt();
        for pair in v.chunks_exact(2) {
            let n1 = ((pair[0] as f64).powi(2) + (pair[1] as f64).powi(2)).sqrt();
            prop_assert!((n1 - n0).abs() <= 1e-6 * n0 + 1e-12, "{} vs {}", n1, n0);
        }
    }
}

#[test]
fn values_past_n_rot_are_left_alone() {
    let p = tiny();
    let mut v: Vec<f32> = (0..12).map(|i| i as f32 + 0.5).collect();
    let before = v.clone();
    rope_norm_in_place(&mut v, 777, &p);
    assert_eq!(&v[8..], &before[8..]);
    assert_ne!(&v[..8], &before[..8]);
}

#[test]
fn the_first_pair_turns_by_the_position_itself() {
    // Pair 0 lies below the correction range, so it keeps the original frequency: θ = pos.
    let p = xing4();
    let mut v = vec![0f32; 64];
    v[0] = 1.0;
    rope_norm_in_place(&mut v, 3, &p);
    assert!((v[0] as f64 - 3f64.cos()).abs() < 1e-6);
    assert!((v[1] as f64 - 3f64.sin()).abs() < 1e-6);
}
