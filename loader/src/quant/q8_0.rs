//! Q8_0 as ggml's reference quantizer writes it (spec §6.2).

use half::f16;

/// One block of 32 values: `d = amax/127` stored as f16, `q = round(x/d)` with the f32 `d`.
pub(super) fn quantize_block(x: &[f32]) -> [u8; 34] {
    debug_assert_eq!(x.len(), 32);
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut out = [0u8; 34];
    out[0..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for (o, &v) in out[2..].iter_mut().zip(x) {
        // `round` is half away from zero, like C's roundf.
        *o = ((v * id).round() as i8) as u8;
    }
    out
}
