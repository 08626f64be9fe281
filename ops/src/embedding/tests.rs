use half::bf16;

use super::*;
use crate::testkit::*;

fn bf16_table(v: usize, d: usize) -> (Vec<f32>, Owned) {
    let vals: Vec<f32> = (0..v * d)
        .map(|i| bf16::from_f32((i as f32 * 0.73).sin() * 3.0).to_f32())
        .collect();
    let bytes: Vec<u8> = vals
        .iter()
        .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
        .collect();
    (
        vals,
        Owned::from_bytes(TensorMeta::new([v, d], DType::BF16), &bytes),
    )
}

#[test]
fn embedding_copies_the_bf16_rows_exactly() {
    let (v, d) = (11, 6);
    let (vals, table) = bf16_table(v, d);
    let ids = [3, 0, 10, 3];
    let out = run(&Embedding, &[&table, &Owned::i32([4], &ids)]).unwrap()[0].to_f32();
    for (t, &id) in ids.iter().enumerate() {
        let id = id as usize;
        assert_eq!(out[t * d..(t + 1) * d], vals[id * d..(id + 1) * d]);
    }
}

#[test]
fn a_token_id_outside_the_vocabulary_is_a_data_error_naming_the_id_and_v() {
    let (_, table) = bf16_table(11, 4);
    for bad in [11, -1, i32::MAX] {
        let e = run(&Embedding, &[&table, &Owned::i32([2], &[1, bad])]).unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(
                e,
                OpError::Data {
                    op: "embedding",
                    ..
                }
            ),
            "{e}"
        );
        assert!(
            msg.contains(&bad.to_string()) && msg.contains("11"),
            "{msg}"
        );
    }
}

#[test]
fn embedding_refuses_float_token_ids_and_a_table_of_partial_blocks() {
    let e = infer(
        &Embedding,
        &[TensorMeta::new([8, 4], DType::BF16), TensorMeta::f32([2])],
    )
    .unwrap_err();
    assert!(matches!(e, OpError::Shape { .. }), "{e}");
    let e = infer(
        &Embedding,
        &[TensorMeta::new([8, 40], DType::Q8_0), TensorMeta::i32([2])],
    )
    .unwrap_err();
    assert!(matches!(e, OpError::Shape { .. }), "{e}");
    let e = infer(
        &Embedding,
        &[
            TensorMeta::new([8, 4], DType::BF16),
            TensorMeta::i32([2, 1]),
        ],
    )
    .unwrap_err();
    assert!(matches!(e, OpError::Shape { .. }), "{e}");
}
