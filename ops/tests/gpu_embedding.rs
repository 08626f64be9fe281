//! CUDA parity of `Embedding` (skips without a GPU, saying why).

use half::{bf16, f16};
use ops::embedding::{Embedding, embed_rows};
use ops::parity::{HostValue, Rng, Tolerance, check, run_gpu, test_gpu};
use ops::{DType, TensorMeta};
use proptest::prelude::*;

const TYPES: [DType; 6] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q8_0,
    DType::Q6_K,
    DType::IQ4_NL,
];

/// A `[v, d]` table of `dtype`: float types from values, block types from random
/// bytes with finite f16 scales.
fn table(r: &mut Rng, dtype: DType, v: usize, d: usize) -> HostValue {
    let n = v * d;
    let bytes: Vec<u8> = match dtype {
        DType::F32 => (0..n)
            .flat_map(|_| r.uniform(-3.0, 3.0).to_le_bytes())
            .collect(),
        DType::F16 => (0..n)
            .flat_map(|_| f16::from_f32(r.uniform(-3.0, 3.0)).to_le_bytes())
            .collect(),
        DType::BF16 => (0..n)
            .flat_map(|_| bf16::from_f32(r.uniform(-3.0, 3.0)).to_le_bytes())
            .collect(),
        _ => {
            let ty = dtype.ggml().expect("a weight type");
            let mut b: Vec<u8> = (0..ty.row_bytes(n).expect("whole blocks"))
                .map(|_| r.next_u64() as u8)
                .collect();
            let at = if dtype == DType::Q6_K { 208 } else { 0 };
            for blk in b.chunks_exact_mut(ty.block_bytes()) {
                blk[at..at + 2].copy_from_slice(&f16::from_f32(r.uniform(-0.5, 0.5)).to_le_bytes());
            }
            b
        }
    };
    HostValue::from_bytes(TensorMeta::new([v, d], dtype), &bytes)
}

fn width(dtype: DType, units: usize) -> usize {
    match dtype {
        DType::Q8_0 | DType::IQ4_NL => 32 * units,
        DType::Q6_K => 256 * units,
        _ => 37 * units,
    }
}

#[test]
fn embedding_rows_are_bit_identical_to_the_cpu_reference_for_every_table_type() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(36), |(
        ti in 0usize..6, v in 1usize..60, units in 1usize..20, n in 1usize..40, seed in any::<u64>()
    )| {
        let dtype = TYPES[ti];
        let mut r = Rng(seed | 1);
        let t = table(&mut r, dtype, v, width(dtype, units));
        let ids: Vec<i32> = (0..n).map(|_| (r.next_u64() % v as u64) as i32).collect();
        let rep = check(&gpu, &Embedding, &[t, HostValue::i32([n], &ids)], Tolerance::new(0.0, 0.0))
            .map_err(TestCaseError::fail)?;
        prop_assert_eq!(rep.max_abs, 0.0);
    });
}

#[test]
fn an_id_outside_the_vocabulary_gives_a_nan_row_and_leaves_the_others_intact() {
    let Some(gpu) = test_gpu() else { return };
    let (v, d) = (11, 300);
    let t = table(&mut Rng(5), DType::BF16, v, d);
    let ids = [2, v as i32, -1, 0, i32::MAX, 10];
    let out = run_gpu(
        &gpu,
        &Embedding,
        &[t.clone(), HostValue::i32([ids.len()], &ids)],
    )
    .expect("runs");
    let got: Vec<f32> = out[0]
        .1
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    for (row, &id) in ids.iter().enumerate() {
        let g = &got[row * d..(row + 1) * d];
        if (0..v as i32).contains(&id) {
            let mut want = vec![0f32; d];
            embed_rows(t.data.bytes(), DType::BF16, v, d, &[id], &mut want).expect("valid id");
            assert_eq!(g, &want[..], "row {row} (id {id})");
        } else {
            assert!(
                g.iter().all(|x| x.is_nan()),
                "row {row} (id {id}) is not all NaN"
            );
        }
    }
}
