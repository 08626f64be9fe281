use super::*;
use crate::testkit::*;

#[test]
fn argmax_takes_the_first_of_tied_maxima() {
    let x = [1.0, 5.0, 5.0, -1.0, /* row 2 */ -3.0, -2.0, -7.0, -2.0];
    let out = run(&Argmax, &[&Owned::f32([2, 4], &x)]).unwrap();
    assert_eq!(out[0].to_i32(), vec![1, 1]);
}

#[test]
fn argmax_handles_infinities() {
    let x = [
        f32::NEG_INFINITY,
        f32::NEG_INFINITY,
        -1e30,
        f32::INFINITY,
        1.0,
        f32::INFINITY,
    ];
    let out = run(&Argmax, &[&Owned::f32([2, 3], &x)]).unwrap();
    assert_eq!(out[0].to_i32(), vec![2, 0]);
}

#[test]
fn a_row_holding_nan_is_a_data_error_naming_the_row() {
    let x = [1.0, 2.0, 3.0, 4.0, f32::NAN, 9.0];
    let e = run(&Argmax, &[&Owned::f32([2, 3], &x)]).unwrap_err();
    assert!(matches!(e, OpError::Data { op: "argmax", .. }), "{e}");
    assert!(e.to_string().contains("row 1"), "{e}");
}

#[test]
fn argmax_refuses_non_f32_and_non_matrix_input() {
    let e = infer(&Argmax, &[TensorMeta::new([2, 3], DType::BF16)]).unwrap_err();
    assert!(matches!(e, OpError::Shape { .. }), "{e}");
    let e = infer(&Argmax, &[TensorMeta::f32([6])]).unwrap_err();
    assert!(matches!(e, OpError::Shape { .. }), "{e}");
}

#[test]
fn slice_rows_copies_the_requested_rows() {
    let x: Vec<f32> = (0..24).map(|i| i as f32).collect();
    let op = SliceRows { start: 1, len: 2 };
    let out = run(&op, &[&Owned::f32([4, 2, 3], &x)]).unwrap();
    assert_eq!(out[0].meta, TensorMeta::f32([2, 2, 3]));
    assert_eq!(out[0].to_f32(), x[6..18].to_vec());
    assert_eq!(op.describe(), "slice_rows(start=1, len=2)");
}

#[test]
fn slice_rows_refuses_a_range_past_the_end_or_empty() {
    for (start, len) in [(3, 2), (5, 1), (0, 0), (usize::MAX, 2)] {
        let e = infer(&SliceRows { start, len }, &[TensorMeta::f32([4, 8])]).unwrap_err();
        assert!(
            matches!(
                e,
                OpError::Shape {
                    op: "slice_rows",
                    ..
                }
            ),
            "{start},{len}: {e}"
        );
    }
    assert!(infer(&SliceRows { start: 3, len: 1 }, &[TensorMeta::f32([4, 8])]).is_ok());
}
