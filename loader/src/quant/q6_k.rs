//! A Q6_K encoder: correct packing (spec §6.2), a simple least-squares scale search.
//!
//! Not ggml's `make_qx_quants` (the spec leaves that unspecified); files it writes decode with
//! any Q6_K reader but are not byte-identical to llama.cpp's.

use half::f16;

const QK: usize = 256;
const SUB: usize = 16;

/// Round half to even without a libm call (baseline x86-64 has no rounding instruction):
/// adding 1.5·2^23 leaves no fraction bits. Exact for |x| < 2^22; callers clamp first.
#[inline]
fn round(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (x + MAGIC) - MAGIC
}

/// Codes for 16 values at the scale that best fits them, searched over inverse scales that map
/// the largest-magnitude value near -32 (the end of the 6-bit range that has room for it).
/// Returns the least-squares scale for the chosen codes (0 for an all-zero group).
fn fit_group(x: &[f32]) -> f32 {
    let mut amax = 0f32;
    let mut max = 0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        return 0.0;
    }
    let mut best = (0f32, 0f32); // (score = sumlx²/suml2, scale)
    for t in -4..=12 {
        let iscale = -(32.0 - 0.25 * t as f32) / max;
        let (mut sumlx, mut suml2) = (0f32, 0f32);
        for &v in x {
            let l = round((iscale * v).clamp(-32.0, 31.0));
            sumlx += l * v;
            suml2 += l * l;
        }
        if suml2 > 0.0 {
            let score = sumlx * sumlx / suml2;
            if score > best.0 {
                best = (score, sumlx / suml2);
            }
        }
    }
    best.1
}

/// Quantizes one block of 256 values to its 210 bytes: `ql[128] qh[64] scales[16] d`.
pub(super) fn quantize_block(x: &[f32]) -> [u8; 210] {
    debug_assert_eq!(x.len(), QK);
    let mut sub = [0f32; QK / SUB];
    let (mut amax, mut max) = (0f32, 0f32);
    for (s, g) in sub.iter_mut().zip(x.chunks_exact(SUB)) {
        *s = fit_group(g);
        if s.abs() > amax {
            amax = s.abs();
            max = *s;
        }
    }

    let mut out = [0u8; 210];
    let mut codes = [32u8; QK];
    if amax > 0.0 {
        // The largest sub-scale maps to -128, the end of i8 that has room for it.
        let iscale = -128.0 / max;
        let d = f16::from_f32(1.0 / iscale);
        out[208..210].copy_from_slice(&d.to_le_bytes());
        let d = d.to_f32();
        for (ib, g) in x.chunks_exact(SUB).enumerate() {
            let sc = round((iscale * sub[ib]).clamp(-128.0, 127.0)) as i8;
            out[192 + ib] = sc as u8;
            let dl = d * sc as f32;
            if dl == 0.0 {
                continue;
            }
            for (c, &v) in codes[ib * SUB..(ib + 1) * SUB].iter_mut().zip(g) {
                *c = (round((v / dl).clamp(-32.0, 31.0)) + 32.0) as u8;
            }
        }
    }

    let (ql, rest) = out.split_at_mut(128);
    let qh = &mut rest[..64];
    for n in 0..2 {
        for l in 0..32 {
            let q = |k: usize| codes[128 * n + l + 32 * k];
            ql[64 * n + l] = (q(0) & 0xF) | ((q(2) & 0xF) << 4);
            ql[64 * n + l + 32] = (q(1) & 0xF) | ((q(3) & 0xF) << 4);
            qh[32 * n + l] =
                (q(0) >> 4) | ((q(1) >> 4) << 2) | ((q(2) >> 4) << 4) | ((q(3) >> 4) << 6);
        }
    }
    out
}
