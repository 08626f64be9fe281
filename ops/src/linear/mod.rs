//! `y = W · x` for a stored weight `[out, in]` of any weight type (spec §0), and its fused
//! pair and norm-first forms. The ops and their shape rules are here, the choice of CUDA path
//! and its scratch in `plan.rs`, the CPU references in `cpu.rs`, the CUDA launches in
//! `cuda.rs` (`linear.cu`, compiled after `dequant/dequant.cuh`).

pub mod cases;
mod cpu;
mod cuda;
mod plan;
#[cfg(test)]
mod tests;

use crate::check::{arity, unlowered, want_dtype};
use crate::gpu::{DeviceTensor, GpuCtx, Scratch};
use crate::tensor::{DType, HostTensor, HostTensorMut, TensorMeta};
use crate::{Op, OpError};

pub(crate) use cuda::LINEAR_CU;
pub(crate) use plan::RowsPlan;
use plan::{Bf16SkinnyPlan, LinearPath, bf16_dec_plan, linear_path, prefill_scratch};

/// The most rows the weight-streaming GEMV kernels take (`gemv_*_<nt>`, nt ≤ 8).
pub const GEMV_ROWS_LIMIT: usize = 8;

/// The family of kernels a [`Linear`]-shaped product runs on the GPU. The graph's lowering
/// chooses it per step shape (`graph::LoweringOptions`); an op never picks its own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LinearKernel {
    /// Declared and not lowered: the CPU reference runs it, the CUDA path refuses it.
    #[default]
    Unlowered,
    /// The weight-streaming GEMV, at most [`GEMV_ROWS_LIMIT`] rows (the IQ4_NL row split, the
    /// one-token BF16 kernel, or the generic GEMV; f32 sums). With `weights_first` the
    /// one-token BF16 kernel issues its weight loads before waiting for its predecessor.
    Gemv { weights_first: bool },
    /// x narrowed to bf16, then cuBLAS (BF16 weights) or mma.sync tiles decoding the weight
    /// (other types): f32 accumulation, BF16 tolerance.
    TensorCore,
    /// A few rows (a decode step's batch) over a weight read once for all of them: IQ4_NL with
    /// whole 256-value k-tiles takes the skinny product (`moe::prefill`'s `expert_skinny_iq4`,
    /// the matrix as one expert; f16 inputs, exact codes, f32 sums), BF16 with K a multiple of 32 the
    /// skinny BF16 product (`linear_skinny_bf16`; bf16 x, f32 sums, as the tensor cores).
    /// Other weights take the tensor-core path.
    Skinny,
}

impl LinearKernel {
    /// The variant as a plan's text shows it (empty while unlowered).
    pub fn label(self) -> &'static str {
        match self {
            LinearKernel::Unlowered => "",
            LinearKernel::Gemv {
                weights_first: true,
            } => " [gemv, weights first]",
            LinearKernel::Gemv {
                weights_first: false,
            } => " [gemv]",
            LinearKernel::TensorCore => " [tensor cores]",
            LinearKernel::Skinny => " [skinny]",
        }
    }

    /// The chosen variant for `n` rows, or why the CUDA path cannot run it.
    pub(crate) fn chosen(self, op: &'static str, n: usize) -> Result<LinearKernel, OpError> {
        match self {
            LinearKernel::Unlowered => Err(unlowered(op)),
            LinearKernel::Gemv { .. } if n > GEMV_ROWS_LIMIT => Err(OpError::shape(
                op,
                format!("the GEMV takes at most {GEMV_ROWS_LIMIT} rows, found {n}"),
            )),
            k => Ok(k),
        }
    }

    fn weights_first(self) -> i32 {
        i32::from(matches!(
            self,
            LinearKernel::Gemv {
                weights_first: true
            }
        ))
    }
}

/// Whether [`LinearKernel::Gemv`] runs `n` rows over a Q6_K weight of input width `k` on the
/// integer-MMA product (otherwise on the generic GEMV, far slower past one row).
pub fn q6_k_gemv_takes(n: usize, k: usize) -> bool {
    plan::Q6kMmaPlan::choose(n, k, 1, 1).is_some()
}

/// Whether [`LinearKernel::Skinny`] runs a weight of this type and input width on the skinny
/// product (otherwise on the tensor-core path).
pub fn skinny_takes(dtype: DType, k: usize) -> bool {
    match dtype {
        DType::IQ4_NL => crate::moe::prefill::skinny_supports(k),
        DType::BF16 => plan::bf16_skinny_takes(k),
        _ => false,
    }
}

/// Inputs: `x` F32 `[n, in]`, `W` `[out, in]` of F32/F16/BF16/Q8_0/Q6_K/IQ4_NL
/// (`in` whole blocks of W's type). Output F32 `[n, out]`, `y[t][o] = Σ_i W[o][i]·x[t][i]`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Linear {
    pub kernel: LinearKernel,
}

impl Linear {
    pub fn with(kernel: LinearKernel) -> Linear {
        Linear { kernel }
    }
}

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
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        format!("linear{}", self.kernel.label())
    }

    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        self.cuda_launch(ctx, inputs, outputs, scratch)
    }

    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        match (inputs.first(), inputs.get(1)) {
            (Some(x), Some(w)) => match *x.shape.as_slice() {
                [n, k] if self.kernel == LinearKernel::Skinny && skinny_takes(w.dtype, k) => {
                    let o = w.shape.first().copied().unwrap_or(0);
                    if w.dtype == DType::BF16 {
                        Bf16SkinnyPlan::choose(n, k, o, o.div_ceil(32)).scratch_bytes(n, k, o)
                    } else {
                        crate::moe::prefill::skinny_scratch_bytes(n, k)
                    }
                }
                [n, k]
                    if matches!(self.kernel, LinearKernel::TensorCore | LinearKernel::Skinny)
                        && k.is_multiple_of(32) =>
                {
                    prefill_scratch(w.dtype, n, k, w.shape.first().copied().unwrap_or(0))
                }
                _ => 0,
            },
            _ => 0,
        }
    }
}

/// Two [`Linear`] products of the same `x` (the attention's q_a and kv_a): `y1 = x·W1ᵀ`,
/// `y2 = x·W2ᵀ`. Over BF16 weights one decode token (the blocks split between the two weights)
/// and a skinny batch (the second weight's row tiles after the first's) take one launch;
/// anything else runs the two products as [`Linear`] would. Same bits.
///
/// Inputs: x F32 `[n, in]`, W1 `[out1, in]`, W2 `[out2, in]`. Outputs: F32 `[n, out1]`,
/// `[n, out2]`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LinearPair {
    pub kernel: LinearKernel,
}

impl LinearPair {
    /// The decode plan both products share, when one launch can run them.
    fn fused_plan(
        kernel: LinearKernel,
        x: &DeviceTensor<'_>,
        w1: &DeviceTensor<'_>,
        w2: &DeviceTensor<'_>,
        sms: usize,
    ) -> Option<(usize, usize, usize)> {
        let (n, k) = (x.meta.shape[0], x.meta.shape[1]);
        let (o1, o2) = (w1.meta.shape[0], w2.meta.shape[0]);
        let one = |w: &DeviceTensor<'_>, o| {
            matches!(
                linear_path(kernel, w.meta.dtype, (n, k, o), x.ptr, w.ptr, sms),
                LinearPath::Bf16Dec(..)
            )
        };
        if !(one(w1, o1) && one(w2, o2)) {
            return None;
        }
        bf16_dec_plan(k, o1 + o2, sms)
    }

    /// The skinny BF16 plan of both products in one launch, with its rows and output
    /// columns, when the kernel is skinny and both weights are BF16 it takes.
    fn skinny_plan(
        kernel: LinearKernel,
        inputs: &[&TensorMeta],
    ) -> Option<(Bf16SkinnyPlan, usize, usize)> {
        let [x, w1, w2] = inputs else { return None };
        let (&[n, k], &[o1, _], &[o2, _]) =
            (x.shape.as_slice(), w1.shape.as_slice(), w2.shape.as_slice())
        else {
            return None;
        };
        let bf16 = |w: &TensorMeta| w.dtype == DType::BF16 && skinny_takes(w.dtype, k);
        if kernel != LinearKernel::Skinny || !bf16(w1) || !bf16(w2) {
            return None;
        }
        let tiles = o1.div_ceil(32) + o2.div_ceil(32);
        Some((Bf16SkinnyPlan::choose(n, k, o1 + o2, tiles), n, o1 + o2))
    }
}

impl Op for LinearPair {
    fn name(&self) -> &'static str {
        "linear_pair"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        arity(self.name(), inputs, 3)?;
        let mut outs = Linear::default().infer(&inputs[..2])?;
        outs.extend(Linear::default().infer(&[inputs[0], inputs[2]])?);
        Ok(outs)
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        format!("linear_pair{}", self.kernel.label())
    }

    /// The two products run one after the other, so they share one scratch.
    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        if inputs.len() != 3 {
            return 0;
        }
        if let Some((plan, n, outs)) = Self::skinny_plan(self.kernel, inputs) {
            return plan.scratch_bytes(n, inputs[0].shape[1], outs);
        }
        let one = Linear::with(self.kernel);
        one.cuda_scratch_bytes(&inputs[..2])
            .max(one.cuda_scratch_bytes(&[inputs[0], inputs[2]]))
    }

    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        self.cuda_launch(ctx, inputs, outputs, scratch)
    }
}

/// `linear(rms_norm(x)·norm_w, W)` (q_b over q_a's RMSNorm): the normalised x has no other
/// reader, so one decode token over a BF16 weight normalises x inside the GEMV (every block
/// sums x's squares itself; x is short) and the norm has no launch. Otherwise the norm and
/// the product run as [`RmsNorm`](crate::norm::RmsNorm) and [`Linear`] would.
///
/// Inputs: x F32 `[n, in]`, norm_w F32 `[in]`, W `[out, in]`. Output: F32 `[n, out]`.
#[derive(Debug, Clone, PartialEq)]
pub struct NormLinear {
    pub eps: f32,
    pub kernel: LinearKernel,
}

impl NormLinear {
    /// Scratch of the unfused path: the normalised x, then what [`Linear`] needs.
    fn split_scratch(&self, inputs: &[&TensorMeta]) -> (usize, usize) {
        let normed = (inputs[0].numel() * 4).next_multiple_of(256);
        (
            normed,
            normed + Linear::with(self.kernel).cuda_scratch_bytes(&[inputs[0], inputs[2]]),
        )
    }
}

impl Op for NormLinear {
    fn name(&self) -> &'static str {
        "norm_linear"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        let op = self.name();
        arity(op, inputs, 3)?;
        let outs = Linear::default().infer(&[inputs[0], inputs[2]])?;
        let k = inputs[0].shape[1];
        want_dtype(op, "norm weight", inputs[1], DType::F32)?;
        if inputs[1].shape != [k] {
            return Err(OpError::shape(
                op,
                format!("norm weight must be F32[{k}], found {}", inputs[1]),
            ));
        }
        Ok(outs)
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.cpu_ref(inputs, outputs)
    }

    fn describe(&self) -> String {
        format!(
            "rms_norm(eps={:e}) then linear{}",
            self.eps,
            self.kernel.label()
        )
    }

    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        if self.infer(inputs).is_err() {
            return 0;
        }
        self.split_scratch(inputs).1
    }

    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        self.cuda_launch(ctx, inputs, outputs, scratch)
    }
}
