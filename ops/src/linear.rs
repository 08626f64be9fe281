//! `y = W · x` for a stored weight `[out, in]` of any weight type (spec §0).

use crate::cpu::matmul;
use crate::elementwise::{arity, want_dtype};
use crate::gpu::{DeviceTensor, GpuCtx, Scratch, dev_err};
use crate::op::{check_device, check_host};
use crate::tensor::{DType, HostTensor, HostTensorMut, TensorMeta};
use crate::{Op, OpError};

pub(crate) const LINEAR_CU: &str = concat!(
    include_str!("../kernels/dequant.cuh"),
    include_str!("../kernels/linear.cu")
);

/// A launch dimension or size as the kernels' `int`, or a shape error naming it.
pub(crate) fn as_i32(op: &'static str, what: &str, v: usize) -> Result<i32, OpError> {
    i32::try_from(v)
        .map_err(|_| OpError::shape(op, format!("{what} = {v} exceeds the kernels' i32 range")))
}

/// The weight-type code of `kernels/dequant.cuh`.
pub(crate) fn wt_code(dtype: DType) -> Option<i32> {
    Some(match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::Q8_0 => 3,
        DType::Q6_K => 4,
        DType::IQ4_NL => 5,
        DType::I32 => return None,
    })
}

fn kernel_suffix(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::Q8_0 => "q8_0",
        DType::Q6_K => "q6_k",
        DType::IQ4_NL => "iq4_nl",
        DType::I32 => "i32",
    }
}

/// Token counts up to this take the weight-streaming GEMV; more take tensor-core tiles.
pub const GEMV_MAX_TOKENS: usize = 8;
/// Warps a GEMV block, shared bytes a warp (two stages of 4096 + 32) — as in linear.cu.
const GEMV_WARPS: usize = 4;
const GEMV_SMEM: u32 = (GEMV_WARPS * 2 * (4096 + 32)) as u32;
/// GEMV blocks resident per SM (its `__launch_bounds__`); the grid never exceeds one wave.
const GEMV_BLOCKS_PER_SM: usize = 6;

/// Most K slices (warps) of a `gemv_iq4_nl_dec` block: 512 threads, its shared sums' size.
const IQ4_DEC_MAX_SLICES: usize = 16;
/// Warps resident per SM: 95 registers a thread (ptxas, sm_90) leave room for 21.
const IQ4_DEC_WARPS_PER_SM: usize = 20;
/// Rows a row group of `gemv_iq4_nl_dec` takes a step (`IQ4D_R` in linear.cu).
const IQ4_DEC_ROWS: usize = 4;

enum LinearPath {
    /// n = 1, IQ4_NL, K a multiple of 64 and at most 16 slices of 1024: `gemv_iq4_nl_dec`
    /// with this many K slices (one warp each) per row.
    Iq4Decode(usize),
    Gemv(usize),
    Tensor,
    Generic,
}

/// Which kernel a call takes: the GEMV when n ≤ 8 and K is whole units of the weight's
/// 16-byte decode group (4 F32, 8 F16/BF16, 32 Q8_0/IQ4_NL, 256 Q6_K); tensor-core tiles
/// when n > 8 and K % 32 == 0; otherwise (and for views not 16-byte aligned) the
/// element-wise fallback.
fn linear_path(dtype: DType, n: usize, k: usize, x_ptr: u64, w_ptr: u64) -> LinearPath {
    let unit = match dtype {
        DType::F32 => 4,
        DType::F16 | DType::BF16 => 8,
        DType::Q8_0 | DType::IQ4_NL => 32,
        DType::Q6_K => 256,
        DType::I32 => return LinearPath::Generic,
    };
    if k == 0 || !x_ptr.is_multiple_of(16) || !w_ptr.is_multiple_of(16) {
        LinearPath::Generic
    } else if n == 1
        && dtype == DType::IQ4_NL
        && k.is_multiple_of(64)
        && k.div_ceil(1024) <= IQ4_DEC_MAX_SLICES
    {
        LinearPath::Iq4Decode(k.div_ceil(1024))
    } else if n <= GEMV_MAX_TOKENS && k.is_multiple_of(unit) {
        LinearPath::Gemv(n.next_power_of_two())
    } else if n > GEMV_MAX_TOKENS && k.is_multiple_of(32) {
        LinearPath::Tensor
    } else {
        LinearPath::Generic
    }
}

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
        check_host(self, inputs, outputs)?;
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

    /// n ≤ 8: f32 GEMV streaming the weight once (F32 tolerance, reordered sums);
    /// n > 8: bf16 tensor-core tiles (x and the decoded weight narrowed to bf16, f32
    /// accumulation: BF16 tolerance). Deterministic either way.
    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        let op = self.name();
        check_device(self, inputs, outputs)?;
        let (x, w, y) = (&inputs[0], &inputs[1], &outputs[0]);
        let (n, k, o) = (x.meta.shape[0], x.meta.shape[1], w.meta.shape[0]);
        if n == 0 || o == 0 {
            return Ok(());
        }
        let dtype = w.meta.dtype;
        let rb = dtype
            .row_bytes(k)
            .ok_or_else(|| OpError::shape(op, format!("weight {}: partial blocks", w.meta)))?;
        let (ni, ki, oi) = (
            as_i32(op, "n", n)?,
            as_i32(op, "in", k)?,
            as_i32(op, "out", o)?,
        );
        let launch = |name: &str, grid: (u32, u32), block: u32, smem: u32, wt: Option<i32>| {
            let kern = ctx.kernel("linear.cu", LINEAR_CU, name)?;
            let l = ctx
                .device
                .launch(&kern)
                .grid(grid)
                .block(block)
                .shared_mem(smem)
                .arg(w.ptr)
                .arg(x.ptr)
                .arg(y.ptr)
                .arg(ni)
                .arg(ki)
                .arg(oi)
                .arg(rb as i64);
            let l = match wt {
                Some(code) => l.arg(code),
                None => l,
            };
            // SAFETY: the arguments follow the kernel's C signature; check_device checked
            // that x, W and y hold n×in f32, out rows of `rb` bytes and n×out f32, which
            // is all the kernels touch; the executor keeps the buffers alive.
            unsafe { l.enqueue() }.map_err(dev_err)
        };
        match linear_path(dtype, n, k, x.ptr, w.ptr) {
            LinearPath::Iq4Decode(slices) => {
                // G row groups of `slices` warps, about 8 warps a block.
                let groups = (8 / slices).max(1);
                let warps = slices * groups;
                let per_sm = (IQ4_DEC_WARPS_PER_SM / warps).max(1);
                let sms = ctx.device.sm_count() as usize;
                let blocks = o.div_ceil(groups * IQ4_DEC_ROWS).min(sms * per_sm).max(1);
                launch(
                    "gemv_iq4_nl_dec",
                    (blocks as u32, 1),
                    (32 * warps) as u32,
                    0,
                    None,
                )
            }
            LinearPath::Gemv(nt) => {
                let sms = ctx.device.sm_count() as usize;
                let blocks = o.div_ceil(GEMV_WARPS).min(sms * GEMV_BLOCKS_PER_SM);
                let name = format!("gemv_{}_{nt}", kernel_suffix(dtype));
                launch(&name, (blocks as u32, 1), 128, GEMV_SMEM, None)
            }
            LinearPath::Tensor => {
                let grid = (o.div_ceil(64), n.div_ceil(64));
                if grid.1 > 65535 {
                    return Err(OpError::shape(
                        op,
                        format!("n = {n} is more than 65535 tiles of 64"),
                    ));
                }
                let name = format!("linear_tc_{}", kernel_suffix(dtype));
                launch(&name, (grid.0 as u32, grid.1 as u32), 128, 0, None)
            }
            LinearPath::Generic => {
                let grid = (o.div_ceil(4), n.div_ceil(8));
                if grid.1 > 65535 {
                    return Err(OpError::shape(
                        op,
                        format!("n = {n} is more than 65535 groups of 8"),
                    ));
                }
                let code = wt_code(dtype).ok_or_else(|| OpError::shape(op, "weight is I32"))?;
                launch(
                    "linear_generic",
                    (grid.0 as u32, grid.1 as u32),
                    128,
                    0,
                    Some(code),
                )
            }
        }
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
