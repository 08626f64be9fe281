//! The head family's parity cases: `argmax` over a real vocabulary for one decode token and a
//! few rows, with a planted tie. Bound: [`NMSE_EXACT`] (the I32 ids must be equal).

use super::Argmax;
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
        .collect()
}
