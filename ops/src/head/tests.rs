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

fn sampled(temperature: f32, u: f32) -> RowSampling {
    RowSampling::at_temperature(temperature, u)
}

/// The ids `sample_row` chooses for `n` evenly spaced draws.
fn draws(x: &[f32], p: RowSampling, n: usize) -> Vec<usize> {
    (0..n)
        .map(|k| {
            let u = (k as f32 + 0.5) / n as f32;
            sample_row(x, &RowSampling { u, ..p }).expect("a finite candidate")
        })
        .collect()
}

#[test]
fn the_draw_walks_the_ids_in_order_in_proportion_to_their_weight() {
    // Weights 2 : 1 : (none) : 1 over ids 0, 1, 3.
    let x = [2f32.ln(), 0.0, f32::NEG_INFINITY, 0.0];
    let p = sampled(1.0, 0.0);
    assert_eq!(sample_row(&x, &RowSampling { u: 0.0, ..p }), Some(0));
    assert_eq!(sample_row(&x, &RowSampling { u: 0.49, ..p }), Some(0));
    assert_eq!(sample_row(&x, &RowSampling { u: 0.51, ..p }), Some(1));
    assert_eq!(sample_row(&x, &RowSampling { u: 0.76, ..p }), Some(3));
    // A u that rounding leaves past the whole weight takes the last kept id.
    assert_eq!(sample_row(&x, &RowSampling { u: 1.0, ..p }), Some(3));
    assert_eq!(sample_row(&[f32::NAN, f32::INFINITY], &p), None);
}

#[test]
fn top_k_keeps_the_lower_ids_of_values_tied_at_its_boundary() {
    let x = [1.0, 3.0, 2.0, 2.0, 2.0, 0.5];
    let p = RowSampling {
        top_k: 3,
        ..sampled(1.0, 0.0)
    };
    let mut seen = draws(&x, p, 200);
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen, vec![1, 2, 3]);
}

#[test]
fn top_p_keeps_the_shortest_head_reaching_its_share_and_min_p_drops_the_weak() {
    // Weights 1, 1, 1, 0.01, 0.01 (ids 4, 0, 2, 1, 3 by value).
    let w = [1.0f32, 0.01, 1.0, 0.01, 1.0];
    let x: Vec<f32> = w.iter().map(|v| v.ln()).collect();
    let mut top_p: Vec<usize> = draws(
        &x,
        RowSampling {
            top_p: 0.5,
            ..sampled(1.0, 0.0)
        },
        300,
    );
    top_p.sort_unstable();
    top_p.dedup();
    // Equal values in id order: ids 0 and 2 reach half of 3.02.
    assert_eq!(top_p, vec![0, 2]);
    let mut min_p = draws(
        &x,
        RowSampling {
            min_p: 0.1,
            ..sampled(1.0, 0.0)
        },
        300,
    );
    min_p.sort_unstable();
    min_p.dedup();
    assert_eq!(min_p, vec![0, 2, 4]);
}

#[test]
fn sample_rows_takes_the_argmax_of_greedy_rows_and_draws_the_others() {
    let x = [0.0, 5.0, 1.0, /* row 2 */ 9.0, 0.0, 0.0];
    let params: Vec<f32> = [RowSampling::GREEDY, sampled(1.0, 0.9999)]
        .iter()
        .flat_map(|p| p.fields())
        .collect();
    let out = run(
        &SampleRows,
        &[
            &Owned::f32([2, 3], &x),
            &Owned::f32([2, SAMPLE_FIELDS], &params),
        ],
    )
    .unwrap();
    assert_eq!(out[0].to_i32(), vec![1, 2]);
}

#[test]
fn sample_rows_names_the_row_without_a_candidate_and_refuses_bad_params() {
    let x = [0.0, 1.0, f32::NAN, f32::NAN];
    let params: Vec<f32> = [RowSampling::GREEDY, sampled(1.0, 0.5)]
        .iter()
        .flat_map(|p| p.fields())
        .collect();
    let e = run(
        &SampleRows,
        &[
            &Owned::f32([2, 2], &x),
            &Owned::f32([2, SAMPLE_FIELDS], &params),
        ],
    )
    .unwrap_err();
    assert!(e.to_string().contains("row 1"), "{e}");
    let e = infer(
        &SampleRows,
        &[TensorMeta::f32([2, 8]), TensorMeta::f32([2, 4])],
    )
    .unwrap_err();
    assert!(e.to_string().contains("params"), "{e}");
}

#[test]
fn the_penalty_divides_positive_logits_multiplies_the_rest_and_skips_padding() {
    let x = [2.0, -1.0, 0.5, 3.0, /* row 2 */ 1.0, 1.0, -4.0, 0.0];
    let ids = [0, 1, 1, -1, /* row 2 */ 2, 99, 3, -1];
    let out = run(
        &PenalizeRows,
        &[
            &Owned::f32([2, 4], &x),
            &Owned::i32([2, 4], &ids),
            &Owned::f32([2], &[2.0, 1.5]),
        ],
    )
    .unwrap();
    assert_eq!(
        out[0].to_f32(),
        vec![1.0, -2.0, 0.5, 3.0, 1.0, 1.0, -6.0, 0.0]
    );
    let e = infer(
        &PenalizeRows,
        &[
            TensorMeta::f32([2, 4]),
            TensorMeta::i32([3, 4]),
            TensorMeta::f32([2]),
        ],
    )
    .unwrap_err();
    assert!(e.to_string().contains("ids must be"), "{e}");
}
