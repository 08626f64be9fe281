use super::*;
use crate::testkit::*;

#[test]
fn swiglu_is_silu_of_the_gate_times_up_against_f64() {
    let mut r = Rng::new(1);
    let (n, f) = (3, 37);
    let g = r.vec(n * f, -20.0, 20.0);
    let u = r.vec(n * f, -5.0, 5.0);
    let out = run(&SwiGlu, &[&Owned::f32([n, f], &g), &Owned::f32([n, f], &u)]).unwrap();
    for ((o, &g), &u) in out[0].to_f32().iter().zip(&g).zip(&u) {
        let (g, u) = (g as f64, u as f64);
        let want = g / (1.0 + (-g).exp()) * u;
        assert!(
            (*o as f64 - want).abs() <= 1e-6 * want.abs() + 1e-30,
            "{o} vs {want}"
        );
    }
}

#[test]
fn swiglu_of_a_very_negative_gate_is_zero_not_nan() {
    let out = run(
        &SwiGlu,
        &[
            &Owned::f32([1, 2], &[-1e4, -200.0]),
            &Owned::f32([1, 2], &[3.0, 3.0]),
        ],
    )
    .unwrap();
    assert_eq!(out[0].to_f32(), vec![0.0, 0.0]);
}

#[test]
fn swiglu_keeps_a_product_beyond_the_f16_range() {
    // silu(300)·300 = 9e4 > 65504: the seed's overflow, which must stay finite here.
    let out = run(
        &SwiGlu,
        &[&Owned::f32([1, 1], &[300.0]), &Owned::f32([1, 1], &[300.0])],
    )
    .unwrap();
    assert_eq!(out[0].to_f32(), vec![90000.0]);
}

#[test]
fn add_sums_elementwise() {
    let out = run(
        &Add,
        &[
            &Owned::f32([2, 2], &[1.0, 2.0, 3.0, 1e30]),
            &Owned::f32([2, 2], &[0.5, -2.0, 1e5, 1e30]),
        ],
    )
    .unwrap();
    assert_eq!(out[0].to_f32(), vec![1.5, 0.0, 100003.0, 2e30]);
}

#[test]
fn binary_ops_refuse_mismatched_shapes_and_non_f32_inputs() {
    for op in [&SwiGlu as &dyn Op, &Add] {
        let e = infer(op, &[TensorMeta::f32([2, 3]), TensorMeta::f32([2, 4])]).unwrap_err();
        assert!(matches!(e, OpError::Shape { .. }), "{e}");
        let e = infer(
            op,
            &[
                TensorMeta::f32([2, 3]),
                TensorMeta::new([2, 3], DType::BF16),
            ],
        )
        .unwrap_err();
        assert!(
            matches!(e, OpError::Shape { .. }) && e.to_string().contains("BF16"),
            "{e}"
        );
        let e = infer(op, &[TensorMeta::f32([2, 3])]).unwrap_err();
        assert!(matches!(e, OpError::Shape { .. }), "{e}");
    }
}

#[test]
fn cpu_refuses_an_output_of_the_wrong_shape() {
    let a = Owned::f32([2], &[1.0, 2.0]);
    let mut o = Owned::poisoned(TensorMeta::f32([3]));
    let e = Add
        .cpu(&[a.view(), a.view()], &mut [o.view_mut()])
        .unwrap_err();
    assert!(matches!(e, OpError::Shape { op: "add", .. }), "{e}");
}
