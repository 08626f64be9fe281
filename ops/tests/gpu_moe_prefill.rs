//! CUDA parity of the tensor-core grouped expert GEMM (`launch_expert_gemm_tc_with`, both
//! kernels: `mma.sync` and, on Hopper, warpgroup MMAs) against the CPU references of
//! `ExpertSwiGlu` and `ExpertDown`, on uneven route plans (experts with no routes, one expert
//! with most of them, route counts on both sides of the 16-, 64- and 128-route tile sizes) and
//! at the real Xing4.0 shapes, plus their bit-reproducibility; skips without a GPU, saying
//! why. The timing table is ignored (run on the GPU host with `--include-ignored`).
//!
//! Tolerances. The kernel multiplies f16-rounded weights and inputs (unit roundoff u = 2⁻¹¹
//! each) and accumulates in f32. A product then carries a relative error of at most 2u, about
//! 0.82·u in standard deviation, so a dot of n independent terms is off by about
//! 0.82·u·√n·rms(w)·rms(x); [`f16_dot_abs`] allows 6·u·√n·rms(w)·rms(x) (over 7σ). The f32
//! summation order adds only √n·2⁻²⁴ relative. SwiGLU's `silu(g)·u` moves by at most about
//! 1.1·|u|·Δg + |g|·Δu, so its allowance is that times 4·T, T = √n·rms(w)·rms(x) the typical
//! dot. The relative part is `Tolerance::F16`'s.

use std::sync::OnceLock;

use cuda::DeviceBuffer;
use half::f16;
use loader::GgmlType;
use ops::gpu::{DeviceTensor, GpuCtx, Scratch};
use ops::moe::{ExpertDown, ExpertKernel, ExpertSwiGlu, RoutePlan};
use ops::moe_prefill::{K_TILE, TcKernel, launch_expert_gemm_tc, launch_expert_gemm_tc_with};
use ops::parity::{HostValue, Rng, Tolerance, check, compare, run_cpu, run_gpu, test_gpu};
use ops::{DType, HostTensor, HostTensorMut, Op, OpError, TensorMeta};
use proptest::prelude::*;

const U: f32 = 1.0 / 2048.0;

fn rms(v: &[f32]) -> f32 {
    (v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / v.len().max(1) as f64).sqrt() as f32
}

fn f16_dot_abs(n: usize, wrms: f32, xrms: f32) -> f32 {
    6.0 * U * (n as f32).sqrt() * wrms * xrms
}

fn down_tol(n: usize, wrms: f32, xrms: f32) -> Tolerance {
    Tolerance::new(Tolerance::F16.rel, f16_dot_abs(n, wrms, xrms))
}

fn swiglu_tol(n: usize, wrms: f32, xrms: f32) -> Tolerance {
    let typical = (n as f32).sqrt() * wrms * xrms;
    Tolerance::new(
        Tolerance::F16.rel,
        2.1 * 4.0 * typical * f16_dot_abs(n, wrms, xrms),
    )
}

/// A stacked `[e, rows, cols]` IQ4_NL weight quantized from U(−0.1, 0.1) by the loader's
/// quantizer, and the rms of its dequantized values.
fn quantized_stack(r: &mut Rng, e: usize, rows: usize, cols: usize) -> (HostValue, f32) {
    let src = r.vec(e * rows * cols, -0.1, 0.1);
    let mut bytes = Vec::new();
    loader::quant::quantize(GgmlType::IQ4_NL, &src, &mut bytes).expect("whole blocks");
    let mut deq = vec![0f32; src.len()];
    loader::quant::dequantize(GgmlType::IQ4_NL, &bytes, &mut deq).expect("whole blocks");
    let meta = TensorMeta::new([e, rows, cols], DType::IQ4_NL);
    (HostValue::from_bytes(meta, &bytes), rms(&deq))
}

/// Largest IQ4_NL scale of the real-shape stacks (uniform in ±IQ4_D).
const IQ4_D: f32 = 0.004;
/// rms of those weights: rms(d)·rms(codebook) = (IQ4_D/√3)·67.44.
const IQ4_WRMS: f32 = IQ4_D / 1.732_050_8 * 67.44;

/// A stacked IQ4_NL weight of random codes and scales: the real shapes hold 0.7 G values,
/// too many for the quantizer's search in a test, and any nibble is a valid code.
fn random_stack(r: &mut Rng, e: usize, rows: usize, cols: usize) -> HostValue {
    let meta = TensorMeta::new([e, rows, cols], DType::IQ4_NL);
    let mut bytes = vec![0u8; meta.bytes().expect("whole blocks")];
    for c in bytes.chunks_mut(8) {
        let v = r.next_u64().to_le_bytes();
        c.copy_from_slice(&v[..c.len()]);
    }
    for b in bytes.chunks_exact_mut(18) {
        b[..2].copy_from_slice(&f16::from_f32(r.uniform(-IQ4_D, IQ4_D)).to_le_bytes());
    }
    HostValue::from_bytes(meta, &bytes)
}

/// Router-like ids for `n` tokens (distinct within a token). Skewed: one hot expert is in
/// about 80% of the tokens and every third other expert gets no route, so the plan has empty
/// experts next to one with several 64-route tiles.
fn route_ids(r: &mut Rng, n: usize, ne: usize, k: usize, skew: bool) -> Vec<i32> {
    let hot = r.below(ne) as i32;
    let mut pool: Vec<i32> = (0..ne as i32)
        .filter(|&e| !skew || e == hot || e % 3 != 1)
        .collect();
    if pool.len() < k {
        pool = (0..ne as i32).collect();
    }
    let mut ids = Vec::with_capacity(n * k);
    for _ in 0..n {
        let mut t: Vec<i32> = Vec::with_capacity(k);
        if skew && r.below(5) < 4 {
            t.push(hot);
        }
        while t.len() < k {
            let e = pool[r.below(pool.len())];
            if !t.contains(&e) {
                t.push(e);
            }
        }
        ids.extend(t);
    }
    ids
}

/// The CPU plan of `ids`: offsets `[ne+1]`, route_token `[R]`, route_slot `[R]`.
fn plan(ids: &[i32], n: usize, ne: usize, k: usize) -> Vec<HostValue> {
    let op = RoutePlan {
        n_expert: ne,
        top_k: k,
    };
    run_cpu(&op, &[HostValue::i32([n, k], ids)])
        .expect("route plan")
        .into_iter()
        .map(|(meta, data)| HostValue { meta, data })
        .collect()
}

fn counts(offsets: &HostValue) -> Vec<i32> {
    let o: Vec<i32> = offsets
        .data
        .bytes()
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    o.windows(2).map(|p| p[1] - p[0]).collect()
}

fn iq4(op: &'static str, t: &DeviceTensor<'_>) -> Result<(), OpError> {
    if t.meta.dtype != DType::IQ4_NL {
        return Err(OpError::shape(
            op,
            format!("needs IQ4_NL, found {}", t.meta),
        ));
    }
    Ok(())
}

/// The kernels `gpu` runs: both on Hopper, `mma.sync` elsewhere.
fn kernels(gpu: &GpuCtx) -> Vec<TcKernel> {
    match TcKernel::for_device(gpu) {
        TcKernel::Wgmma => vec![TcKernel::MmaSync, TcKernel::Wgmma],
        TcKernel::MmaSync => vec![TcKernel::MmaSync],
    }
}

/// The kernel field of the ops the wrappers below hold: the wrappers launch the grouped GEMM
/// themselves, so the ops give only their shapes and CPU reference (which takes no variant).
const REFERENCE: ExpertKernel = ExpertKernel::Unlowered;

/// `ExpertSwiGlu` with its CUDA side on one tensor-core kernel (`None`: the one
/// `launch_expert_gemm_tc` picks).
#[derive(Debug)]
struct TcSwiGlu(ExpertSwiGlu, Option<TcKernel>);

impl Op for TcSwiGlu {
    fn name(&self) -> &'static str {
        "expert_swiglu_tc"
    }
    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        self.0.infer(inputs)
    }
    fn cpu(&self, i: &[HostTensor<'_>], o: &mut [HostTensorMut<'_>]) -> Result<(), OpError> {
        self.0.cpu(i, o)
    }
    fn describe(&self) -> String {
        match self.1 {
            Some(k) => format!("{k:?} {}", self.0.describe()),
            None => format!("default {}", self.0.describe()),
        }
    }
    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        iq4(self.name(), &inputs[1])?;
        iq4(self.name(), &inputs[2])?;
        let (n, d) = (inputs[0].meta.shape[0], inputs[0].meta.shape[1]);
        let (wa, wb, x, off, tok, y) = (
            inputs[1].ptr,
            Some(inputs[2].ptr),
            inputs[0].ptr,
            inputs[3].ptr,
            inputs[4].ptr,
            outputs[0].ptr,
        );
        let (nf, ne, rt) = (self.0.n_ff, self.0.n_expert, inputs[4].meta.shape[0]);
        // SAFETY: the harness's buffers hold the shapes infer checked.
        unsafe {
            match self.1 {
                Some(k) => {
                    launch_expert_gemm_tc_with(ctx, k, wa, wb, x, off, tok, y, d, nf, ne, n, rt)
                }
                None => launch_expert_gemm_tc(ctx, wa, wb, x, off, tok, y, d, nf, ne, n, rt),
            }
        }
    }
}

/// `ExpertDown` with its CUDA side on one tensor-core kernel (`None` as for `TcSwiGlu`).
#[derive(Debug)]
struct TcDown(ExpertDown, Option<TcKernel>);

impl Op for TcDown {
    fn name(&self) -> &'static str {
        "expert_down_tc"
    }
    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        self.0.infer(inputs)
    }
    fn cpu(&self, i: &[HostTensor<'_>], o: &mut [HostTensorMut<'_>]) -> Result<(), OpError> {
        self.0.cpu(i, o)
    }
    fn describe(&self) -> String {
        match self.1 {
            Some(k) => format!("{k:?} {}", self.0.describe()),
            None => format!("default {}", self.0.describe()),
        }
    }
    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        iq4(self.name(), &inputs[1])?;
        let (r, nf) = (inputs[0].meta.shape[0], inputs[0].meta.shape[1]);
        let (w, x, off, y) = (inputs[1].ptr, inputs[0].ptr, inputs[2].ptr, outputs[0].ptr);
        let (ne, embd) = (self.0.n_expert, self.0.n_embd);
        // SAFETY: as for TcSwiGlu.
        unsafe {
            match self.1 {
                Some(k) => {
                    launch_expert_gemm_tc_with(ctx, k, w, None, x, off, 0, y, nf, embd, ne, r, r)
                }
                None => launch_expert_gemm_tc(ctx, w, None, x, off, 0, y, nf, embd, ne, r, r),
            }
        }
    }
}

// ---- parity on small uneven plans ------------------------------------------------------

#[test]
fn swiglu_on_tensor_cores_matches_the_cpu_reference_on_uneven_plans() {
    let Some(gpu) = test_gpu() else { return };
    let kernels = kernels(&gpu);
    proptest!(ProptestConfig::with_cases(16), |(
        n in 1usize..200, ne in 1usize..12, k in 1usize..5, d128 in 1usize..6,
        nf in 1usize..300, skew in any::<bool>(), seed in any::<u64>(),
    )| {
        let (k, d) = (k.min(ne), K_TILE * d128);
        let mut r = Rng::new(seed);
        let p = plan(&route_ids(&mut r, n, ne, k, skew), n, ne, k);
        let (gate, wg) = quantized_stack(&mut r, ne, nf, d);
        let (up, wu) = quantized_stack(&mut r, ne, nf, d);
        let x = r.vec(n * d, -1.0, 1.0);
        let xrms = rms(&x);
        let ins = vec![HostValue::f32([n, d], &x), gate, up, p[0].clone(), p[1].clone()];
        for &kernel in &kernels {
            let sw = ExpertSwiGlu { n_expert: ne, n_ff: nf, kernel: REFERENCE };
            let op = TcSwiGlu(sw, Some(kernel));
            check(&gpu, &op, &ins, swiglu_tol(d, wg.max(wu), xrms)).map_err(TestCaseError::fail)?;
        }
    });
}

#[test]
fn down_on_tensor_cores_matches_the_cpu_reference_on_uneven_plans() {
    let Some(gpu) = test_gpu() else { return };
    let kernels = kernels(&gpu);
    proptest!(ProptestConfig::with_cases(16), |(
        n in 1usize..200, ne in 1usize..12, k in 1usize..5, f128 in 1usize..9,
        embd in 1usize..600, skew in any::<bool>(), seed in any::<u64>(),
    )| {
        let (k, nf) = (k.min(ne), K_TILE * f128);
        let mut r = Rng::new(seed);
        let p = plan(&route_ids(&mut r, n, ne, k, skew), n, ne, k);
        let (down, w) = quantized_stack(&mut r, ne, embd, nf);
        let act = r.vec(n * k * nf, -1.0, 1.0);
        let xrms = rms(&act);
        let ins = vec![HostValue::f32([n * k, nf], &act), down, p[0].clone()];
        for &kernel in &kernels {
            let dn = ExpertDown { n_expert: ne, n_embd: embd, kernel: REFERENCE };
            let op = TcDown(dn, Some(kernel));
            check(&gpu, &op, &ins, down_tol(nf, w, xrms)).map_err(TestCaseError::fail)?;
        }
    });
}

/// Token ids (top-1) giving expert `e` exactly `counts[e]` routes, tokens shuffled so each
/// expert's routes gather scattered rows.
fn ids_with_counts(r: &mut Rng, counts: &[usize]) -> Vec<i32> {
    let mut ids: Vec<i32> = counts
        .iter()
        .enumerate()
        .flat_map(|(e, &c)| std::iter::repeat_n(e as i32, c))
        .collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, r.below(i + 1));
    }
    ids
}

/// Experts of 0 routes and of route counts on both sides of the 16-route MMA steps and the
/// 64- and 128-route tiles (so tiles of 1..=128 routes, several tiles of one expert, and
/// narrow warpgroup instructions), with output widths that leave partial column tiles.
#[test]
fn route_counts_around_the_tile_sizes_match_the_cpu_reference() {
    let Some(gpu) = test_gpu() else { return };
    let want = [
        0, 1, 15, 16, 17, 0, 63, 64, 65, 127, 128, 129, 0, 257, 31, 112,
    ];
    let ne = want.len();
    let mut r = Rng::new(129);
    let ids = ids_with_counts(&mut r, &want);
    let n = ids.len();
    let p = plan(&ids, n, ne, 1);
    assert_eq!(
        counts(&p[0]),
        want.iter().map(|&c| c as i32).collect::<Vec<_>>()
    );
    let (d, nf, embd) = (256, 136, 300);
    let (gate, wg) = quantized_stack(&mut r, ne, nf, d);
    let (up, wu) = quantized_stack(&mut r, ne, nf, d);
    let (down, wd) = quantized_stack(&mut r, ne, embd, nf.next_multiple_of(K_TILE));
    let x = r.vec(n * d, -1.0, 1.0);
    let nfk = nf.next_multiple_of(K_TILE);
    let act = r.vec(n * nfk, -1.0, 1.0);
    let s_ins = vec![
        HostValue::f32([n, d], &x),
        gate,
        up,
        p[0].clone(),
        p[1].clone(),
    ];
    let d_ins = vec![HostValue::f32([n, nfk], &act), down, p[0].clone()];
    for kernel in kernels(&gpu) {
        let sw = TcSwiGlu(
            ExpertSwiGlu {
                n_expert: ne,
                n_ff: nf,
                kernel: REFERENCE,
            },
            Some(kernel),
        );
        let rep = check(&gpu, &sw, &s_ins, swiglu_tol(d, wg.max(wu), rms(&x))).expect("swiglu");
        eprintln!("parity {kernel:?} swiglu, routes per expert {want:?}: {rep}");
        let dn = TcDown(
            ExpertDown {
                n_expert: ne,
                n_embd: embd,
                kernel: REFERENCE,
            },
            Some(kernel),
        );
        let rep = check(&gpu, &dn, &d_ins, down_tol(nfk, wd, rms(&act))).expect("down");
        eprintln!("parity {kernel:?} down: {rep}");
    }
    // The default launcher runs the device's kernel: the same bits.
    let chosen = Some(TcKernel::for_device(&gpu));
    let sw = |k| {
        TcSwiGlu(
            ExpertSwiGlu {
                n_expert: ne,
                n_ff: nf,
                kernel: REFERENCE,
            },
            k,
        )
    };
    let a = run_gpu(&gpu, &sw(None), &s_ins).expect("default swiglu");
    let b = run_gpu(&gpu, &sw(chosen), &s_ins).expect("chosen swiglu");
    assert!(
        a[0].1 == b[0].1,
        "the default launcher's swiglu differs from {chosen:?}"
    );
    let dn = |k| {
        TcDown(
            ExpertDown {
                n_expert: ne,
                n_embd: embd,
                kernel: REFERENCE,
            },
            k,
        )
    };
    let a = run_gpu(&gpu, &dn(None), &d_ins).expect("default down");
    let b = run_gpu(&gpu, &dn(chosen), &d_ins).expect("chosen down");
    assert!(
        a[0].1 == b[0].1,
        "the default launcher's down differs from {chosen:?}"
    );
    // The ops themselves on `ExpertKernel::Grouped(kernel)` launch that kernel: the same bits.
    for kernel in kernels(&gpu) {
        let op = ExpertSwiGlu {
            n_expert: ne,
            n_ff: nf,
            kernel: ExpertKernel::Grouped(kernel),
        };
        let a = run_gpu(&gpu, &op, &s_ins).expect("expert_swiglu");
        let b = run_gpu(&gpu, &sw(Some(kernel)), &s_ins).expect("launcher swiglu");
        assert!(
            a[0].1 == b[0].1,
            "{}: not the launcher's bits",
            op.describe()
        );
        let op = ExpertDown {
            n_expert: ne,
            n_embd: embd,
            kernel: ExpertKernel::Grouped(kernel),
        };
        let a = run_gpu(&gpu, &op, &d_ins).expect("expert_down");
        let b = run_gpu(&gpu, &dn(Some(kernel)), &d_ins).expect("launcher down");
        assert!(
            a[0].1 == b[0].1,
            "{}: not the launcher's bits",
            op.describe()
        );
    }
}

/// `silu(g)·u` crosses f16's 65504 on loud experts (seed §2); plain f16 inputs would turn
/// these routes into infinities.
#[test]
fn down_on_tensor_cores_keeps_activations_beyond_the_f16_range() {
    let Some(gpu) = test_gpu() else { return };
    let (n, ne, k, nf, embd) = (40, 6, 3, 512, 300);
    let mut r = Rng::new(65504);
    let p = plan(&route_ids(&mut r, n, ne, k, true), n, ne, k);
    let (down, w) = quantized_stack(&mut r, ne, embd, nf);
    let act = r.vec(n * k * nf, -3.0e5, 3.0e5);
    assert!(act.iter().any(|v| v.abs() > 65504.0));
    let xrms = rms(&act);
    let ins = vec![HostValue::f32([n * k, nf], &act), down, p[0].clone()];
    for kernel in kernels(&gpu) {
        let op = TcDown(
            ExpertDown {
                n_expert: ne,
                n_embd: embd,
                kernel: REFERENCE,
            },
            Some(kernel),
        );
        let rep = check(&gpu, &op, &ins, down_tol(nf, w, xrms)).expect("parity");
        eprintln!("parity {kernel:?} down, |act| up to 3e5: {rep}");
    }
}

#[test]
fn the_tensor_core_launcher_refuses_widths_that_are_not_whole_k_tiles() {
    let Some(gpu) = test_gpu() else { return };
    let (n, ne, k) = (4, 4, 2);
    let mut r = Rng::new(5);
    let p = plan(&route_ids(&mut r, n, ne, k, false), n, ne, k);
    // 160 inputs: whole IQ4_NL blocks, but not whole 128-value k-tiles.
    let (down, _) = quantized_stack(&mut r, ne, 8, 160);
    let ins = vec![
        HostValue::f32([n * k, 160], &r.vec(n * k * 160, -1.0, 1.0)),
        down,
        p[0].clone(),
    ];
    for kernel in kernels(&gpu) {
        let op = TcDown(
            ExpertDown {
                n_expert: ne,
                n_embd: 8,
                kernel: REFERENCE,
            },
            Some(kernel),
        );
        let e = run_gpu(&gpu, &op, &ins).unwrap_err();
        assert!(
            matches!(e, OpError::Shape { .. }) && e.to_string().contains("128"),
            "{e}"
        );
        assert!(run_cpu(&op, &ins).is_ok());
    }
}

// ---- the real shapes ------------------------------------------------------------------

const NE: usize = 64;
const TOPK: usize = 4;
const EMBD: usize = 3584;
const NFF: usize = 1024;

struct RealWeights {
    gate: HostValue,
    up: HostValue,
    down: HostValue,
}

/// The real-shape expert stacks (≈ 400 MB), built once per process.
fn real_weights() -> &'static RealWeights {
    static W: OnceLock<RealWeights> = OnceLock::new();
    W.get_or_init(|| {
        let mut r = Rng::new(2024);
        RealWeights {
            gate: random_stack(&mut r, NE, NFF, EMBD),
            up: random_stack(&mut r, NE, NFF, EMBD),
            down: random_stack(&mut r, NE, EMBD, NFF),
        }
    })
}

/// SwiGLU and down inputs of one `chunk`-token prefill chunk on a random (synthetic
/// checkpoint) or skewed plan, and the routes per expert.
fn real_case(chunk: usize, skew: bool) -> (Vec<HostValue>, Vec<HostValue>, Vec<i32>) {
    let w = real_weights();
    let mut r = Rng::new(11 + skew as u64);
    let p = plan(&route_ids(&mut r, chunk, NE, TOPK, skew), chunk, NE, TOPK);
    let rt = chunk * TOPK;
    let s_ins = vec![
        HostValue::f32([chunk, EMBD], &r.vec(chunk * EMBD, -1.0, 1.0)),
        w.gate.clone(),
        w.up.clone(),
        p[0].clone(),
        p[1].clone(),
    ];
    let d_ins = vec![
        HostValue::f32([rt, NFF], &r.vec(rt * NFF, -1.0, 1.0)),
        w.down.clone(),
        p[0].clone(),
    ];
    (s_ins, d_ins, counts(&p[0]))
}

/// The real-shape grouped product on `kernel` (`None`: the default launcher's).
fn real_op(swiglu: bool, kernel: Option<TcKernel>) -> Box<dyn Op> {
    if swiglu {
        Box::new(TcSwiGlu(
            ExpertSwiGlu {
                n_expert: NE,
                n_ff: NFF,
                kernel: REFERENCE,
            },
            kernel,
        ))
    } else {
        Box::new(TcDown(
            ExpertDown {
                n_expert: NE,
                n_embd: EMBD,
                kernel: REFERENCE,
            },
            kernel,
        ))
    }
}

#[test]
fn the_tensor_core_path_matches_and_repeats_bit_for_bit_at_the_real_shapes() {
    let Some(gpu) = test_gpu() else { return };
    let xrms = 1.0 / 3f32.sqrt();
    for skew in [false, true] {
        // A 512-token chunk, 2048 routes: ~32 an expert on the random plan, one expert of
        // several 128-route tiles on the skewed one.
        let (s_ins, d_ins, c) = real_case(512, skew);
        let (lo, hi) = (c.iter().min().unwrap(), c.iter().max().unwrap());
        let plan = if skew { "skewed" } else { "random" };
        let cases = [
            (true, &s_ins, swiglu_tol(EMBD, IQ4_WRMS, xrms)),
            (false, &d_ins, down_tol(NFF, IQ4_WRMS, xrms)),
        ];
        for (swiglu, ins, tol) in cases {
            // The CPU reference once for both kernels.
            let cpu = run_cpu(real_op(swiglu, None).as_ref(), ins).expect("cpu");
            let (meta, want) = (&cpu[0].0, cpu[0].1.bytes());
            for kernel in kernels(&gpu) {
                let op = real_op(swiglu, Some(kernel));
                let a = run_gpu(&gpu, op.as_ref(), ins).expect("first run");
                let rep = compare(meta, want, &a[0].1, tol).expect("parity");
                eprintln!(
                    "parity {} {plan} plan (routes per expert {lo}..{hi}): {rep}",
                    op.describe()
                );
                let b = run_gpu(&gpu, op.as_ref(), ins).expect("second run");
                assert!(
                    a[0].1 == b[0].1,
                    "{} {plan}: two runs differ",
                    op.describe()
                );
            }
        }
    }
}

// ---- timings ----------------------------------------------------------------------------

struct Dev {
    buf: DeviceBuffer<u8>,
}

impl Dev {
    fn of(gpu: &GpuCtx, v: &HostValue) -> Dev {
        Dev {
            buf: gpu.device.upload(v.data.bytes()).expect("upload"),
        }
    }
    fn zeros(gpu: &GpuCtx, meta: TensorMeta) -> Dev {
        let n = meta.bytes().expect("whole blocks");
        Dev {
            buf: gpu.device.upload(&vec![0u8; n]).expect("upload"),
        }
    }
    fn ptr(&self) -> u64 {
        self.buf.device_ptr()
    }
}

fn line(what: &str, us: f64, bytes: f64, flops: f64) {
    println!(
        "{what:<52} {us:>9.2} µs {:>7.0} GB/s {:>6.1} TFLOP/s",
        bytes / us / 1e3,
        flops / us / 1e6
    );
}

/// Prefill chunks of 1024 tokens (4096 routes, ~64 an expert) and 2048 tokens (the default
/// chunk: 8192 routes, ~128 an expert), each kernel. GB/s counts the weights of experts with
/// routes once plus the inputs and outputs; TFLOP/s the useful products.
#[test]
#[ignore = "timing table at the real shapes: run on the GPU host with --include-ignored"]
fn expert_gemm_timings_at_the_real_shapes() {
    let Some(gpu) = test_gpu() else { return };
    let slice = (NFF * EMBD / 32 * 18) as f64;
    let reps = 4;
    for chunk in [1024, 2048] {
        let rt = chunk * TOPK;
        let sw_flops = 4.0 * (rt * NFF * EMBD) as f64;
        let dn_flops = 2.0 * (rt * NFF * EMBD) as f64;
        for skew in [false, true] {
            let (s_ins, d_ins, c) = real_case(chunk, skew);
            let plan = if skew { "skewed" } else { "random" };
            let experts = c.iter().filter(|&&n| n > 0).count() as f64;
            let z = Dev::of(&gpu, &s_ins[0]);
            let (gate, up) = (Dev::of(&gpu, &s_ins[1]), Dev::of(&gpu, &s_ins[2]));
            let (off, tok) = (Dev::of(&gpu, &s_ins[3]), Dev::of(&gpu, &s_ins[4]));
            let act = Dev::of(&gpu, &d_ins[0]);
            let down = Dev::of(&gpu, &d_ins[1]);
            let act_o = Dev::zeros(&gpu, TensorMeta::f32([rt, NFF]));
            let ro = Dev::zeros(&gpu, TensorMeta::f32([rt, EMBD]));
            let sw_bytes = 2.0 * experts * slice + ((chunk * EMBD + rt * NFF) * 4) as f64;
            let dn_bytes = experts * slice + ((rt * NFF + rt * EMBD) * 4) as f64;
            println!(
                "{rt} routes, {plan} plan, routes per expert {}..{}",
                c.iter().min().unwrap(),
                c.iter().max().unwrap()
            );
            for kernel in kernels(&gpu) {
                // SAFETY (both closures): the buffers above hold the real shapes.
                let sw = time_us(&gpu, reps, &|_| unsafe {
                    launch_expert_gemm_tc_with(
                        &gpu,
                        kernel,
                        gate.ptr(),
                        Some(up.ptr()),
                        z.ptr(),
                        off.ptr(),
                        tok.ptr(),
                        act_o.ptr(),
                        EMBD,
                        NFF,
                        NE,
                        chunk,
                        rt,
                    )
                });
                let dn = time_us(&gpu, reps, &|_| unsafe {
                    launch_expert_gemm_tc_with(
                        &gpu,
                        kernel,
                        down.ptr(),
                        None,
                        act.ptr(),
                        off.ptr(),
                        0,
                        ro.ptr(),
                        NFF,
                        EMBD,
                        NE,
                        rt,
                        rt,
                    )
                });
                line(
                    &format!("  swiglu 3584->2x1024 {kernel:?}"),
                    sw,
                    sw_bytes,
                    sw_flops,
                );
                line(
                    &format!("  down 1024->3584 {kernel:?}"),
                    dn,
                    dn_bytes,
                    dn_flops,
                );
            }
        }
    }
}

fn time_us(gpu: &GpuCtx, reps: usize, call: &dyn Fn(usize) -> Result<(), OpError>) -> f64 {
    ops::parity::time_calls_us(gpu, reps, call).expect("timing")
}
