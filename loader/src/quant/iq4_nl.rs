//! llama.cpp's IQ4_NL quantizer, the `ntry = 7` path that `llama-quantize` uses (spec §6.3).
//!
//! Every float operation is done in f32 in the order the spec writes it, so blocks come out
//! byte-identical to ggml's scalar code built without floating-point contraction.

use half::f16;

use super::IQ4NL_CODEBOOK as K;

const BLOCK: usize = 32;
const NTRY: i32 = 7;
/// ggml's `GROUP_MAX_EPS`.
const GROUP_MAX_EPS: f32 = 1e-15;

/// `UPPER[i]` is the `m` with `K[m-1] <= i - 127 < K[m]`, for the integers `i - 127` from
/// `K[0]` to `K[15]` inclusive (the last entry, 15, stands for `K[15]` itself). Because the
/// codebook is integral, `floor(v)` brackets `v` between the same pair as `v` itself.
const UPPER: [u8; (K[15] as i32 - K[0] as i32 + 1) as usize] = {
    let mut t = [15u8; (K[15] as i32 - K[0] as i32 + 1) as usize];
    let mut m = 1;
    let mut i = 0;
    while i + 1 < t.len() {
        let f = K[0] as i32 + i as i32;
        while f >= K[m] as i32 {
            m += 1;
        }
        t[i] = m as u8;
        i += 1;
    }
    t
};

/// The codebook as f32, for the comparisons.
const KF: [f32; 16] = {
    let mut t = [0f32; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = K[i] as f32;
        i += 1;
    }
    t
};

/// `MID[m]` = (K[m-1] + K[m]) / 2 (exact: a multiple of 0.5); `MID[0]` is unused.
///
/// ggml's test `v − K[m−1] < K[m] − v` is exactly `v < MID[m]`: near a midpoint both
/// differences are exact in f32 (every midpoint has |MID| ≥ 4.5, so v there is at least as
/// finely spaced as the half-gaps ≤ 12, and half-gaps ≥ 8 occur only at |MID| ≥ 57), and away
/// from it rounding cannot flip the test. So the nearest code value is `K[0]` plus the steps of
/// every midpoint at or below `v` — straight-line code that vectorizes over candidates.
const MID: [f32; 16] = {
    let mut t = [0f32; 16];
    let mut m = 1;
    while m < 16 {
        t[m] = (K[m - 1] as f32 + K[m] as f32) / 2.0;
        m += 1;
    }
    t
};

/// The codebook index nearest to `v` (ggml `best_index_int8`): 0 at or below `K[0]`, 15 at or
/// above `K[15]`, otherwise the closer of the bracketing pair with exact ties going to the upper
/// code. NaN maps to 15, as ggml's search ends there.
#[inline]
pub fn nearest_iq4nl_index(v: f32) -> usize {
    if v.is_nan() {
        return 15;
    }
    // floor(v) - K[0] by truncating a positive number (a call-free floor; the cast saturates,
    // the clamp covers v outside the codebook, where the bracket's comparison below then
    // returns 0 or 15). The sum may round up to the next integer when v is just below one;
    // if that integer is a code K[m], the bracket becomes [K[m], K[m+1]) and the comparison
    // still picks m, the correct answer, because it uses the exact v.
    let i = ((v - (KF[0] - 1.0)) as i32).clamp(1, UPPER.len() as i32) as usize - 1;
    let m = UPPER[i] as usize;
    // Branch-free: the outcome is data-dependent and would mispredict half the time.
    m - usize::from(v - KF[m - 1] < KF[m] - v)
}

/// Quantizes one block of 32 values to its 18 bytes (`f16 d` then 16 nibble pairs).
pub(super) fn quantize_block(x: &[f32], qw: Option<&[f32]>) -> [u8; 18] {
    debug_assert_eq!(x.len(), BLOCK);
    let mut sigma2 = 0f32;
    for &v in x {
        sigma2 += v * v;
    }
    sigma2 *= 2.0 / BLOCK as f32;

    let mut w = [0f32; BLOCK];
    match qw {
        Some(qw) => {
            for j in 0..BLOCK {
                w[j] = qw[j] * (sigma2 + x[j] * x[j]).sqrt();
            }
        }
        None => {
            for j in 0..BLOCK {
                w[j] = x[j] * x[j];
            }
        }
    }

    let mut amax = 0f32;
    let mut max = 0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }

    let scale = if amax < GROUP_MAX_EPS {
        0.0
    } else {
        // The first mapping (d = xm/127) and the 15 candidates do not depend on each other, so
        // their sums are accumulated side by side; each one still adds its terms in j order,
        // as ggml does, so every sum is bit-identical to the sequential loop.
        let mut ids = [0f32; 2 + 2 * NTRY as usize];
        ids[0] = 1.0 / (-max / KF[0]);
        for (k, itry) in (-NTRY..=NTRY).enumerate() {
            ids[k + 1] = (itry + K[0] as i32) as f32 / max;
        }
        let mut sumqx = [0f32; 2 + 2 * NTRY as usize];
        let mut sumq2 = [0f32; 2 + 2 * NTRY as usize];
        if !x.iter().all(|v| v.is_finite()) {
            // Garbage in, but the same garbage as ggml: a NaN product maps to code 15, which
            // the midpoint count below would not do.
            for j in 0..BLOCK {
                for k in 0..ids.len() {
                    let q = KF[nearest_iq4nl_index(ids[k] * x[j])];
                    sumqx[k] += w[j] * q * x[j];
                    sumq2[k] += w[j] * q * q;
                }
            }
        } else {
            const N: usize = 2 + 2 * NTRY as usize;
            for j in 0..BLOCK {
                let (xj, wj) = (x[j], w[j]);
                // Loops over the 16 candidates innermost: each compiles to a few SIMD ops.
                let mut v = [0f32; N];
                for k in 0..N {
                    v[k] = ids[k] * xj;
                }
                let mut q = [KF[0]; N];
                for m in 1..16 {
                    let (mid, step) = (MID[m], KF[m] - KF[m - 1]);
                    for k in 0..N {
                        q[k] += if v[k] >= mid { step } else { 0.0 };
                    }
                }
                for k in 0..N {
                    sumqx[k] += wj * q[k] * xj;
                    sumq2[k] += wj * q[k] * q[k];
                }
            }
        }
        let mut d = sumqx[0] / sumq2[0];
        let mut best = d * sumqx[0];
        for k in 1..ids.len() {
            if sumq2[k] > 0.0 && sumqx[k] * sumqx[k] > best * sumq2[k] {
                d = sumqx[k] / sumq2[k];
                best = d * sumqx[k];
            }
        }
        d
    };

    let mut out = [0u8; 18];
    out[0..2].copy_from_slice(&f16::from_f32(scale).to_le_bytes());
    // The final assignment uses the f32 scale, not its f16 rounding (as ggml does).
    let id = if scale != 0.0 { 1.0 / scale } else { 0.0 };
    for j in 0..16 {
        let lo = nearest_iq4nl_index(id * x[j]) as u8;
        let hi = nearest_iq4nl_index(id * x[j + 16]) as u8;
        out[2 + j] = lo | (hi << 4);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The spec's binary search, written out, to check the table against.
    fn nearest_by_search(v: f32) -> usize {
        if v <= K[0] as f32 {
            return 0;
        }
        if v >= K[15] as f32 {
            return 15;
        }
        let (mut ml, mut mu) = (0usize, 15usize);
        while mu - ml > 1 {
            let mav = (ml + mu) / 2;
            if v < K[mav] as f32 {
                mu = mav;
            } else {
                ml = mav;
            }
        }
        if v - (K[mu - 1] as f32) < (K[mu] as f32) - v {
            mu - 1
        } else {
            mu
        }
    }

    /// The value the vectorized candidate loop computes for one lane.
    fn nearest_value(v: f32) -> f32 {
        let mut q = KF[0];
        for m in 1..16 {
            q += if v >= MID[m] { KF[m] - KF[m - 1] } else { 0.0 };
        }
        q
    }

    #[test]
    fn counting_midpoints_agrees_with_the_binary_search_at_every_midpoint_and_code() {
        for m in 1..16 {
            for v in [MID[m], KF[m], KF[m - 1]] {
                for v in [v.next_down(), v, v.next_up()] {
                    assert_eq!(nearest_value(v), KF[nearest_by_search(v)], "v = {v:e}");
                }
            }
        }
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..1_000_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let v = (state >> 40) as f32 / (1u64 << 24) as f32 * 280.0 - 140.0;
            assert_eq!(nearest_value(v), KF[nearest_by_search(v)], "v = {v:e}");
        }
    }

    /// Spec §6.3 written out literally: sequential candidate loop, binary-search `nearest`.
    fn reference_block(x: &[f32], qw: Option<&[f32]>) -> [u8; 18] {
        let mut sigma2 = 0f32;
        for &v in x {
            sigma2 += v * v;
        }
        sigma2 *= 2.0 / 32.0;
        let w: Vec<f32> = (0..32)
            .map(|j| match qw {
                Some(qw) => qw[j] * (sigma2 + x[j] * x[j]).sqrt(),
                None => x[j] * x[j],
            })
            .collect();
        let (mut amax, mut xm) = (0f32, 0f32);
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                xm = v;
            }
        }
        let sums = |id: f32| {
            let (mut sqx, mut sqq) = (0f32, 0f32);
            for j in 0..32 {
                let q = K[nearest_by_search(id * x[j])] as f32;
                sqx += w[j] * q * x[j];
                sqq += w[j] * q * q;
            }
            (sqx, sqq)
        };
        let scale = if amax < 1e-15 {
            0.0
        } else {
            let d = xm / 127.0;
            let (sqx, sqq) = sums(1.0 / d);
            let mut d = sqx / sqq;
            let mut best = d * sqx;
            for t in -7..=7 {
                let (sqx, sqq) = sums((t - 127) as f32 / xm);
                if sqq > 0.0 && sqx * sqx > best * sqq {
                    d = sqx / sqq;
                    best = d * sqx;
                }
            }
            d
        };
        let mut out = [0u8; 18];
        out[0..2].copy_from_slice(&f16::from_f32(scale).to_le_bytes());
        let id = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        for j in 0..16 {
            let lo = nearest_by_search(id * x[j]) as u8;
            let hi = nearest_by_search(id * x[j + 16]) as u8;
            out[2 + j] = lo | (hi << 4);
        }
        out
    }

    #[test]
    fn the_block_quantizer_matches_the_spec_written_out_literally() {
        let mut state = 0x1234_5678_9ABC_DEF1u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        for b in 0..8_000 {
            let scale = [1.0, 1e-3, 40.0, 1e-12][b % 4];
            let mut x: Vec<f32> = (0..32).map(|_| scale * next()).collect();
            match b % 7 {
                // Repeated values and exact zeros: ties in the amax search and the scale fit.
                0 => x[5] = x[3],
                1 => x[..10].iter_mut().for_each(|v| *v = 0.0),
                2 => x[9] = f32::INFINITY,
                3 => x[20] = f32::NAN,
                _ => {}
            }
            let qw: Vec<f32> = (0..32).map(|_| next() + 0.5).collect();
            assert_eq!(
                quantize_block(&x, None),
                reference_block(&x, None),
                "block {b}: {x:?}"
            );
            let qw = Some(qw.as_slice());
            assert_eq!(
                quantize_block(&x, qw),
                reference_block(&x, qw),
                "block {b} (weighted)"
            );
        }
    }

    #[test]
    fn the_lookup_table_agrees_with_the_binary_search_everywhere() {
        let mut v = -140.0f32;
        while v < 140.0 {
            assert_eq!(nearest_iq4nl_index(v), nearest_by_search(v), "v = {v}");
            v += 1.0 / 64.0;
        }
        // Just below, at and just above every integer: where a rounded floor could misbracket.
        for i in -130..=130 {
            let f = i as f32;
            for v in [f.next_down(), f, f.next_up(), f - 1e-5, f + 1e-5] {
                assert_eq!(nearest_iq4nl_index(v), nearest_by_search(v), "v = {v:e}");
            }
        }
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..1_000_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let v = (state >> 40) as f32 / (1u64 << 24) as f32 * 280.0 - 140.0;
            assert_eq!(nearest_iq4nl_index(v), nearest_by_search(v), "v = {v:e}");
        }
    }
}
