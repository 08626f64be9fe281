//! The parity registry (in the spirit of ggml's `test-backend-ops`): every op family lists,
//! in its own `cases.rs`, ops on a concrete CUDA variant with inputs built from a seed, a bound
//! on the GPU's normalized mean squared error against the CPU reference, and the bytes the op
//! must move. `ops/tests/gpu_ops.rs` runs them all against the reference (and times them);
//! a CPU-only test there checks on every CI run that each case's inputs pass `infer` and its
//! reference runs to finite outputs.

use half::{bf16, f16};

use super::{HostValue, Rng, run_cpu};
use crate::tensor::{DType, TensorMeta};
use crate::{Op, OpError};

/// Builds a case's inputs from its generator.
pub type Inputs = Box<dyn Fn(&mut Rng) -> Vec<HostValue> + Send + Sync>;

/// One registered parity case.
pub struct ParityCase {
    /// `family/what`, unique in the registry.
    pub name: String,
    /// The op, on a concrete kernel variant.
    pub op: Box<dyn Op>,
    /// The seed [`ParityCase::inputs`] starts the generator from.
    pub seed: u64,
    build: Inputs,
    /// The largest normalized MSE allowed, `Σ(gpu−cpu)² / Σcpu²` per float output (the worst
    /// output counts); I32 outputs must be equal, NaN fails.
    pub max_nmse: f64,
    /// The bytes the op must move when it is not all of its inputs and outputs (a cache read
    /// only up to the positions); `None`: every input and output once.
    pub bytes: Option<usize>,
    /// The only compute capability the variant runs on (the warpgroup expert GEMM: 9.0).
    pub needs_cc: Option<(u32, u32)>,
}

impl std::fmt::Debug for ParityCase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParityCase")
            .field("name", &self.name)
            .field("op", &self.op.describe())
            .field("seed", &self.seed)
            .field("max_nmse", &self.max_nmse)
            .finish_non_exhaustive()
    }
}

impl ParityCase {
    pub fn new(
        name: impl Into<String>,
        op: impl Op,
        seed: u64,
        max_nmse: f64,
        build: impl Fn(&mut Rng) -> Vec<HostValue> + Send + Sync + 'static,
    ) -> ParityCase {
        ParityCase {
            name: name.into(),
            op: Box::new(op),
            seed,
            build: Box::new(build),
            max_nmse,
            bytes: None,
            needs_cc: None,
        }
    }

    /// With the bytes the op must move set explicitly.
    pub fn moving(mut self, bytes: usize) -> ParityCase {
        self.bytes = Some(bytes);
        self
    }

    /// Runs only on a device of compute capability `cc`.
    pub fn only_on(mut self, cc: (u32, u32)) -> ParityCase {
        self.needs_cc = Some(cc);
        self
    }

    /// The inputs, drawn afresh from the case's seed (the same values every call).
    pub fn inputs(&self) -> Vec<HostValue> {
        (self.build)(&mut Rng::new(self.seed))
    }

    /// The bytes the op must move over `inputs`: [`ParityCase::bytes`] or every input and
    /// output once (an output that aliases an input counted once, as read and written).
    pub fn bytes_moved(&self, inputs: &[HostValue]) -> Result<usize, OpError> {
        if let Some(b) = self.bytes {
            return Ok(b);
        }
        let metas: Vec<&TensorMeta> = inputs.iter().map(|v| &v.meta).collect();
        let outs = self.op.infer(&metas)?;
        let aliased: Vec<usize> = self.op.aliases().iter().map(|&(o, _)| o).collect();
        let ins: usize = inputs.iter().map(|v| v.data.len()).sum();
        let outs: usize = outs
            .iter()
            .enumerate()
            .filter(|(k, _)| !aliased.contains(k))
            .map(|(_, m)| m.bytes().unwrap_or(0))
            .sum();
        Ok(ins + outs)
    }

    /// The registry's CPU-side check: the inputs pass `infer`, the reference runs and every
    /// float output is finite.
    pub fn check_cpu(&self) -> Result<(), String> {
        let inputs = self.inputs();
        let outs = run_cpu(self.op.as_ref(), &inputs).map_err(|e| e.to_string())?;
        for (k, (m, b)) in outs.iter().enumerate() {
            if m.dtype == DType::F32 {
                let bad = b
                    .bytes()
                    .chunks_exact(4)
                    .position(|c| !f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite());
                if let Some(i) = bad {
                    return Err(format!("output {k} ({m}) element {i} is not finite"));
                }
            }
        }
        self.bytes_moved(&inputs).map_err(|e| e.to_string())?;
        Ok(())
    }
}

/// The normalized mean squared error of one output, `Σ(gpu−cpu)² / Σcpu²` in f64: NaN where
/// either side has a NaN (an unwritten element or an invalid value), 0 for equal all-zero
/// outputs, infinite for a nonzero error against an all-zero reference. I32 outputs must be
/// equal (an error names the first difference).
pub fn nmse(meta: &TensorMeta, cpu: &[u8], gpu: &[u8]) -> Result<f64, String> {
    if cpu.len() != gpu.len() {
        return Err(format!(
            "{meta}: cpu has {} bytes, gpu {}",
            cpu.len(),
            gpu.len()
        ));
    }
    if meta.dtype == DType::F16 {
        // An F16 output (the latent cache): the same measure over the widened values.
        let (mut err, mut norm) = (0f64, 0f64);
        for (c, g) in cpu.chunks_exact(2).zip(gpu.chunks_exact(2)) {
            let c = f64::from(half::f16::from_le_bytes([c[0], c[1]]).to_f32());
            let g = f64::from(half::f16::from_le_bytes([g[0], g[1]]).to_f32());
            if c.is_nan() || g.is_nan() {
                return Ok(f64::NAN);
            }
            err += (g - c) * (g - c);
            norm += c * c;
        }
        return Ok(if err == 0.0 { 0.0 } else { err / norm });
    }
    let words = cpu.chunks_exact(4).zip(gpu.chunks_exact(4));
    match meta.dtype {
        DType::I32 => {
            for (i, (c, g)) in words.enumerate() {
                let c = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                let g = i32::from_le_bytes([g[0], g[1], g[2], g[3]]);
                if c != g {
                    return Err(format!("{meta} element {i}: cpu {c}, gpu {g}"));
                }
            }
            Ok(0.0)
        }
        DType::F32 => {
            let (mut err, mut norm) = (0f64, 0f64);
            for (c, g) in words {
                let c = f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
                let g = f64::from(f32::from_le_bytes([g[0], g[1], g[2], g[3]]));
                if c.is_nan() || g.is_nan() {
                    return Ok(f64::NAN);
                }
                err += (g - c) * (g - c);
                norm += c * c;
            }
            Ok(if err == 0.0 { 0.0 } else { err / norm })
        }
        other => Err(format!(
            "{meta}: parity of {other} outputs is not supported"
        )),
    }
}

// ---- input builders the families' cases share -------------------------------------------

/// The CPU reference's outputs, as inputs for the next op (a producer's results, so that a
/// consumer sees consistent data: a route table, a plan).
pub fn cpu_outputs(op: &dyn Op, inputs: &[HostValue]) -> Vec<HostValue> {
    run_cpu(op, inputs)
        .unwrap_or_else(|e| panic!("{}: cpu: {e}", op.describe()))
        .into_iter()
        .map(|(meta, data)| HostValue { meta, data })
        .collect()
}

/// Weight bytes for `rows × cols` of `dtype`: float types from U(−1, 1), block types from
/// random bytes with a finite random f16 scale (U(−0.02, 0.02)) in every block.
pub fn random_weight(r: &mut Rng, dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
    let n = rows * cols;
    match dtype {
        DType::F32 => (0..n)
            .flat_map(|_| r.uniform(-1.0, 1.0).to_le_bytes())
            .collect(),
        DType::F16 => (0..n)
            .flat_map(|_| f16::from_f32(r.uniform(-1.0, 1.0)).to_le_bytes())
            .collect(),
        DType::BF16 => (0..n)
            .flat_map(|_| bf16::from_f32(r.uniform(-1.0, 1.0)).to_le_bytes())
            .collect(),
        _ => {
            let ty = dtype.ggml().expect("a weight type");
            let mut bytes: Vec<u8> = (0..ty.row_bytes(n).expect("whole blocks"))
                .map(|_| r.next_u64() as u8)
                .collect();
            let at = if dtype == DType::Q6_K { 208 } else { 0 };
            for b in bytes.chunks_exact_mut(ty.block_bytes()) {
                let d = f16::from_f32(r.uniform(-0.02, 0.02));
                b[at..at + 2].copy_from_slice(&d.to_le_bytes());
            }
            bytes
        }
    }
}

/// A stored weight of `shape` (the last dimension the row) from [`random_weight`].
pub fn weight(r: &mut Rng, dtype: DType, shape: &[usize]) -> HostValue {
    let cols = *shape.last().expect("a shaped weight");
    let rows = shape.iter().product::<usize>() / cols.max(1);
    HostValue::from_bytes(
        TensorMeta::new(shape.to_vec(), dtype),
        &random_weight(r, dtype, rows, cols),
    )
}

/// F32 `shape` of U(lo, hi).
pub fn uniform(r: &mut Rng, shape: &[usize], lo: f32, hi: f32) -> HostValue {
    let n = shape.iter().product();
    HostValue::f32(shape.to_vec(), &r.vec(n, lo, hi))
}

// ---- bounds ------------------------------------------------------------------------------
//
// An elementwise tolerance `|gpu − cpu| ≤ abs + rel·|cpu|` (what the families' GPU tests hold
// each path to, and pass on the H200) bounds the squared error of every element by
// `2·abs² + 2·rel²·cpu²`, so over an output of rms `s` the normalized MSE is at most
// `2·(rel² + (abs/s)²)`: [`nmse_bound`]. The cases state `abs/s` from the test's absolute part
// and the output's expected rms at the case's value distributions.

/// The normalized-MSE bound an elementwise tolerance `rel`, `abs` implies over an output whose
/// rms is `abs / abs_over_rms`.
pub fn nmse_bound(rel: f64, abs_over_rms: f64) -> f64 {
    2.0 * (rel * rel + abs_over_rms * abs_over_rms)
}

/// Kernels the GPU tests hold to zero tolerance (they repeat the reference's roundings): any
/// difference at all fails, up to a float's last bit over a whole output.
pub const NMSE_EXACT: f64 = 1e-12;

/// [`crate::parity::Tolerance::F32`] (rel 1e-5; its abs 1e-6 is far below outputs of O(1)):
/// kernels that round as the reference does, in another order.
pub const NMSE_F32: f64 = 2.0 * 1e-5 * 1e-5;

/// f32 dot products of `n` terms summed in another order than the CPU's: the tests' `dot_tol`,
/// rel 1e-5 and abs `16·n·ε·rms(w)·rms(x)`, against outputs of rms `√n·rms(w)·rms(x)`.
pub fn nmse_f32_dot(n: usize) -> f64 {
    nmse_bound(1e-5, 16.0 * (n as f64).sqrt() * f64::from(f32::EPSILON))
}

/// Products with x narrowed to bf16 on the tensor cores ([`crate::parity::Tolerance::BF16`],
/// rel 4e-2).
pub const NMSE_BF16: f64 = 2.0 * 4e-2 * 4e-2;
