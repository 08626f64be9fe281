use super::*;
use crate::testkit::*;

fn f64_rms(x: &[f32], w: Option<&[f32]>, eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / x.len() as f64;
    let s = 1.0 / (ms + eps).sqrt();
    x.iter()
        .enumerate()
        .map(|(i, &v)| v as f64 * s * w.map_or(1.0, |w| w[i] as f64))
        .collect()
}

#[test]
fn rms_norm_matches_f64_weighted_and_unweighted() {
    let mut r = Rng::new(7);
    for &(n, d) in &[(1, 1), (3, 17), (2, 3584), (5, 512)] {
        let x = r.vec(n * d, -50.0, 50.0);
        let w = r.vec(d, -2.0, 2.0);
        for weighted in [false, true] {
            let xs = Owned::f32([n, d], &x);
            let ws = Owned::f32([d], &w);
            let op = RmsNorm { eps: 1e-6 };
            let out = if weighted {
                run(&op, &[&xs, &ws])
            } else {
                run(&op, &[&xs])
            }
            .unwrap()[0]
                .to_f32();
            for t in 0..n {
                let row = &x[t * d..(t + 1) * d];
                let want = f64_rms(row, weighted.then_some(&w[..]), 1e-6);
                for (o, w) in out[t * d..(t + 1) * d].iter().zip(want) {
                    // A handful of f32 roundings on an O(√D)-bounded value: a few ulp.
                    assert!(
                        (*o as f64 - w).abs() <= 4e-7 * w.abs() + 1e-12,
                        "{o} vs {w}"
                    );
                }
            }
        }
    }
}

#[test]
fn rms_norm_of_large_values_is_of_order_one() {
    // The sub-layer is handed an RMS-normed input: whatever the residual holds, each
    // |y| ≤ √D, so it fits a narrow type (seed §2).
    let d = 64;
    let x: Vec<f32> = (0..d).map(|i| 1e5 * (i as f32 - 31.5)).collect();
    let out = run(&RmsNorm { eps: 1e-6 }, &[&Owned::f32([1, d], &x)]).unwrap()[0].to_f32();
    let ss: f64 = out.iter().map(|&v| (v as f64).powi(2)).sum();
    assert!(
        (ss / d as f64 - 1.0).abs() < 1e-5,
        "mean square {}",
        ss / d as f64
    );
    assert!(out.iter().all(|v| v.abs() <= (d as f32).sqrt()));
}

#[test]
fn eps_keeps_a_zero_row_finite() {
    let out = run(&RmsNorm { eps: 1e-6 }, &[&Owned::f32([1, 4], &[0.0; 4])]).unwrap();
    assert_eq!(out[0].to_f32(), vec![0.0; 4]);
}

#[test]
fn rms_norm_refuses_a_weight_of_the_wrong_length_or_type() {
    let op = RmsNorm { eps: 1e-6 };
    let e = infer(&op, &[TensorMeta::f32([2, 8]), TensorMeta::f32([7])]).unwrap_err();
    assert!(matches!(e, OpError::Shape { op: "rms_norm", .. }), "{e}");
    let e = infer(
        &op,
        &[TensorMeta::f32([2, 8]), TensorMeta::new([8], DType::BF16)],
    )
    .unwrap_err();
    assert!(matches!(e, OpError::Shape { .. }), "{e}");
    let e = infer(&op, &[TensorMeta::new([2, 8], DType::F16)]).unwrap_err();
    assert!(matches!(e, OpError::Shape { .. }), "{e}");
    assert_eq!(op.describe(), "rms_norm(eps=1e-6)");
}
