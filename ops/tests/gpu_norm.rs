//! CUDA parity of `RmsNorm` (skips without a GPU, saying why).

use ops::norm::RmsNorm;
use ops::parity::{HostValue, Rng, Tolerance, check, run_gpu, test_gpu};
use proptest::prelude::*;

// The kernel sums squares in f32 (a fixed tree), the reference in f64: at these widths
// the sum's relative error is a few 1e-7, halved by the root, so Tolerance::F32 holds.
#[test]
fn rms_norm_matches_the_cpu_reference_weighted_and_unweighted() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(40), |(
        rows in 1usize..6, d in 1usize..5000, weighted in any::<bool>(), mag_exp in -3i32..6, seed in any::<u64>()
    )| {
        let mut r = Rng(seed | 1);
        let x = HostValue::f32([rows, d], &r.signed_vec(rows * d, 10f32.powi(mag_exp)));
        let op = RmsNorm { eps: 1e-6 };
        let mut inputs = vec![x];
        if weighted {
            inputs.push(HostValue::f32([d], &r.signed_vec(d, 2.0)));
        }
        check(&gpu, &op, &inputs, Tolerance::F32).map_err(TestCaseError::fail)?;
    });
}

#[test]
fn rms_norm_matches_at_the_model_widths_and_repeats_its_bits() {
    let Some(gpu) = test_gpu() else { return };
    let mut r = Rng(99);
    for d in [512, 768, 3584, 14336] {
        let inputs = [
            HostValue::f32([7, d], &r.signed_vec(7 * d, 1e3)),
            HostValue::f32([d], &r.signed_vec(d, 2.0)),
        ];
        let rep = check(&gpu, &RmsNorm { eps: 1e-6 }, &inputs, Tolerance::F32)
            .unwrap_or_else(|e| panic!("{e}"));
        println!("rms_norm D={d}: {rep}");
        let a = run_gpu(&gpu, &RmsNorm { eps: 1e-6 }, &inputs).expect("runs");
        let b = run_gpu(&gpu, &RmsNorm { eps: 1e-6 }, &inputs).expect("runs");
        assert!(a[0].1 == b[0].1, "D={d}: two runs differ");
    }
}
