//! The parity harness: runs an op's CPU reference and its CUDA kernel on the same
//! inputs and compares. Outputs are poisoned before each run (NaN / i32::MIN on the
//! host, all-ones bytes on the device) so an element a kernel forgets to write fails,
//! and NaN never passes.

use std::fmt;

use cuda::DeviceBuffer;

use crate::gpu::{DeviceTensor, GpuCtx, Scratch, dev_err};
use crate::tensor::{AlignedBuf, DType, HostTensor, HostTensorMut, TensorMeta};
use crate::{Op, OpError};

mod case;
mod rng;

pub use case::{
    Inputs, NMSE_BF16, NMSE_EXACT, NMSE_F32, ParityCase, cpu_outputs, nmse, nmse_bound,
    nmse_f32_dot, random_weight, uniform, weight,
};
pub use rng::Rng;

/// Every registered parity case, family by family (each family's `cases.rs`).
pub fn registry() -> Vec<ParityCase> {
    let mut all = Vec::new();
    all.extend(crate::linear::cases::cases());
    all.extend(crate::norm::cases::cases());
    all.extend(crate::embedding::cases::cases());
    all.extend(crate::hc::cases::cases());
    all.extend(crate::mla::cases::cases());
    all.extend(crate::moe::cases::cases());
    all.extend(crate::head::cases::cases());
    all
}

/// The H200's copy ceiling as this project measured it on the card its kernels are tuned on
/// (4.27 TB/s, bytes read + written per second): what a memory-bound op's GB/s is read against
/// where [`copy_ceiling_gbs`] cannot measure the card at hand.
pub const H200_COPY_CEILING_GBS: f64 = 4270.0;

/// The card's copy ceiling in GB/s: a device-to-device copy of a 1 GiB buffer (read and
/// written, so 2 GiB moved a copy), median of 5 timed copies after 3 warm-up copies.
pub fn copy_ceiling_gbs(ctx: &GpuCtx) -> Result<f64, OpError> {
    let dev = &ctx.device;
    let n = 1usize << 30;
    let src = dev.alloc_zeros::<u8>(n).map_err(dev_err)?;
    let mut dst = dev.alloc_zeros::<u8>(n).map_err(dev_err)?;
    for _ in 0..3 {
        dst.copy_from_device(&src).map_err(dev_err)?;
    }
    dev.synchronize().map_err(dev_err)?;
    let timer = cuda::Timer::new(dev).map_err(dev_err)?;
    let mut ms = Vec::with_capacity(5);
    for _ in 0..5 {
        timer.start().map_err(dev_err)?;
        dst.copy_from_device(&src).map_err(dev_err)?;
        ms.push(f64::from(timer.stop().map_err(dev_err)?));
    }
    ms.sort_by(f64::total_cmp);
    Ok(2.0 * n as f64 / (ms[2] * 1e-3) / 1e9)
}

/// One case on the GPU against the CPU reference: the worst output's normalized MSE (see
/// [`nmse`]), or why it could not be compared.
pub fn run_case(ctx: &GpuCtx, case: &ParityCase) -> Result<f64, String> {
    let op = case.op.as_ref();
    let inputs = case.inputs();
    let cpu = run_cpu(op, &inputs).map_err(|e| format!("cpu: {e}"))?;
    let gpu = run_gpu(ctx, op, &inputs).map_err(|e| format!("cuda: {e}"))?;
    let mut worst = 0f64;
    for (k, ((m, c), (_, g))) in cpu.iter().zip(&gpu).enumerate() {
        let e = nmse(m, c.bytes(), g).map_err(|e| format!("output {k}: {e}"))?;
        if e.is_nan() || e > worst {
            worst = e;
        }
        if worst.is_nan() {
            break;
        }
    }
    Ok(worst)
}

/// Microseconds per call of `op` on `inputs` (staged on the device once, outputs and scratch
/// allocated as [`run_gpu`] does), through [`time_calls_us`] with `reps` calls a graph.
pub fn time_op_us(
    ctx: &GpuCtx,
    op: &dyn Op,
    inputs: &[HostValue],
    reps: usize,
) -> Result<f64, OpError> {
    let staged = Staged::new(ctx, op, inputs)?;
    time_calls_us(ctx, reps, &|_| staged.launch(ctx, op, inputs))
}

/// Allowed difference: `|gpu − cpu| ≤ abs + rel·|cpu|` per element.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    pub rel: f32,
    pub abs: f32,
}

impl Tolerance {
    /// The kernel computes in f32 like the reference.
    pub const F32: Tolerance = Tolerance {
        rel: 1e-5,
        abs: 1e-6,
    };
    /// The kernel narrows an operand to f16.
    pub const F16: Tolerance = Tolerance {
        rel: 4e-3,
        abs: 1e-4,
    };
    /// The kernel narrows an operand to bf16.
    pub const BF16: Tolerance = Tolerance {
        rel: 4e-2,
        abs: 1e-3,
    };

    pub fn new(rel: f32, abs: f32) -> Self {
        Tolerance { rel, abs }
    }
}

/// One input of a parity case: metadata and host bytes.
#[derive(Clone, Debug)]
pub struct HostValue {
    pub meta: TensorMeta,
    pub data: AlignedBuf,
}

impl HostValue {
    pub fn from_bytes(meta: TensorMeta, bytes: &[u8]) -> Self {
        let mut data = AlignedBuf::zeroed(bytes.len());
        data.bytes_mut().copy_from_slice(bytes);
        HostValue { meta, data }
    }

    pub fn f32(shape: impl Into<Vec<usize>>, v: &[f32]) -> Self {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        Self::from_bytes(TensorMeta::f32(shape), &bytes)
    }

    pub fn i32(shape: impl Into<Vec<usize>>, v: &[i32]) -> Self {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        Self::from_bytes(TensorMeta::i32(shape), &bytes)
    }

    pub fn view(&self) -> HostTensor<'_> {
        HostTensor::new(&self.meta, self.data.bytes())
    }
}

/// The worst element seen in a comparison.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ParityReport {
    pub elements: usize,
    pub max_abs: f32,
    /// Largest `|gpu − cpu| / max(|cpu|, abs)`.
    pub max_rel: f32,
}

impl fmt::Display for ParityReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} elements, max |Δ| {:.3e}, max rel {:.3e}",
            self.elements, self.max_abs, self.max_rel
        )
    }
}

fn poison_host(meta: &TensorMeta) -> Result<AlignedBuf, OpError> {
    let bytes = meta
        .bytes()
        .ok_or_else(|| OpError::Type(format!("{meta} is not whole blocks")))?;
    let mut b = AlignedBuf::zeroed(bytes);
    let fill: u32 = if meta.dtype == DType::I32 {
        i32::MIN as u32
    } else {
        f32::NAN.to_bits()
    };
    for c in b.bytes_mut().chunks_mut(4) {
        let f = fill.to_le_bytes();
        c.copy_from_slice(&f[..c.len()]);
    }
    Ok(b)
}

/// Output buffers for `op`: poisoned, except outputs that alias an input, which
/// start as that input (the op updates them in place).
fn initial_outputs(
    op: &dyn Op,
    inputs: &[HostValue],
    metas: &[TensorMeta],
) -> Result<Vec<AlignedBuf>, OpError> {
    metas
        .iter()
        .enumerate()
        .map(|(k, m)| match op.aliases().iter().find(|(o, _)| *o == k) {
            Some(&(_, i)) => Ok(inputs[i].data.clone()),
            None => poison_host(m),
        })
        .collect()
}

/// Runs the CPU reference; returns the outputs.
pub fn run_cpu(
    op: &dyn Op,
    inputs: &[HostValue],
) -> Result<Vec<(TensorMeta, AlignedBuf)>, OpError> {
    let in_metas: Vec<&TensorMeta> = inputs.iter().map(|v| &v.meta).collect();
    let metas = op.infer(&in_metas)?;
    let mut outs = initial_outputs(op, inputs, &metas)?;
    let aliased: Vec<usize> = op.aliases().iter().map(|&(_, i)| i).collect();
    let ins: Vec<HostTensor<'_>> = inputs
        .iter()
        .enumerate()
        .map(|(k, v)| {
            if aliased.contains(&k) {
                HostTensor::new(&v.meta, &[])
            } else {
                v.view()
            }
        })
        .collect();
    {
        let mut views: Vec<HostTensorMut<'_>> = metas
            .iter()
            .zip(outs.iter_mut())
            .map(|(m, b)| HostTensorMut::new(m, b.bytes_mut()))
            .collect();
        op.cpu(&ins, &mut views)?;
    }
    Ok(metas.into_iter().zip(outs).collect())
}

/// An op's inputs, outputs (poisoned with all-ones bytes, or the aliased input) and scratch
/// on the device.
struct Staged {
    metas: Vec<TensorMeta>,
    in_bufs: Vec<DeviceBuffer<u8>>,
    out_bufs: Vec<DeviceBuffer<u8>>,
    scratch: DeviceBuffer<u8>,
    scratch_bytes: usize,
}

impl Staged {
    fn new(ctx: &GpuCtx, op: &dyn Op, inputs: &[HostValue]) -> Result<Staged, OpError> {
        let dev = &ctx.device;
        let in_metas: Vec<&TensorMeta> = inputs.iter().map(|v| &v.meta).collect();
        let metas = op.infer(&in_metas)?;
        let mut in_bufs = Vec::with_capacity(inputs.len());
        for v in inputs {
            // At least one byte so every input has an address.
            let mut bytes = v.data.bytes().to_vec();
            if bytes.is_empty() {
                bytes.push(0);
            }
            in_bufs.push(dev.upload(&bytes).map_err(dev_err)?);
        }
        let mut out_bufs = Vec::with_capacity(metas.len());
        for (k, m) in metas.iter().enumerate() {
            let n = m
                .bytes()
                .ok_or_else(|| OpError::Type(format!("{m} is not whole blocks")))?;
            let init: Vec<u8> = match op.aliases().iter().find(|(o, _)| *o == k) {
                Some(&(_, i)) => inputs[i].data.bytes().to_vec(),
                None => vec![0xFF; n.max(1)],
            };
            out_bufs.push(dev.upload(&init).map_err(dev_err)?);
        }
        let scratch_bytes = op.cuda_scratch_bytes(&in_metas);
        let scratch = dev
            .upload(&vec![0xFFu8; scratch_bytes.max(1)])
            .map_err(dev_err)?;
        Ok(Staged {
            metas,
            in_bufs,
            out_bufs,
            scratch,
            scratch_bytes,
        })
    }

    /// Enqueues the op once (no sync).
    fn launch(&self, ctx: &GpuCtx, op: &dyn Op, inputs: &[HostValue]) -> Result<(), OpError> {
        // An aliased input is handed the output's storage, as the executor does.
        let in_views: Vec<DeviceTensor<'_>> = inputs
            .iter()
            .enumerate()
            .map(|(k, v)| match op.aliases().iter().find(|(_, i)| *i == k) {
                Some(&(o, _)) => DeviceTensor {
                    meta: &v.meta,
                    ptr: self.out_bufs[o].device_ptr(),
                    bytes: self.out_bufs[o].num_bytes(),
                },
                None => DeviceTensor {
                    meta: &v.meta,
                    ptr: self.in_bufs[k].device_ptr(),
                    bytes: v.data.len(),
                },
            })
            .collect();
        let out_views: Vec<DeviceTensor<'_>> = self
            .metas
            .iter()
            .zip(&self.out_bufs)
            .map(|(m, b)| DeviceTensor {
                meta: m,
                ptr: b.device_ptr(),
                bytes: m.bytes().unwrap_or(0),
            })
            .collect();
        op.cuda(
            ctx,
            &in_views,
            &out_views,
            Scratch {
                ptr: self.scratch.device_ptr(),
                bytes: self.scratch_bytes,
            },
        )
    }

    fn download(self) -> Result<Vec<(TensorMeta, Vec<u8>)>, OpError> {
        let mut outs = Vec::with_capacity(self.metas.len());
        for (m, b) in self.metas.into_iter().zip(&self.out_bufs) {
            let n = m.bytes().unwrap_or(0);
            let mut v = b.to_vec().map_err(dev_err)?;
            v.truncate(n);
            outs.push((m, v));
        }
        Ok(outs)
    }
}

/// Runs the CUDA kernel (uploading the inputs, poisoning the outputs with all-ones
/// bytes, allocating the scratch it asks for) and downloads the outputs.
pub fn run_gpu(
    ctx: &GpuCtx,
    op: &dyn Op,
    inputs: &[HostValue],
) -> Result<Vec<(TensorMeta, Vec<u8>)>, OpError> {
    let staged = Staged::new(ctx, op, inputs)?;
    staged.launch(ctx, op, inputs)?;
    ctx.device.synchronize().map_err(dev_err)?;
    staged.download()
}

/// Compares one output. I32 must be equal; floats within `tol`; a NaN on the GPU
/// side fails unless the reference has a NaN at the same place.
pub fn compare(
    meta: &TensorMeta,
    cpu: &[u8],
    gpu: &[u8],
    tol: Tolerance,
) -> Result<ParityReport, String> {
    if cpu.len() != gpu.len() {
        return Err(format!(
            "{meta}: cpu has {} bytes, gpu {}",
            cpu.len(),
            gpu.len()
        ));
    }
    let mut rep = ParityReport {
        elements: cpu.len() / 4,
        ..Default::default()
    };
    for (i, (c, g)) in cpu.chunks_exact(4).zip(gpu.chunks_exact(4)).enumerate() {
        let c4 = [c[0], c[1], c[2], c[3]];
        let g4 = [g[0], g[1], g[2], g[3]];
        match meta.dtype {
            DType::I32 => {
                let (c, g) = (i32::from_le_bytes(c4), i32::from_le_bytes(g4));
                if c != g {
                    return Err(format!("{meta} element {i}: cpu {c}, gpu {g}"));
                }
            }
            DType::F32 => {
                let (c, g) = (f32::from_le_bytes(c4), f32::from_le_bytes(g4));
                if c.is_nan() && g.is_nan() {
                    continue;
                }
                if g.is_nan() || c.is_nan() {
                    return Err(format!(
                        "{meta} element {i}: cpu {c}, gpu {g} (NaN: unwritten or invalid)"
                    ));
                }
                let d = (g - c).abs();
                if d > tol.abs + tol.rel * c.abs() {
                    return Err(format!(
                        "{meta} element {i}: cpu {c}, gpu {g}, |Δ| {d:.3e} over {tol:?}"
                    ));
                }
                rep.max_abs = rep.max_abs.max(d);
                rep.max_rel = rep.max_rel.max(d / c.abs().max(tol.abs));
            }
            other => {
                return Err(format!(
                    "{meta}: parity of {other} outputs is not supported"
                ));
            }
        }
    }
    Ok(rep)
}

/// CPU vs GPU on one case, every output compared.
pub fn check(
    ctx: &GpuCtx,
    op: &dyn Op,
    inputs: &[HostValue],
    tol: Tolerance,
) -> Result<ParityReport, String> {
    let cpu = run_cpu(op, inputs).map_err(|e| format!("{}: cpu: {e}", op.describe()))?;
    let gpu = run_gpu(ctx, op, inputs).map_err(|e| format!("{}: cuda: {e}", op.describe()))?;
    let mut total = ParityReport::default();
    for ((m, c), (_, g)) in cpu.iter().zip(&gpu) {
        let r = compare(m, c.bytes(), g, tol).map_err(|e| format!("{}: {e}", op.describe()))?;
        total.elements += r.elements;
        total.max_abs = total.max_abs.max(r.max_abs);
        total.max_rel = total.max_rel.max(r.max_rel);
    }
    Ok(total)
}

/// The GPU for a parity test, or `None` with the reason printed (no driver, no device).
pub fn test_gpu() -> Option<GpuCtx> {
    match GpuCtx::open(0) {
        Ok(ctx) => Some(ctx),
        Err(e) => {
            eprintln!("skipped: no CUDA driver/GPU ({e})");
            None
        }
    }
}

/// Microseconds per call of `call(i)`: `reps` calls captured into one CUDA graph (as the engine
/// runs a step), replayed for at least 0.3 s first so the clocks have ramped up, then the median
/// of 7 timed replays, divided by `reps`. For the timing tables of the GPU tests.
pub fn time_calls_us(
    gpu: &GpuCtx,
    reps: usize,
    call: &dyn Fn(usize) -> Result<(), OpError>,
) -> Result<f64, OpError> {
    let dev = &gpu.device;
    call(0)?;
    let mut failed = None;
    let graph = dev
        .capture(|_| {
            for i in 0..reps {
                if let Err(e) = call(i) {
                    failed = Some(e);
                    break;
                }
            }
            Ok(())
        })
        .map_err(dev_err)?;
    if let Some(e) = failed {
        return Err(e);
    }
    graph.upload().map_err(dev_err)?;
    let start = std::time::Instant::now();
    while start.elapsed().as_secs_f64() < 0.3 {
        graph.launch().map_err(dev_err)?;
        dev.synchronize().map_err(dev_err)?;
    }
    let timer = cuda::Timer::new(dev).map_err(dev_err)?;
    let mut ms = Vec::with_capacity(7);
    for _ in 0..7 {
        timer.start().map_err(dev_err)?;
        graph.launch().map_err(dev_err)?;
        ms.push(f64::from(timer.stop().map_err(dev_err)?));
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[3] * 1e3 / reps.max(1) as f64)
}
