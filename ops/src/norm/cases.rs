//! The norm family's parity cases: `rms_norm`, weighted and not, at decode and prefill sizes
//! of the model widths (the GPU tests' `rms_norm_matches_at_the_model_widths`). Bound:
//! [`NMSE_F32`], the tests' `Tolerance::F32` (the kernel sums squares in f32, the reference in
//! f64; outputs are O(1)).

use super::RmsNorm;
use crate::parity::NMSE_F32;
use crate::parity::{HostValue, ParityCase};

pub fn cases() -> Vec<ParityCase> {
    let mut v = Vec::new();
    for (n, d, weighted) in [
        (1, 3584, true),
        (1, 512, false),
        (7, 14336, true),
        (128, 3584, true),
        (64, 768, false),
    ] {
        v.push(ParityCase::new(
            format!(
                "rms_norm/{} n={n} d={d}",
                if weighted { "weighted" } else { "unweighted" }
            ),
            RmsNorm { eps: 1e-6 },
            99 + (n * d) as u64,
            NMSE_F32,
            move |r| {
                let mut ins = vec![HostValue::f32([n, d], &r.signed_vec(n * d, 1e3))];
                if weighted {
                    ins.push(HostValue::f32([d], &r.signed_vec(d, 2.0)));
                }
                ins
            },
        ));
    }
    v
}
