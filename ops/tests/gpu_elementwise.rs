//! CUDA parity of the element-wise kernels (skips without a GPU, saying why).

use ops::elementwise::{Add, SwiGlu};
use ops::parity::{HostValue, Tolerance, check, test_gpu};
use proptest::prelude::*;

fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

#[test]
fn elementwise_kernels_match_their_cpu_references() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(32), |(rows in 1usize..9, cols in 1usize..3000, seed in any::<u64>())| {
        let n = rows * cols;
        let a = HostValue::f32([rows, cols], &values(n, seed, 30.0));
        let b = HostValue::f32([rows, cols], &values(n, seed ^ 0xABCD, 30.0));
        let r = check(&gpu, &SwiGlu, &[a.clone(), b.clone()], Tolerance::F32).map_err(TestCaseError::fail)?;
        prop_assert!(r.elements == n);
        check(&gpu, &Add, &[a, b], Tolerance::F32).map_err(TestCaseError::fail)?;
    });
}
