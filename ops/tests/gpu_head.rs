//! CUDA parity of `Argmax` and `SliceRows` (skips without a GPU, saying why).

use ops::head::{Argmax, SliceRows, argmax_row};
use ops::parity::{HostValue, Rng, Tolerance, check, run_gpu, test_gpu};
use proptest::prelude::*;

const EXACT: Tolerance = Tolerance { rel: 0.0, abs: 0.0 };

#[test]
fn argmax_matches_the_cpu_reference_with_planted_ties() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(24), |(
        n in 1usize..5, v in 1usize..140_000, ties in 0usize..4, seed in any::<u64>()
    )| {
        let mut r = Rng(seed | 1);
        // Few distinct values, so ties are common; then a planted maximum repeated.
        let mut x: Vec<f32> = (0..n * v).map(|_| (r.below(1000) as f32) - 500.0).collect();
        for t in 0..n {
            for _ in 0..ties {
                let i = r.below(v);
                x[t * v + i] = 1000.0;
            }
        }
        check(&gpu, &Argmax, &[HostValue::f32([n, v], &x)], EXACT).map_err(TestCaseError::fail)?;
    });
}

fn gpu_argmax(gpu: &ops::gpu::GpuCtx, rows: &[Vec<f32>]) -> Vec<i32> {
    let v = rows[0].len();
    let flat: Vec<f32> = rows.concat();
    let out = run_gpu(gpu, &Argmax, &[HostValue::f32([rows.len(), v], &flat)]).expect("runs");
    out[0]
        .1
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn argmax_keeps_the_first_maximum_across_threads_and_handles_infinities() {
    let Some(gpu) = test_gpu() else { return };
    let v = 131_072;
    let mut tie = vec![0f32; v];
    // Maxima far apart land in different threads and warps: the first must win.
    for i in [70_001, 5, 131_071, 1024] {
        tie[i] = 3.5;
    }
    let all_neg_inf = vec![f32::NEG_INFINITY; v];
    let mut pos_inf = vec![-1e30f32; v];
    pos_inf[99_999] = f32::INFINITY;
    pos_inf[100_000] = f32::INFINITY;
    let got = gpu_argmax(&gpu, &[tie, all_neg_inf, pos_inf]);
    assert_eq!(got, vec![5, 0, 99_999]);
}

#[test]
fn a_row_holding_nan_is_written_as_minus_one_and_other_rows_are_unaffected() {
    let Some(gpu) = test_gpu() else { return };
    let v = 5000;
    let mut r = Rng(3);
    let rows: Vec<Vec<f32>> = (0..3)
        .map(|_| (0..v).map(|_| r.below(100_000) as f32).collect())
        .collect();
    let mut with_nan = rows.clone();
    with_nan[1][4321] = f32::NAN;
    let got = gpu_argmax(&gpu, &with_nan);
    assert_eq!(got[1], -1);
    for t in [0, 2] {
        assert_eq!(
            got[t],
            argmax_row(&rows[t]).expect("no NaN") as i32,
            "row {t}"
        );
    }
}

#[test]
fn slice_rows_copies_exactly_the_requested_rows() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(24), |(
        n in 1usize..40, inner in 1usize..3000, a in any::<usize>(), b in any::<usize>()
    )| {
        let start = a % n;
        let len = 1 + b % (n - start);
        let x: Vec<f32> = (0..n * inner).map(|i| i as f32 * 0.5 - 7.0).collect();
        check(&gpu, &SliceRows { start, len }, &[HostValue::f32([n, inner], &x)], EXACT)
            .map_err(TestCaseError::fail)?;
    });
}
