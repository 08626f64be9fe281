//! Block formats: dequantization of every supported storage type (spec §6.2)
//! and the quantizers the checkpoint writer uses.

mod dequant;
mod iq4_nl;
mod q6_k;
mod q8_0;

pub use dequant::{IQ4NL_CODEBOOK, dequantize, dequantize_block_bf16, dequantize_row};
pub use iq4_nl::nearest_iq4nl_index;

use half::f16;

use crate::GgmlType;

/// A buffer whose length is not what its type and value count require.
///
/// From [`quantize`]: `n_values` does not fill whole blocks; `expected` is the byte size of the
/// blocks that would cover it and `found` what the whole blocks alone take.
/// From [`quantize_iq4_nl`] with importance weights of the wrong length: `expected` and `found`
/// count weights, not bytes.
#[derive(Debug, thiserror::Error)]
#[error("{ty} data for {n_values} values must be {expected} bytes, found {found}")]
pub struct BlockSizeError {
    pub ty: GgmlType,
    pub n_values: usize,
    pub expected: usize,
    pub found: usize,
}

fn whole_blocks(ty: GgmlType, n: usize) -> Result<(), BlockSizeError> {
    let bs = ty.block_size();
    if n.is_multiple_of(bs) {
        return Ok(());
    }
    Err(BlockSizeError {
        ty,
        n_values: n,
        expected: n.div_ceil(bs) * ty.block_bytes(),
        found: n / bs * ty.block_bytes(),
    })
}

/// f32 → BF16 bits as ggml rounds: to nearest, ties to even; NaN stays a (quiet) NaN.
#[inline]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    if u & 0x7FFF_FFFF > 0x7F80_0000 {
        return ((u >> 16) | 0x40) as u16;
    }
    ((u + (0x7FFF + ((u >> 16) & 1))) >> 16) as u16
}

/// Appends `src` encoded as `ty` to `dst`. `src.len()` must be a whole number of blocks.
///
/// F16 rounds to nearest-even; BF16 as [`f32_to_bf16_bits`]; Q8_0 as ggml's reference
/// quantizer; IQ4_NL as [`quantize_iq4_nl`] without importance weights; Q6_K with this crate's
/// encoder (valid Q6_K, not byte-identical to llama.cpp).
pub fn quantize(ty: GgmlType, src: &[f32], dst: &mut Vec<u8>) -> Result<(), BlockSizeError> {
    whole_blocks(ty, src.len())?;
    dst.reserve(src.len() / ty.block_size() * ty.block_bytes());
    match ty {
        GgmlType::F32 => src
            .iter()
            .for_each(|v| dst.extend_from_slice(&v.to_le_bytes())),
        GgmlType::F16 => src
            .iter()
            .for_each(|&v| dst.extend_from_slice(&f16::from_f32(v).to_le_bytes())),
        GgmlType::BF16 => src
            .iter()
            .for_each(|&v| dst.extend_from_slice(&f32_to_bf16_bits(v).to_le_bytes())),
        GgmlType::Q8_0 => src
            .chunks_exact(32)
            .for_each(|b| dst.extend_from_slice(&q8_0::quantize_block(b))),
        GgmlType::Q6_K => src
            .chunks_exact(256)
            .for_each(|b| dst.extend_from_slice(&q6_k::quantize_block(b))),
        GgmlType::IQ4_NL => src
            .chunks_exact(32)
            .for_each(|b| dst.extend_from_slice(&iq4_nl::quantize_block(b, None))),
    }
    Ok(())
}

/// Appends `src` as IQ4_NL blocks, exactly as llama.cpp's `quantize_iq4_nl` (spec §6.3, the
/// `ntry = 7` search). `importance`, when given, holds one weight per value of `src` (an imatrix
/// row repeated for every row of the tensor).
pub fn quantize_iq4_nl(
    src: &[f32],
    importance: Option<&[f32]>,
    dst: &mut Vec<u8>,
) -> Result<(), BlockSizeError> {
    whole_blocks(GgmlType::IQ4_NL, src.len())?;
    if let Some(w) = importance
        && w.len() != src.len()
    {
        return Err(BlockSizeError {
            ty: GgmlType::IQ4_NL,
            n_values: src.len(),
            expected: src.len(),
            found: w.len(),
        });
    }
    dst.reserve(src.len() / 32 * 18);
    for (i, b) in src.chunks_exact(32).enumerate() {
        let qw = importance.map(|w| &w[32 * i..32 * i + 32]);
        dst.extend_from_slice(&iq4_nl::quantize_block(b, qw));
    }
    Ok(())
}
