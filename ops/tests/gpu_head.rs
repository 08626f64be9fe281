//! CUDA parity of `Argmax`, `SampleRows` and `SliceRows` (skips without a GPU, saying why).

use ops::head::{
    Argmax, RowSampling, SAMPLE_FIELDS, SampleRows, SliceRows, argmax_row, sample_row,
};
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

fn gpu_sample(gpu: &ops::gpu::GpuCtx, x: &[f32], v: usize, params: &[RowSampling]) -> Vec<i32> {
    let n = params.len();
    let fields: Vec<f32> = params.iter().flat_map(|p| p.fields()).collect();
    let out = run_gpu(
        gpu,
        &SampleRows,
        &[
            HostValue::f32([n, v], x),
            HostValue::f32([n, SAMPLE_FIELDS], &fields),
        ],
    )
    .expect("runs");
    out[0]
        .1
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The reference's token for `p`, and whether `got` is what it gives for a draw within 1e-6
/// of `p.u` (the two sides' weights differ by an exp ulp; a draw that close to a boundary may
/// fall either side of it).
fn agrees(row: &[f32], p: RowSampling, got: i32) -> Result<(), String> {
    let pick = |u: f32| -> i32 {
        if p.scale > 0.0 {
            sample_row(row, &RowSampling { u, ..p }).map_or(-1, |t| t as i32)
        } else {
            argmax_row(row).map_or(-1, |t| t as i32)
        }
    };
    let want = pick(p.u);
    if got == want || [p.u - 1e-6, p.u + 1e-6].iter().any(|&u| pick(u) == got) {
        Ok(())
    } else {
        Err(format!("{p:?}: the GPU chose {got}, the reference {want}"))
    }
}

#[test]
fn sampled_rows_match_the_cpu_reference_under_every_cut() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(32), |(
        n in 1usize..70, v in 1usize..140_000, spread in 0.5f32..30.0, few in any::<bool>(),
        seed in any::<u64>()
    )| {
        let mut r = Rng(seed | 1);
        // Few distinct values make ties at every cut common.
        let x: Vec<f32> = (0..n * v)
            .map(|_| if few { r.below(40) as f32 * 0.25 } else { r.uniform(-spread, spread) })
            .collect();
        let params: Vec<RowSampling> = (0..n)
            .map(|_| RowSampling {
                scale: [0.0, 0.5, 1.0, 1.7][r.below(4)],
                top_k: [0, 1, 2, 50, 1000][r.below(5)],
                top_p: [1.0, 0.95, 0.5, 0.05][r.below(4)],
                min_p: [0.0, 0.02, 0.3][r.below(3)],
                u: r.uniform(0.0, 1.0),
            })
            .collect();
        let got = gpu_sample(&gpu, &x, v, &params);
        for (t, p) in params.iter().enumerate() {
            agrees(&x[t * v..(t + 1) * v], *p, got[t])
                .map_err(|e| TestCaseError::fail(format!("row {t} of {n}, V {v}: {e}")))?;
        }
    });
}

#[test]
fn a_sampled_row_without_a_finite_logit_is_minus_one_and_the_draw_follows_u() {
    let Some(gpu) = test_gpu() else { return };
    let v = 131_072;
    // Four equal weights far apart in the row: u picks them in id order.
    let mut x = vec![f32::NEG_INFINITY; v];
    for i in [7, 40_000, 90_001, 131_071] {
        x[i] = 1.0;
    }
    let rows: Vec<f32> = [x.clone(), x.clone(), x.clone(), x, vec![f32::NAN; v]].concat();
    let params: Vec<RowSampling> = [0.1, 0.3, 0.6, 0.9, 0.5]
        .iter()
        .map(|&u| RowSampling::at_temperature(1.0, u))
        .collect();
    assert_eq!(
        gpu_sample(&gpu, &rows, v, &params),
        vec![7, 40_000, 90_001, 131_071, -1]
    );
}
