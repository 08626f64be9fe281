//! The embedding family's parity cases: every table type, one decode token and a prefill
//! chunk of 64. Bound: [`NMSE_EXACT`] (the GPU tests hold the rows bit-identical).

use super::Embedding;
use crate::parity::NMSE_EXACT;
use crate::parity::{HostValue, ParityCase, weight};
use crate::tensor::DType;

pub fn cases() -> Vec<ParityCase> {
    let (vocab, d) = (1000, 3584);
    let mut v = Vec::new();
    for dtype in [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q6_K,
        DType::IQ4_NL,
    ] {
        for n in [1, 64] {
            v.push(ParityCase::new(
                format!("embedding/{dtype} n={n} d={d}"),
                Embedding,
                5 + n as u64,
                NMSE_EXACT,
                move |r| {
                    let t = weight(r, dtype, &[vocab, d]);
                    let ids: Vec<i32> = (0..n).map(|_| r.below(vocab) as i32).collect();
                    vec![t, HostValue::i32([n], &ids)]
                },
            ));
        }
    }
    v
}
