//! CUDA parity of `Linear` on all three of its paths (skips without a GPU, saying why),
//! bit-reproducibility, and (ignored by default) timings at Xing4.0's real shapes.

use half::{bf16, f16};
use ops::Op;
use ops::gpu::{DeviceTensor, GpuCtx, Scratch};
use ops::linear::{Linear, LinearKernel, LinearPair, NormLinear};
use ops::parity::{
    H200_COPY_CEILING_GBS, HostValue, Rng, Tolerance, check, compare, run_cpu, run_gpu, test_gpu,
    time_calls_us,
};
use ops::{DType, TensorMeta};
use proptest::prelude::*;

mod support;
use support::linear_for;

/// Weight bytes for `rows × cols`: float types from uniform values, block types from
/// random bytes with a finite random f16 scale in every block.
fn random_weight(r: &mut Rng, dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
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

struct Case {
    x: Vec<f32>,
    w: Vec<u8>,
    dtype: DType,
    n: usize,
    k: usize,
    o: usize,
}

impl Case {
    fn random(seed: u64, dtype: DType, n: usize, k: usize, o: usize) -> Case {
        let mut r = Rng(seed | 1);
        let w = random_weight(&mut r, dtype, o, k);
        Case {
            x: r.vec(n * k, -2.0, 2.0),
            w,
            dtype,
            n,
            k,
            o,
        }
    }

    fn inputs(&self) -> Vec<HostValue> {
        vec![
            HostValue::f32([self.n, self.k], &self.x),
            HostValue::from_bytes(TensorMeta::new([self.o, self.k], self.dtype), &self.w),
        ]
    }

    /// max over outputs of Σ_i |W[o][i]·x[t][i]| (f64), the scale every rounding is
    /// relative to (an output itself can cancel to near zero).
    fn scale(&self) -> f64 {
        let ty = self.dtype.ggml().expect("a weight type");
        let rb = ty.row_bytes(self.k).expect("whole blocks");
        let mut row = vec![0f32; self.k];
        let mut s = 0f64;
        for o in 0..self.o {
            loader::quant::dequantize(ty, &self.w[o * rb..(o + 1) * rb], &mut row).expect("row");
            for t in 0..self.n {
                let x = &self.x[t * self.k..(t + 1) * self.k];
                let a: f64 = row
                    .iter()
                    .zip(x)
                    .map(|(w, x)| (*w as f64 * *x as f64).abs())
                    .sum();
                s = s.max(a);
            }
        }
        s
    }

    /// The GEMV and the fallback compute in f32 like the reference, in another order.
    /// A reordered sum of K terms differs by at most ~K·u·Σ|terms| and in practice by
    /// O(√K·u·Σ|terms|) (random rounding signs); 16√K·u·scale sits far above the
    /// second and far below any indexing mistake (which moves an output by O(scale/√K)).
    fn f32_tol(&self) -> Tolerance {
        let u = f32::EPSILON as f64 / 2.0;
        Tolerance::new(
            1e-5,
            (16.0 * (self.k as f64).sqrt() * u * self.scale()) as f32,
        )
    }

    /// The tensor-core path rounds x and the decoded weight to bf16 (relative 2⁻⁹ each),
    /// then accumulates in f32: |Δ| ≤ (2⁻⁸ + 2⁻¹⁸ + 2K·u)·Σ|w·x|, a strict bound.
    fn bf16_tol(&self) -> Tolerance {
        let u = f32::EPSILON as f64 / 2.0;
        let b = 2f64.powi(-8) + 2f64.powi(-18) + 2.0 * self.k as f64 * u;
        Tolerance::new(Tolerance::BF16.rel, (b * self.scale()) as f32)
    }
}

const TYPES: [DType; 6] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q8_0,
    DType::Q6_K,
    DType::IQ4_NL,
];

#[test]
fn the_decode_gemv_matches_the_cpu_reference_for_every_weight_type() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(48), |(
        ti in 0usize..6, n in 1usize..=8, o in 1usize..300, seed in any::<u64>(),
        blocks in prop::sample::select(vec![1usize, 2, 3, 5, 16, 21]),
    )| {
        // Whole 256-column groups reach every decode path (and Q6_K needs them); 21 of
        // them stream Q6_K and Q8_0 rows in two chunks, the float types in several.
        let dtype = TYPES[ti];
        let k = if matches!(dtype, DType::F32 | DType::BF16) { 640 * blocks } else { 256 * blocks };
        let c = Case::random(seed, dtype, n, k, o);
        let op = Linear::with(linear_for(n));
        let r = check(&gpu, &op, &c.inputs(), c.f32_tol()).map_err(TestCaseError::fail)?;
        prop_assert_eq!(r.elements, n * o);
    });
}

#[test]
fn the_one_token_iq4_nl_gemv_matches_the_cpu_reference_over_slice_counts() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(32), |(
        o in 1usize..300, seed in any::<u64>(),
        pairs in prop::sample::select(vec![1usize, 3, 16, 17, 50, 56, 144, 160, 256]),
    )| {
        // K = 64·pairs: whole 256-value chunks (16, 56 = 3584, 144 = 9216, 160, 256) take the
        // row GEMV, split into K parts of one to four chunks; the others (1, 3, 17, 50) the
        // staged GEMV. Random row counts leave partial row tiles.
        let c = Case::random(seed, DType::IQ4_NL, 1, 64 * pairs, o);
        let op = Linear::with(linear_for(1));
        let r = check(&gpu, &op, &c.inputs(), c.f32_tol()).map_err(TestCaseError::fail)?;
        prop_assert_eq!(r.elements, o);
    });
}

#[test]
fn the_one_token_bf16_gemv_matches_the_cpu_reference_over_row_lengths() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(32), |(
        units in 1usize..1200, o in 1usize..400, weights_first in any::<bool>(),
        seed in any::<u64>(),
    )| {
        // K = 8·units: up to 128 units rows go four to a block, longer ones one to a block
        // split over 1 to 8 warps, with the last warps' loads partly past the row's end. The
        // weight loads are issued before or after the wait for the predecessor.
        let c = Case::random(seed, DType::BF16, 1, 8 * units, o);
        let op = Linear::with(LinearKernel::Gemv { weights_first });
        let r = check(&gpu, &op, &c.inputs(), c.f32_tol()).map_err(TestCaseError::fail)?;
        prop_assert_eq!(r.elements, o);
    });
}

#[test]
fn the_q6_k_decode_product_matches_the_cpu_reference_over_tokens_rows_and_magnitudes() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(40), |(
        n in 1usize..=8, o in 1usize..300, seed in any::<u64>(), weights_first in any::<bool>(),
        blocks in prop::sample::select(vec![1usize, 2, 3, 14]),
        magnitude in prop::sample::select(vec![1e-30f32, 1e-3, 1.0, 3e4]),
        outlier in any::<bool>(),
    )| {
        // The integer-MMA product (x as 32-bit fixed point a token): whole and partial 16-row
        // tiles, rows whose blocks start 2 bytes into a word (an odd count of blocks a row),
        // 1 to 4 column tiles, inputs from tiny to large, and a token whose largest value
        // dwarfs the rest (the fixed point's step is relative to it).
        let mut c = Case::random(seed, DType::Q6_K, n, 256 * blocks, o);
        for v in c.x.iter_mut() {
            *v *= magnitude;
        }
        if outlier {
            let at = seed as usize % c.x.len();
            c.x[at] *= 1e4;
        }
        let op = Linear::with(LinearKernel::Gemv { weights_first });
        let r = check(&gpu, &op, &c.inputs(), c.f32_tol()).map_err(TestCaseError::fail)?;
        prop_assert_eq!(r.elements, n * o);
    });
}

#[test]
fn a_non_finite_input_makes_only_its_own_tokens_q6_k_outputs_non_finite() {
    let Some(gpu) = test_gpu() else { return };
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut c = Case::random(0x6b, DType::Q6_K, 3, 3584, 100);
        c.x[c.k + 17] = bad;
        let op = Linear::with(linear_for(3));
        let gpu_out = run_gpu(&gpu, &op, &c.inputs()).expect("gpu");
        let cpu_out = run_cpu(&op, &c.inputs()).expect("cpu");
        let g: Vec<f32> = gpu_out[0]
            .1
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let want = cpu_out[0].1.f32s();
        for t in 0..3 {
            let row = &g[t * c.o..(t + 1) * c.o];
            if t == 1 {
                assert!(
                    row.iter().all(|v| !v.is_finite()),
                    "{bad}: token 1 has finite outputs"
                );
            } else {
                let tol = c.f32_tol();
                for (a, b) in row.iter().zip(&want[t * c.o..(t + 1) * c.o]) {
                    assert!(
                        (a - b).abs() <= tol.abs + tol.rel * b.abs(),
                        "{bad}: token {t}: {a} against {b}"
                    );
                }
            }
        }
    }
}

/// Two weights over one x: the first weight's case and a second weight of its own width.
fn pair_case(seed: u64, dtype: DType, n: usize, k: usize, o1: usize, o2: usize) -> (Case, Case) {
    let a = Case::random(seed, dtype, n, k, o1);
    let mut b = Case::random(seed ^ 0x9a12, dtype, n, k, o2);
    b.x = a.x.clone();
    (a, b)
}

#[test]
fn a_linear_pair_gives_each_product_of_its_weights() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(32), |(
        bf in any::<bool>(), n in prop_oneof![Just(1usize), 2usize..20],
        units in 1usize..600, o1 in 1usize..300, o2 in 1usize..300, seed in any::<u64>(),
    )| {
        // One BF16 token takes the one-launch kernel (blocks split between the weights);
        // otherwise the op is two `linear`s.
        let dtype = if bf { DType::BF16 } else { DType::Q8_0 };
        let k = if bf { 8 * units } else { 32 * units.div_ceil(4) };
        let (a, b) = pair_case(seed, dtype, n, k, o1, o2);
        let mut ins = a.inputs();
        ins.push(b.inputs().swap_remove(1));
        let kernel = linear_for(n);
        let op = LinearPair { kernel };
        let cpu = run_cpu(&op, &ins).map_err(|e| TestCaseError::fail(format!("cpu: {e}")))?;
        let dev = run_gpu(&gpu, &op, &ins).map_err(|e| TestCaseError::fail(format!("cuda: {e}")))?;
        let tensor_cores = kernel == LinearKernel::TensorCore;
        let tol = |c: &Case| if tensor_cores { c.bf16_tol() } else { c.f32_tol() };
        for (i, (c, ((m, want), (_, got)))) in [&a, &b].into_iter().zip(cpu.iter().zip(&dev)).enumerate() {
            compare(m, want.bytes(), got, tol(c))
                .map_err(|e| TestCaseError::fail(format!("{dtype} n={n} K={k}: output {i}: {e}")))?;
        }
    });
}

#[test]
fn a_norm_linear_is_the_product_of_the_normalised_input() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(32), |(
        bf in any::<bool>(), n in prop_oneof![Just(1usize), 2usize..20],
        units in 1usize..400, o in 1usize..300, seed in any::<u64>(),
    )| {
        // One BF16 token normalises inside the GEMV; everything else runs rms_norm, then linear.
        let dtype = if bf { DType::BF16 } else { DType::Q8_0 };
        let k = if bf { 8 * units } else { 32 * units.div_ceil(4) };
        let c = Case::random(seed, dtype, n, k, o);
        let mut r = Rng(seed ^ 0x4e0e | 1);
        let g = r.vec(k, 0.5, 1.5);
        let eps = 1e-6;
        // The tolerances are the product's, over the normalised input (what W multiplies); the
        // norm's own roundings (a few ulps of x) sit far below them.
        let mut xn = vec![0f32; n * k];
        ops::norm::rms_norm_rows(&c.x, Some(&g), k, eps, &mut xn);
        let normed = Case { x: xn, w: c.w.clone(), dtype, n, k, o };
        let kernel = linear_for(n);
        let tensor_cores = kernel == LinearKernel::TensorCore;
        let tol = if tensor_cores { normed.bf16_tol() } else { normed.f32_tol() };
        let mut ins = c.inputs();
        ins.insert(1, HostValue::f32([k], &g));
        let r = check(&gpu, &NormLinear { eps, kernel }, &ins, tol).map_err(TestCaseError::fail)?;
        prop_assert_eq!(r.elements, n * o);
    });
}

#[test]
fn the_prefill_paths_match_the_cpu_reference_within_bf16_rounding() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(32), |(
        ti in 0usize..6, n in 9usize..150, groups in 1usize..40, o in 1usize..200, seed in any::<u64>()
    )| {
        // BF16 takes cuBLAS, the other types the tiles (one block a multiprocessor at these
        // grids).
        // K = 32·groups leaves a half-empty last K slice of 64 when groups is odd; Q6_K needs
        // whole 256-value blocks. Odd n and O leave partial token and row tiles and single
        // (unpaired) stores.
        let dtype = TYPES[ti];
        let k = if dtype == DType::Q6_K { 256 * groups.div_ceil(8) } else { 32 * groups };
        let c = Case::random(seed, dtype, n, k, o);
        let op = Linear::with(linear_for(n));
        let r = check(&gpu, &op, &c.inputs(), c.bf16_tol()).map_err(TestCaseError::fail)?;
        prop_assert_eq!(r.elements, n * o);
    });
}

#[test]
fn prefill_tiles_two_to_a_multiprocessor_match_the_cpu_reference_with_partial_tiles() {
    let Some(gpu) = test_gpu() else { return };
    // 67 row tiles × 2 token tiles of 128 is more blocks than the H200's 132 multiprocessors,
    // so they go two to a multiprocessor (linear.rs's fit test pins this grid); 150 tokens and
    // 8500 rows leave both last tiles partial, K = 480 a half-empty last slice.
    for (i, (dtype, k)) in [(DType::IQ4_NL, 480), (DType::Q8_0, 480), (DType::Q6_K, 512)]
        .into_iter()
        .enumerate()
    {
        let c = Case::random(0x3c + i as u64, dtype, 150, k, 8500);
        let r = check(
            &gpu,
            &Linear::with(LinearKernel::TensorCore),
            &c.inputs(),
            c.bf16_tol(),
        )
        .unwrap_or_else(|e| panic!("{dtype} n=150: {e}"));
        println!("linear two-a-multiprocessor tiles {dtype} n=150 K={k} O=8500: {r}");
    }
}

#[test]
fn widths_that_are_not_whole_decode_units_take_the_fallback_and_still_match() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(24), |(
        ti in 0usize..3, n in 1usize..20, k in 1usize..300, o in 1usize..100, seed in any::<u64>()
    )| {
        // Odd K (float weights only: block types have whole blocks by the shape rule).
        let k = k | 1;
        let c = Case::random(seed, TYPES[ti], n, k, o);
        let op = Linear::with(linear_for(n));
        check(&gpu, &op, &c.inputs(), c.f32_tol()).map_err(TestCaseError::fail)?;
    });
}

/// (name, in, out, weight type) of every Linear the brief times.
const SHAPES: [(&str, usize, usize, DType); 9] = [
    ("attn q_a", 3584, 768, DType::BF16),
    ("attn q_b", 768, 6144, DType::BF16),
    ("attn kv_a", 3584, 576, DType::BF16),
    ("attn o", 4096, 3584, DType::BF16),
    ("dense ffn up", 3584, 9216, DType::IQ4_NL),
    ("dense ffn down", 9216, 3584, DType::IQ4_NL),
    ("shared expert up", 3584, 1024, DType::IQ4_NL),
    ("shared expert down", 1024, 3584, DType::IQ4_NL),
    ("lm head", 3584, 131072, DType::Q6_K),
];

#[test]
fn every_real_xing4_shape_matches_the_cpu_reference_at_one_and_three_tokens() {
    let Some(gpu) = test_gpu() else { return };
    for (i, &(name, k, o, dtype)) in SHAPES.iter().enumerate() {
        for n in [1, 3] {
            let c = Case::random(0x9e37 + i as u64 * 7 + n as u64, dtype, n, k, o);
            let r = check(&gpu, &Linear::with(linear_for(n)), &c.inputs(), c.f32_tol())
                .unwrap_or_else(|e| panic!("{name} n={n}: {e}"));
            println!("linear {name} {dtype} n={n}: {r}");
        }
    }
}

#[test]
fn real_shapes_take_the_tensor_cores_at_a_prefill_chunk() {
    let Some(gpu) = test_gpu() else { return };
    // The lm head is cut to 4096 rows to keep the CPU reference quick.
    for (i, (name, k, o, dtype)) in [
        ("attn q_a", 3584, 768, DType::BF16),
        ("shared expert down", 1024, 3584, DType::IQ4_NL),
        ("lm head (4096 rows)", 3584, 4096, DType::Q6_K),
    ]
    .into_iter()
    .enumerate()
    {
        let c = Case::random(0x51 + i as u64, dtype, 100, k, o);
        let r = check(
            &gpu,
            &Linear::with(LinearKernel::TensorCore),
            &c.inputs(),
            c.bf16_tol(),
        )
        .unwrap_or_else(|e| panic!("{name} n=100: {e}"));
        println!("linear {name} {dtype} n=100: {r}");
    }
}

#[test]
fn linear_gives_the_same_bits_on_every_run() {
    let Some(gpu) = test_gpu() else { return };
    for (n, dtype) in [
        (1, DType::BF16),
        (1, DType::IQ4_NL),
        (5, DType::IQ4_NL),
        (1, DType::Q6_K),
        (70, DType::IQ4_NL),
        (300, DType::IQ4_NL),
        (300, DType::BF16),
    ] {
        let c = Case::random(77 + n as u64, dtype, n, 3584, 1000);
        let op = Linear::with(linear_for(n));
        let a = run_gpu(&gpu, &op, &c.inputs()).expect("first run");
        let b = run_gpu(&gpu, &op, &c.inputs()).expect("second run");
        assert!(a[0].1 == b[0].1, "{dtype} n={n}: two runs differ");
    }
}

/// `Linear` (on the variant a plan of `n` rows would carry) on device buffers: `copies` copies
/// of one random weight (so that a small weight can be rotated out of the 60 MB L2), x, y and
/// the scratch the op asks for.
struct OnDevice {
    op: Linear,
    metas: [TensorMeta; 3],
    ws: Vec<cuda::DeviceBuffer<u8>>,
    w_bytes: usize,
    x: cuda::DeviceBuffer<f32>,
    y: cuda::DeviceBuffer<f32>,
    scratch: cuda::DeviceBuffer<u8>,
}

impl OnDevice {
    fn new(gpu: &GpuCtx, shape: (usize, usize, usize), dtype: DType, copies: usize) -> OnDevice {
        OnDevice::with_kernel(gpu, shape, dtype, copies, linear_for(shape.0))
    }

    fn with_kernel(
        gpu: &GpuCtx,
        (n, k, o): (usize, usize, usize),
        dtype: DType,
        copies: usize,
        kernel: LinearKernel,
    ) -> OnDevice {
        let dev = &gpu.device;
        let mut r = Rng(0x1234_5678 + k as u64);
        let wb = random_weight(&mut r, dtype, o, k);
        let metas = [
            TensorMeta::f32([n, k]),
            TensorMeta::new([o, k], dtype),
            TensorMeta::f32([n, o]),
        ];
        let op = Linear::with(kernel);
        let scratch = op.cuda_scratch_bytes(&[&metas[0], &metas[1]]);
        OnDevice {
            op,
            ws: (0..copies.max(1))
                .map(|_| dev.upload(&wb).expect("upload"))
                .collect(),
            w_bytes: wb.len(),
            x: dev.upload(&r.vec(n * k, -1.0, 1.0)).expect("upload"),
            y: dev.upload(&vec![f32::NAN; n * o]).expect("upload"),
            scratch: dev.upload(&vec![0xffu8; scratch.max(1)]).expect("upload"),
            metas,
        }
    }

    /// Enqueues the op on weight copy `i % copies`.
    fn call(&self, gpu: &GpuCtx, i: usize) -> Result<(), ops::OpError> {
        let [xm, wm, ym] = &self.metas;
        let ins = [
            DeviceTensor {
                meta: xm,
                ptr: self.x.device_ptr(),
                bytes: self.x.num_bytes(),
            },
            DeviceTensor {
                meta: wm,
                ptr: self.ws[i % self.ws.len()].device_ptr(),
                bytes: self.w_bytes,
            },
        ];
        let outs = [DeviceTensor {
            meta: ym,
            ptr: self.y.device_ptr(),
            bytes: self.y.num_bytes(),
        }];
        let scratch = Scratch {
            ptr: self.scratch.device_ptr(),
            bytes: self.op.cuda_scratch_bytes(&[xm, wm]),
        };
        self.op.cuda(gpu, &ins, &outs, scratch)
    }
}

#[test]
fn the_prefill_paths_replay_from_a_captured_graph_with_the_eager_bits() {
    let Some(gpu) = test_gpu() else { return };
    // A capture fails on any allocation or host sync inside it, cuBLAS's included; the
    // replay must then write exactly what the eager call wrote.
    for dtype in [DType::BF16, DType::IQ4_NL] {
        let mut d = OnDevice::new(&gpu, (300, 3584, 1000), dtype, 1);
        d.call(&gpu, 0).expect("eager call");
        let eager = d.y.to_vec().expect("download");
        assert!(eager.iter().all(|v| v.is_finite()), "{dtype}: eager output");
        d.y.copy_from_host(&vec![f32::NAN; eager.len()])
            .expect("poison");
        let graph = gpu
            .device
            .capture(|_| {
                d.call(&gpu, 0)
                    .map_err(|e| panic!("{dtype}: call during capture: {e}"))
            })
            .unwrap_or_else(|e| panic!("{dtype}: capture: {e}"));
        graph.launch().expect("replay");
        gpu.device.synchronize().expect("sync");
        let replayed = d.y.to_vec().expect("download");
        let same = eager
            .iter()
            .zip(&replayed)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{dtype}: the replay differs from the eager call");
    }
}

/// Microseconds a call (graph-replayed, median of 7) and the bytes it must move over that time.
fn time_linear(gpu: &GpuCtx, k: usize, o: usize, dtype: DType, n: usize) -> (f64, f64) {
    let w_bytes = dtype.row_bytes(k).expect("whole blocks") * o;
    let copies = if n <= 8 { (400 << 20) / w_bytes } else { 1 }.clamp(1, 64);
    let d = OnDevice::new(gpu, (n, k, o), dtype, copies);
    let reps = if n <= 8 { 4 * copies.max(25) } else { 10 };
    let us = time_calls_us(gpu, reps, &|i| d.call(gpu, i)).expect("timing");
    let bytes = (w_bytes + n * k * 4 + n * o * 4) as f64;
    (us, bytes / us / 1e3)
}

#[test]
#[ignore = "timing table at the real shapes: run on the GPU host with --ignored"]
fn linear_timings_at_the_real_shapes() {
    let Some(gpu) = test_gpu() else { return };
    println!(
        "{:<22} {:>6} {:>5} {:>10} {:>9} {:>9}",
        "linear", "type", "n", "µs", "GB/s", "TFLOP/s"
    );
    // The shared expert's up shape stored as Q8_0 too, to time that decode.
    let extra = [("shared up as Q8_0", 3584, 1024, DType::Q8_0)];
    for &(name, k, o, dtype) in SHAPES.iter().chain(&extra) {
        for n in [1, 1024, 2048] {
            let (us, gbs) = time_linear(&gpu, k, o, dtype, n);
            let tf = 2.0 * (n * k * o) as f64 / us / 1e6;
            println!(
                "{name:<22} {:>6} {n:>5} {us:>10.2} {gbs:>9.0} {tf:>9.1}",
                dtype.name()
            );
        }
    }
}

/// One of linear.cu's kernels by name, for a timing that launches it directly.
fn linear_cu_kernel(gpu: &GpuCtx, name: &str) -> cuda::Kernel {
    let source = ops::kernel_sources()
        .into_iter()
        .find(|(file, _)| *file == "linear.cu")
        .expect("linear.cu")
        .1;
    gpu.kernel("linear.cu", source, name).expect("kernel")
}

/// Microseconds of the prefill path's kernels launched directly (graph-replayed): the
/// narrowing of x alone (`fit` None) or narrowing plus `linear_tq_<type>_<fit>`, whichever
/// fit the op itself would choose.
fn time_tq_variant(gpu: &GpuCtx, d: &OnDevice, fit: Option<&str>) -> f64 {
    let [xm, wm, _] = &d.metas;
    let (n, k, o) = (xm.shape[0], xm.shape[1], wm.shape[0]);
    let xb = d.scratch.device_ptr().next_multiple_of(256);
    let narrow = linear_cu_kernel(gpu, "linear_x_bf16");
    let tq = fit.map(|f| {
        let name = format!("linear_tq_{}_{f}", wm.dtype.name().to_lowercase());
        linear_cu_kernel(gpu, &name)
    });
    let rb = wm.dtype.row_bytes(k).expect("whole blocks") as i64;
    let call = |_: usize| -> Result<(), ops::OpError> {
        // SAFETY: as Linear::cuda's prefill path (same arguments, same scratch layout).
        unsafe {
            gpu.device
                .launch(&narrow)
                .grid((n * k).div_ceil(2048) as u32)
                .block(256)
                .arg(d.x.device_ptr())
                .arg(xb)
                .arg((n * k) as i64)
                .enqueue()
                .map_err(ops::gpu::dev_err)?;
            if let Some(kern) = &tq {
                gpu.device
                    .launch(kern)
                    .grid((o.div_ceil(128) as u32, n.div_ceil(128) as u32))
                    .block(256)
                    .shared_mem(5 * 128 * 144)
                    .arg(d.ws[0].device_ptr())
                    .arg(d.x.device_ptr())
                    .arg(d.y.device_ptr())
                    .arg(n as i32)
                    .arg(k as i32)
                    .arg(o as i32)
                    .arg(rb)
                    .arg(xb)
                    .arg(i32::from(o % 2 == 0))
                    // One split over the whole K: y written directly.
                    .arg(0u64)
                    .arg(i32::MAX)
                    .enqueue()
                    .map_err(ops::gpu::dev_err)?;
            }
        }
        Ok(())
    };
    time_calls_us(gpu, 10, &call).expect("timing")
}

#[test]
#[ignore = "timing of the prefill tile variants: run on the GPU host with --ignored"]
fn linear_prefill_tile_variants() {
    let Some(gpu) = test_gpu() else { return };
    // The op picks x1 (one block a multiprocessor) or x2 by grid size; both must write the
    // same bits.
    let fits = ["x2", "x1"];
    println!(
        "{:<22} {:>5} {:>8} {:>8} {:>8}  same bits",
        "variant µs", "n", "x→bf16", fits[0], fits[1]
    );
    for &(name, k, o, dtype) in &SHAPES {
        if dtype != DType::IQ4_NL && name != "attn o" {
            continue;
        }
        for n in [1024, 2048] {
            let d = OnDevice::new(&gpu, (n, k, o), dtype, 1);
            let x = time_tq_variant(&gpu, &d, None);
            let mut us = [f64::NAN; 2];
            let mut first: Option<Vec<f32>> = None;
            let mut same = true;
            if dtype == DType::IQ4_NL {
                for (t, fit) in us.iter_mut().zip(fits) {
                    *t = time_tq_variant(&gpu, &d, Some(fit));
                    let y = d.y.to_vec().expect("download");
                    match &first {
                        None => first = Some(y),
                        Some(f) => {
                            same &= f.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits())
                        }
                    }
                }
            }
            println!(
                "{name:<22} {n:>5} {x:>8.2} {:>8.2} {:>8.2}  {same}",
                us[0], us[1]
            );
            assert!(same, "{name} n={n}: the variants write different bits");
        }
    }
}

#[test]
#[ignore = "timing of the K split at a mixed step's rows: run on the GPU host with --ignored"]
fn linear_k_split_against_whole_k_at_a_mixed_steps_rows() {
    let Some(gpu) = test_gpu() else { return };
    // The op (its K split where the tiles leave multiprocessors idle) against the same
    // one-a-multiprocessor tiles over the whole K, launched directly; both from the same x.
    println!(
        "{:<22} {:>5} {:>10} {:>10} {:>12}",
        "split µs", "n", "op", "whole K", "max |diff|"
    );
    for &(name, k, o, dtype) in &SHAPES {
        if !name.starts_with("shared expert") {
            continue;
        }
        for n in [256, 576, 1024] {
            let d = OnDevice::new(&gpu, (n, k, o), dtype, 1);
            let split = time_calls_us(&gpu, 10, &|i| d.call(&gpu, i)).expect("timing");
            let y_split = d.y.to_vec().expect("download");
            let whole = time_tq_variant(&gpu, &d, Some("x1"));
            let y_whole = d.y.to_vec().expect("download");
            let diff = y_split
                .iter()
                .zip(&y_whole)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            println!("{name:<22} {n:>5} {split:>10.2} {whole:>10.2} {diff:>12.3e}");
            assert!(diff.is_finite(), "{name} n={n}: non-finite difference");
        }
    }
}

/// The BF16 attention projections of a batched decode step on the skinny kernel (q_a with
/// kv_a as the one 1,344-row matrix the pair launches): (name, in, out).
const SKINNY_BF16_SHAPES: [(&str, usize, usize); 3] = [
    ("q_a+kv_a", 3584, 1344),
    ("attn q_b", 768, 6144),
    ("attn o", 4096, 3584),
];

/// A skinny BF16 product of `n` rows on device buffers, its weight in enough copies that a
/// replay reads it from memory rather than the 60 MB L2.
fn skinny_bf16_on_device(gpu: &GpuCtx, n: usize, k: usize, o: usize) -> OnDevice {
    let copies = ((400usize << 20) / (2 * k * o)).clamp(2, 64);
    OnDevice::with_kernel(gpu, (n, k, o), DType::BF16, copies, LinearKernel::Skinny)
}

#[test]
#[ignore = "timing of the skinny BF16 products at decode rows: run on the GPU host with --ignored"]
fn skinny_bf16_timings_at_decode_rows() {
    let Some(gpu) = test_gpu() else { return };
    // Against the tensor-core path (cuBLAS for BF16), the lowering's other choice at these rows.
    println!(
        "{:<12} {:>5} {:>10} {:>9} {:>8} {:>11}",
        "skinny bf16", "n", "µs", "GB/s", "of copy", "cuBLAS µs"
    );
    for &(name, k, o) in &SKINNY_BF16_SHAPES {
        for n in [8, 16, 32, 64, 128] {
            let d = skinny_bf16_on_device(&gpu, n, k, o);
            let reps = 4 * d.ws.len().max(25);
            let us = time_calls_us(&gpu, reps, &|i| d.call(&gpu, i)).expect("timing");
            let y = d.y.to_vec().expect("download");
            assert!(
                y.iter().all(|v| v.is_finite()),
                "{name} n={n}: non-finite output"
            );
            let tc = OnDevice::with_kernel(
                &gpu,
                (n, k, o),
                DType::BF16,
                d.ws.len(),
                LinearKernel::TensorCore,
            );
            let tc_us = time_calls_us(&gpu, reps, &|i| tc.call(&gpu, i)).expect("timing");
            let gbs = (2 * k * o + 4 * n * (k + o)) as f64 / us / 1e3;
            println!(
                "{name:<12} {n:>5} {us:>10.2} {gbs:>9.0} {:>7.1}% {tc_us:>11.2}",
                100.0 * gbs / H200_COPY_CEILING_GBS
            );
        }
    }
}

/// The same products launched once a shape (no graph, no repeats): what a profiler attaches
/// to (`ncu -k regex:linear_skinny`, the product and its split-K sum); checks only that every
/// launch succeeds.
#[test]
#[ignore = "one launch a shape for a profiler: run on the GPU host with --include-ignored"]
fn skinny_bf16_products_launched_once_for_a_profiler() {
    let Some(gpu) = test_gpu() else { return };
    for &(name, k, o) in &SKINNY_BF16_SHAPES {
        for n in [8, 64] {
            let d = skinny_bf16_on_device(&gpu, n, k, o);
            d.call(&gpu, 0).expect(name);
            gpu.device.synchronize().expect("synchronize");
        }
    }
}

/// The lm head's shape: hidden 3,584 → 131,072 rows of Q6_K (385 MB, far past the L2).
const LM_HEAD: (usize, usize) = (3584, 131_072);

/// Microseconds of the generic GEMV `gemv_q6_k_<nt>` (the path before the integer-MMA
/// product) launched directly on `d`'s buffers, and its output.
fn time_generic_q6_k_gemv(gpu: &GpuCtx, d: &OnDevice) -> (f64, Vec<f32>) {
    let [xm, wm, _] = &d.metas;
    let (n, k, o) = (xm.shape[0], xm.shape[1], wm.shape[0]);
    let name = format!("gemv_q6_k_{}", n.next_power_of_two());
    let kern = linear_cu_kernel(gpu, &name);
    let sms = gpu.device.sm_count() as usize;
    let rb = DType::Q6_K.row_bytes(k).expect("whole blocks") as i64;
    let call = |i: usize| -> Result<(), ops::OpError> {
        // SAFETY: as Linear::cuda's generic GEMV arm (4 warps, 6 blocks a multiprocessor,
        // two 4,128-byte buffers a warp), on buffers of n×k, o rows and n×o.
        unsafe {
            gpu.device
                .launch(&kern)
                .grid(o.div_ceil(4).min(sms * 6) as u32)
                .block(128)
                .shared_mem(4 * 2 * (4096 + 32))
                .arg(d.ws[i % d.ws.len()].device_ptr())
                .arg(d.x.device_ptr())
                .arg(d.y.device_ptr())
                .arg(n as i32)
                .arg(k as i32)
                .arg(o as i32)
                .arg(rb)
                .enqueue()
                .map_err(ops::gpu::dev_err)
        }
    };
    let reps = 4 * d.ws.len().max(25);
    let us = time_calls_us(gpu, reps, &call).expect("timing");
    (us, d.y.to_vec().expect("download"))
}

#[test]
#[ignore = "timing of the Q6_K lm head at decode rows: run on the GPU host with --ignored"]
fn q6_k_lm_head_timings_at_decode_rows() {
    let Some(gpu) = test_gpu() else { return };
    let (k, o) = LM_HEAD;
    println!(
        "{:<14} {:>3} {:>10} {:>9} {:>8} {:>12} {:>9}",
        "q6_k lm head", "n", "µs", "GB/s", "of copy", "generic µs", "max diff"
    );
    for n in [1, 2, 4, 8] {
        let d = OnDevice::with_kernel(
            &gpu,
            (n, k, o),
            DType::Q6_K,
            2,
            LinearKernel::Gemv {
                weights_first: true,
            },
        );
        let reps = 4 * d.ws.len().max(25);
        let us = time_calls_us(&gpu, reps, &|i| d.call(&gpu, i)).expect("timing");
        let y = d.y.to_vec().expect("download");
        let (generic_us, generic) = time_generic_q6_k_gemv(&gpu, &d);
        let scale = generic.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = y
            .iter()
            .zip(&generic)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
            / scale;
        let gbs = (d.w_bytes + 4 * n * (k + o)) as f64 / us / 1e3;
        println!(
            "{:<14} {n:>3} {us:>10.2} {gbs:>9.0} {:>7.1}% {generic_us:>12.2} {diff:>9.2e}",
            "",
            100.0 * gbs / H200_COPY_CEILING_GBS
        );
        assert!(
            diff < 1e-5,
            "n={n}: the two paths differ by {diff:e} of the largest output"
        );
    }
}

/// The lm head launched once at one and eight tokens (no graph, no repeats), for a profiler
/// (`ncu -k regex:gemv_q6_k`); checks only that every launch succeeds.
#[test]
#[ignore = "one launch a shape for a profiler: run on the GPU host with --include-ignored"]
fn q6_k_lm_head_launched_once_for_a_profiler() {
    let Some(gpu) = test_gpu() else { return };
    let (k, o) = LM_HEAD;
    for n in [1, 8] {
        let d = OnDevice::new(&gpu, (n, k, o), DType::Q6_K, 1);
        d.call(&gpu, 0).expect("lm head");
        gpu.device.synchronize().expect("synchronize");
    }
}
