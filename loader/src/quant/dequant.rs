use half::{bf16, f16};

use super::BlockSizeError;
use crate::GgmlType;

/// The IQ4_NL non-linear codebook (ggml `kvalues_iq4nl`).
pub const IQ4NL_CODEBOOK: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

fn read_f16(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// Decodes one BF16 value (exact).
#[inline]
pub fn dequantize_block_bf16(b: [u8; 2]) -> f32 {
    bf16::from_le_bytes(b).to_f32()
}

/// Dequantizes `out.len()` values stored as `ty` in `src`.
///
/// `src` must hold exactly the bytes of those values; `out.len()` must be a
/// whole number of blocks.
pub fn dequantize(ty: GgmlType, src: &[u8], out: &mut [f32]) -> Result<(), BlockSizeError> {
    let n = out.len();
    let expected = ty.row_bytes(n).ok_or(BlockSizeError {
        ty,
        n_values: n,
        expected: n.div_ceil(ty.block_size()) * ty.block_bytes(),
        found: src.len(),
    })?;
    if src.len() != expected {
        return Err(BlockSizeError {
            ty,
            n_values: n,
            expected,
            found: src.len(),
        });
    }
    dequantize_row(ty, src, out);
    Ok(())
}

/// Dequantizes without checking sizes beyond slice bounds: the caller has
/// already validated that `src` is `ty.row_bytes(out.len())` bytes.
pub fn dequantize_row(ty: GgmlType, src: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::F32 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = read_f16(b);
            }
        }
        GgmlType::BF16 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = dequantize_block_bf16([b[0], b[1]]);
            }
        }
        GgmlType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(34)) {
                let d = read_f16(&b[0..2]);
                for (v, &q) in o.iter_mut().zip(&b[2..34]) {
                    *v = d * (q as i8) as f32;
                }
            }
        }
        GgmlType::IQ4_NL => {
            for (o, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(18)) {
                let d = read_f16(&b[0..2]);
                let qs = &b[2..18];
                for j in 0..16 {
                    o[j] = d * IQ4NL_CODEBOOK[(qs[j] & 0x0F) as usize] as f32;
                    o[j + 16] = d * IQ4NL_CODEBOOK[(qs[j] >> 4) as usize] as f32;
                }
            }
        }
        GgmlType::Q6_K => {
            for (o, b) in out.chunks_exact_mut(256).zip(src.chunks_exact(210)) {
                let ql = &b[0..128];
                let qh = &b[128..192];
                let scales = &b[192..208];
                let d = read_f16(&b[208..210]);
                for half_idx in 0..2 {
                    let ql = &ql[64 * half_idx..];
                    let qh = &qh[32 * half_idx..];
                    let sc = &scales[8 * half_idx..];
                    let y = &mut o[128 * half_idx..];
                    for l in 0..32 {
                        let is = l / 16;
                        let q0 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q1 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        y[l] = d * (sc[is] as i8) as f32 * q0 as f32;
                        y[l + 32] = d * (sc[is + 2] as i8) as f32 * q1 as f32;
                        y[l + 64] = d * (sc[is + 4] as i8) as f32 * q2 as f32;
                        y[l + 96] = d * (sc[is + 6] as i8) as f32 * q3 as f32;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_of_the_wrong_length_is_an_error_naming_the_sizes() {
        let mut out = [0f32; 32];
        let err = dequantize(GgmlType::IQ4_NL, &[0u8; 17], &mut out).unwrap_err();
        assert_eq!((err.expected, err.found), (18, 17));
        assert!(err.to_string().contains("IQ4_NL"));
    }

    #[test]
    fn iq4nl_low_nibbles_are_the_first_half_of_the_block() {
        let mut b = [0u8; 18];
        b[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[2] = 0x0F; // value 0 -> code 15, value 16 -> code 0 (high nibble 0)
        let mut out = [0f32; 32];
        dequantize(GgmlType::IQ4_NL, &b, &mut out).unwrap();
        assert_eq!(out[0], 0.5 * 113.0);
        assert_eq!(out[16], 0.5 * -127.0);
    }
}
