//! Shared CPU building blocks: a matrix product over any stored weight type,
//! dequantizing one weight row at a time (never a dense copy of the matrix).

use rayon::prelude::*;

use crate::OpError;
use crate::tensor::DType;

/// Weight rows handed to one rayon task; large enough to amortize the scheduling.
const ROWS_PER_TASK: usize = 16;

/// `y[t][o] = Σ_i W[o][i] · x[t][i]` for `t < n_tok`, `o < n_out`.
///
/// `w` holds `n_out` rows of `n_in` values stored as `dtype`; `x` is `n_tok × n_in`
/// f32 and `y` is `n_tok × n_out` f32 (every element written). Each weight row is
/// dequantized once into a scratch row and dotted with every token, so prefill
/// reads the weights once. Accumulation is f32 in index order, per (t, o).
pub fn matmul(
    w: &[u8],
    dtype: DType,
    n_out: usize,
    n_in: usize,
    x: &[f32],
    n_tok: usize,
    y: &mut [f32],
) -> Result<(), OpError> {
    let ty = dtype
        .ggml()
        .ok_or_else(|| OpError::Type(format!("{dtype} is not a weight type")))?;
    let row_bytes = ty
        .row_bytes(n_in)
        .ok_or_else(|| OpError::Type(format!("{dtype} rows of {n_in} are not whole blocks")))?;
    if w.len() < row_bytes * n_out || x.len() < n_tok * n_in || y.len() < n_tok * n_out {
        return Err(OpError::Type(format!(
            "matmul buffers too small: w {} (need {}), x {} (need {}), y {} (need {})",
            w.len(),
            row_bytes * n_out,
            x.len(),
            n_tok * n_in,
            y.len(),
            n_tok * n_out
        )));
    }
    // Results are computed per block of output rows into a local [rows × n_tok]
    // buffer, then scattered, because y is token-major.
    let blocks: Vec<(usize, Vec<f32>)> = (0..n_out.div_ceil(ROWS_PER_TASK))
        .into_par_iter()
        .map(|b| {
            let o0 = b * ROWS_PER_TASK;
            let o1 = (o0 + ROWS_PER_TASK).min(n_out);
            let mut scratch = vec![0f32; n_in];
            let mut local = vec![0f32; (o1 - o0) * n_tok];
            for o in o0..o1 {
                loader::quant::dequantize_row(
                    ty,
                    &w[o * row_bytes..(o + 1) * row_bytes],
                    &mut scratch,
                );
                for t in 0..n_tok {
                    local[(o - o0) * n_tok + t] = dot(&scratch, &x[t * n_in..(t + 1) * n_in]);
                }
            }
            (o0, local)
        })
        .collect();
    for (o0, local) in blocks {
        let rows = local.len() / n_tok.max(1);
        for r in 0..rows {
            for t in 0..n_tok {
                y[t * n_out + o0 + r] = local[r * n_tok + t];
            }
        }
    }
    Ok(())
}

/// f32 dot product with eight independent partial sums (vectorizes; a fixed
/// order, so the result is the same on every run).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let chunks = n / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut tail = 0f32;
    for i in chunks * 8..n {
        tail += a[i] * b[i];
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matmul_over_f32_weights_is_the_plain_product() {
        let (n_out, n_in, n_tok) = (37, 5, 3);
        let wf: Vec<f32> = (0..n_out * n_in).map(|i| (i as f32 * 0.37).sin()).collect();
        let x: Vec<f32> = (0..n_tok * n_in).map(|i| (i as f32 * 0.11).cos()).collect();
        let w: Vec<u8> = wf.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut y = vec![f32::NAN; n_tok * n_out];
        matmul(&w, DType::F32, n_out, n_in, &x, n_tok, &mut y).unwrap();
        for t in 0..n_tok {
            for o in 0..n_out {
                let want: f64 = (0..n_in)
                    .map(|i| wf[o * n_in + i] as f64 * x[t * n_in + i] as f64)
                    .sum();
                assert!((y[t * n_out + o] as f64 - want).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn matmul_refuses_buffers_that_are_too_small() {
        let mut y = vec![0f32; 2];
        assert!(matmul(&[0u8; 4], DType::F32, 2, 1, &[1.0], 1, &mut y).is_err());
    }
}
