//! The head family's parity cases: `argmax` over a real vocabulary for one decode token and a
//! few rows, with a planted tie; `sample_rows` over a real vocabulary for one token and a batch
//! of 64 rows, each row with its own cuts (greedy, temperature alone, top-k with a planted tie
//! at its boundary, top-p, min-p, all three). Bound: [`NMSE_EXACT`] (the I32 ids must be equal;
//! both sides sum weights in f64, so a draw parts only within an exp ulp of a boundary);
//! `penalize_rows` over a real vocabulary with repeated ids and padding (exact).

use super::{Argmax, PenalizeRows, RowSampling, SAMPLE_FIELDS, SampleRows};
use crate::parity::NMSE_EXACT;
use crate::parity::{HostValue, ParityCase};

pub fn cases() -> Vec<ParityCase> {
    [(1usize, 131_072usize), (4, 129_280)]
        .into_iter()
        .map(|(n, vocab)| {
            ParityCase::new(
                format!("argmax/n={n} v={vocab}"),
                Argmax,
                3 + n as u64,
                NMSE_EXACT,
                move |r| {
                    let mut x = r.vec(n * vocab, -10.0, 10.0);
                    // A repeated maximum in every row: the lower index must win on both sides.
                    for t in 0..n {
                        for _ in 0..2 {
                            x[t * vocab + r.below(vocab)] = 100.0;
                        }
                    }
                    vec![HostValue::f32([n, vocab], &x)]
                },
            )
        })
        .collect::<Vec<_>>()
        .into_iter()
        .chain(
            [(1usize, 131_072usize), (64, 131_072), (7, 129_280)].map(|(n, vocab)| {
                ParityCase::new(
                    format!("sample_rows/n={n} v={vocab}"),
                    SampleRows,
                    11 + n as u64,
                    NMSE_EXACT,
                    move |r| {
                        let mut x = r.vec(n * vocab, -12.0, 12.0);
                        let mut params = Vec::with_capacity(n * SAMPLE_FIELDS);
                        for t in 0..n {
                            let p = sampling_case(t, r);
                            if p.top_k > 1 {
                                // Three equal values straddling the k-th place: the lower ids stay.
                                let row = &mut x[t * vocab..(t + 1) * vocab];
                                let mut sorted = row.to_vec();
                                sorted.sort_by(|a, b| b.total_cmp(a));
                                let kth = sorted[p.top_k as usize - 1];
                                for _ in 0..3 {
                                    row[r.below(vocab)] = kth;
                                }
                            }
                            params.extend(p.fields());
                        }
                        vec![
                            HostValue::f32([n, vocab], &x),
                            HostValue::f32([n, SAMPLE_FIELDS], &params),
                        ]
                    },
                )
            }),
        )
        .chain(
            [(1usize, 131_072usize, 64usize), (64, 131_072, 512)].map(|(n, vocab, w)| {
                ParityCase::new(
                    format!("penalize_rows/n={n} v={vocab} w={w}"),
                    PenalizeRows,
                    5 + n as u64,
                    NMSE_EXACT,
                    move |r| {
                        let x = r.vec(n * vocab, -8.0, 8.0);
                        // Seen ids with repeats, then the -1 padding of a shorter history.
                        let ids: Vec<i32> = (0..n * w)
                            .map(|e| match e % w < w * 3 / 4 {
                                true => r.below(vocab) as i32,
                                false => -1,
                            })
                            .collect();
                        let pen: Vec<f32> = (0..n).map(|t| 1.0 + 0.05 * (t % 5) as f32).collect();
                        vec![
                            HostValue::f32([n, vocab], &x),
                            HostValue::i32([n, w], &ids),
                            HostValue::f32([n], &pen),
                        ]
                    },
                )
            }),
        )
        .collect()
}

/// Row `t`'s parameters: the kinds of request a server sees, in turn.
fn sampling_case(t: usize, r: &mut crate::parity::Rng) -> RowSampling {
    let u = r.uniform(0.0, 1.0);
    let base = RowSampling::at_temperature(0.7, u);
    match t % 6 {
        0 => RowSampling::at_temperature(1.0, u),
        1 => RowSampling::GREEDY,
        2 => RowSampling { top_k: 40, ..base },
        3 => RowSampling { top_p: 0.9, ..base },
        4 => RowSampling {
            min_p: 0.05,
            ..RowSampling::at_temperature(1.3, u)
        },
        _ => RowSampling {
            top_k: 200,
            top_p: 0.8,
            min_p: 0.01,
            ..base
        },
    }
}
