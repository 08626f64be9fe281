//! `y = W · x` for a stored weight `[out, in]` of any weight type (spec §0).

use crate::cpu::matmul;
use crate::elementwise::{arity, check_io, want_dtype};
use crate::tensor::{DType, HostTensor, HostTensorMut, TensorMeta};
use crate::{Op, OpError};

/// Inputs: `x` F32 `[n, in]`, `W` `[out, in]` of F32/F16/BF16/Q8_0/Q6_K/IQ4_NL
/// (`in` whole blocks of W's type). Output F32 `[n, out]`, `y[t][o] = Σ_i W[o][i]·x[t][i]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Linear;

impl Op for Linear {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        arity(op, inputs, 2)?;
        let (x, w) = (inputs[0], inputs[1]);
        want_dtype(op, "x", x, DType::F32)?;
        if x.shape.len() != 2 {
            return Err(OpError::shape(op, format!("x must be [n, in], found {x}")));
        }
        if w.shape.len() != 2 || w.dtype.ggml().is_none() {
            return Err(OpError::shape(
                op,
                format!("weight must be a stored [out, in] matrix, found {w}"),
            ));
        }
        if w.shape[1] != x.shape[1] {
            return Err(OpError::shape(
                op,
                format!(
                    "weight {w} takes {} inputs, x {x} has {}",
                    w.shape[1], x.shape[1]
                ),
            ));
        }
        if w.bytes().is_none() {
            return Err(OpError::shape(
                op,
                format!(
                    "weight {w}: rows of {} are not whole {} blocks",
                    w.shape[1], w.dtype
                ),
            ));
        }
        Ok(vec![TensorMeta::f32([x.shape[0], w.shape[0]])])
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        check_io(self, inputs, outputs)?;
        let (x, w) = (&inputs[0], &inputs[1]);
        let (n, n_in, n_out) = (x.meta.shape[0], x.meta.shape[1], w.meta.shape[0]);
        matmul(
            w.data,
            w.meta.dtype,
            n_out,
            n_in,
            x.f32()?,
            n,
            outputs[0].f32_mut()?,
        )
    }

    fn describe(&self) -> String {
        "linear".to_string()
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;
    use crate::elementwise::testkit::*;
    use loader::GgmlType;

    /// Weight bytes of `rows × cols` values for `dtype`: float types from random
    /// values, block types from random bytes with a finite random f16 scale.
    fn random_weight(r: &mut Lcg, dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
        let n = rows * cols;
        match dtype {
            DType::F32 => r
                .vec(n, -1.0, 1.0)
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            DType::F16 => r
                .vec(n, -1.0, 1.0)
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                .collect(),
            DType::BF16 => r
                .vec(n, -1.0, 1.0)
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
            DType::Q8_0 | DType::Q6_K | DType::IQ4_NL => {
                let ty = dtype.ggml().unwrap();
                let mut bytes: Vec<u8> = (0..ty.row_bytes(n).unwrap())
                    .map(|_| r.next_u32() as u8)
                    .collect();
                // Where each block keeps its f16 scale.
                let at = if ty == GgmlType::Q6_K { 208 } else { 0 };
                for b in bytes.chunks_exact_mut(ty.block_bytes()) {
                    let d = f16::from_f32(r.uniform(-0.02, 0.02));
                    b[at..at + 2].copy_from_slice(&d.to_le_bytes());
                }
                bytes
            }
            DType::I32 => unreachable!("not a weight type"),
        }
    }

    #[test]
    fn linear_matches_the_f64_product_of_the_dequantized_weight_for_every_weight_type() {
        let mut r = Lcg(11);
        let types = [
            DType::F32,
            DType::F16,
            DType::BF16,
            DType::Q8_0,
            DType::Q6_K,
            DType::IQ4_NL,
        ];
        for dtype in types {
            let (n, n_in, n_out) = (3, 512, 37);
            let wb = random_weight(&mut r, dtype, n_out, n_in);
            let mut wf = vec![0f32; n_out * n_in];
            loader::quant::dequantize(dtype.ggml().unwrap(), &wb, &mut wf).unwrap();
            let x = r.vec(n * n_in, -4.0, 4.0);
            let w = Owned::from_bytes(TensorMeta::new([n_out, n_in], dtype), &wb);
            let y = run(&Linear, &[&Owned::f32([n, n_in], &x), &w]).unwrap()[0].to_f32();
            // f32 dot of n_in terms: |error| ≤ γ_n · Σ|w·x| with γ_n = n·u/(1 − n·u).
            let u = f32::EPSILON as f64 / 2.0;
            let gamma = n_in as f64 * u / (1.0 - n_in as f64 * u);
            for t in 0..n {
                for o in 0..n_out {
                    let terms = (0..n_in).map(|i| wf[o * n_in + i] as f64 * x[t * n_in + i] as f64);
                    let want: f64 = terms.clone().sum();
                    let abs: f64 = terms.map(f64::abs).sum();
                    let got = y[t * n_out + o] as f64;
                    assert!(
                        (got - want).abs() <= gamma * abs + 1e-30,
                        "{dtype} y[{t}][{o}] = {got}, f64 {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn linear_refuses_a_mismatched_input_width_a_partial_block_and_a_non_f32_input() {
        let e = infer(
            &Linear,
            &[
                TensorMeta::f32([2, 64]),
                TensorMeta::new([8, 32], DType::BF16),
            ],
        )
        .unwrap_err();
        assert!(matches!(e, OpError::Shape { op: "linear", .. }), "{e}");
        let e = infer(
            &Linear,
            &[
                TensorMeta::f32([2, 48]),
                TensorMeta::new([8, 48], DType::Q8_0),
            ],
        )
        .unwrap_err();
        assert!(
            matches!(e, OpError::Shape { .. }) && e.to_string().contains("Q8_0"),
            "{e}"
        );
        let e = infer(
            &Linear,
            &[
                TensorMeta::new([2, 32], DType::BF16),
                TensorMeta::f32([8, 32]),
            ],
        )
        .unwrap_err();
        assert!(matches!(e, OpError::Shape { .. }), "{e}");
        let e = infer(
            &Linear,
            &[TensorMeta::f32([2, 32]), TensorMeta::i32([8, 32])],
        )
        .unwrap_err();
        assert!(matches!(e, OpError::Shape { .. }), "{e}");
        assert_eq!(
            infer(
                &Linear,
                &[
                    TensorMeta::f32([2, 256]),
                    TensorMeta::new([8, 256], DType::Q6_K)
                ]
            ),
            Ok(vec![TensorMeta::f32([2, 8])])
        );
    }

    #[test]
    fn a_weight_buffer_shorter_than_its_shape_is_an_error_not_a_panic() {
        let x = Owned::f32([1, 32], &[1.0; 32]);
        let w = Owned::from_bytes(TensorMeta::new([2, 32], DType::IQ4_NL), &[0u8; 18]);
        assert!(run(&Linear, &[&x, &w]).is_err());
    }
}
