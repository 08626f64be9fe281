//! CUDA parity of `Linear` on all three of its paths (skips without a GPU, saying why),
//! bit-reproducibility, and (ignored by default) timings at Xing4.0's real shapes.

use half::{bf16, f16};
use ops::Op;
use ops::gpu::{DeviceTensor, GpuCtx, Scratch};
use ops::linear::Linear;
use ops::parity::{HostValue, Tolerance, check, run_gpu, test_gpu};
use ops::{DType, TensorMeta};
use proptest::prelude::*;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)
    }
    fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }
}

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
                .map(|_| r.next() as u8)
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
        let r = check(&gpu, &Linear, &c.inputs(), c.f32_tol()).map_err(TestCaseError::fail)?;
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
        let r = check(&gpu, &Linear, &c.inputs(), c.f32_tol()).map_err(TestCaseError::fail)?;
        prop_assert_eq!(r.elements, o);
    });
}

#[test]
fn the_one_token_bf16_gemv_matches_the_cpu_reference_over_row_lengths() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(32), |(
        units in 1usize..1200, o in 1usize..400, seed in any::<u64>(),
    )| {
        // K = 8·units: up to 128 units rows go four to a block, longer ones one to a block
        // split over 1 to 8 warps, with the last warps' loads partly past the row's end.
        let c = Case::random(seed, DType::BF16, 1, 8 * units, o);
        let r = check(&gpu, &Linear, &c.inputs(), c.f32_tol()).map_err(TestCaseError::fail)?;
        prop_assert_eq!(r.elements, o);
    });
}

#[test]
fn the_tensor_core_path_matches_the_cpu_reference_within_bf16_rounding() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(24), |(
        ti in 0usize..6, n in 9usize..150, blocks in 1usize..5, o in 1usize..200, seed in any::<u64>()
    )| {
        let c = Case::random(seed, TYPES[ti], n, 256 * blocks, o);
        check(&gpu, &Linear, &c.inputs(), c.bf16_tol()).map_err(TestCaseError::fail)?;
    });
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
        check(&gpu, &Linear, &c.inputs(), c.f32_tol()).map_err(TestCaseError::fail)?;
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
            let r = check(&gpu, &Linear, &c.inputs(), c.f32_tol())
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
        let r = check(&gpu, &Linear, &c.inputs(), c.bf16_tol())
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
    ] {
        let c = Case::random(77 + n as u64, dtype, n, 3584, 1000);
        let a = run_gpu(&gpu, &Linear, &c.inputs()).expect("first run");
        let b = run_gpu(&gpu, &Linear, &c.inputs()).expect("second run");
        assert!(a[0].1 == b[0].1, "{dtype} n={n}: two runs differ");
    }
}

/// Median-free but graph-replayed timing: `reps` launches captured into one CUDA graph
/// (as the engine runs a step), rotating over enough weight copies that a small weight
/// is not served from the 60 MB L2.
fn time_linear(gpu: &GpuCtx, k: usize, o: usize, dtype: DType, n: usize) -> (f64, f64) {
    let dev = &gpu.device;
    let mut r = Rng(0x1234_5678 + k as u64);
    let wb = random_weight(&mut r, dtype, o, k);
    let copies = if n <= 8 { (400 << 20) / wb.len() } else { 1 }.clamp(1, 64);
    let ws: Vec<_> = (0..copies)
        .map(|_| dev.upload(&wb).expect("upload"))
        .collect();
    let x = dev.upload(&r.vec(n * k, -1.0, 1.0)).expect("upload");
    let y = dev.upload(&vec![0f32; n * o]).expect("upload");
    let (xm, wm, ym) = (
        TensorMeta::f32([n, k]),
        TensorMeta::new([o, k], dtype),
        TensorMeta::f32([n, o]),
    );
    let call = |i: usize| {
        let ins = [
            DeviceTensor {
                meta: &xm,
                ptr: x.device_ptr(),
                bytes: n * k * 4,
            },
            DeviceTensor {
                meta: &wm,
                ptr: ws[i % copies].device_ptr(),
                bytes: wb.len(),
            },
        ];
        let outs = [DeviceTensor {
            meta: &ym,
            ptr: y.device_ptr(),
            bytes: n * o * 4,
        }];
        Linear.cuda(gpu, &ins, &outs, Scratch::default())
    };
    call(0).expect("warm-up");
    let reps = if n <= 8 { 4 * copies.max(25) } else { 10 };
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
        .expect("capture");
    assert!(failed.is_none(), "{failed:?}");
    graph.upload().expect("graph upload");
    graph.launch().expect("replay");
    dev.synchronize().expect("sync");
    let timer = cuda::Timer::new(dev).expect("timer");
    timer.start().expect("timer");
    graph.launch().expect("replay");
    let ms = timer.stop().expect("timer") as f64;
    let us = ms * 1e3 / reps as f64;
    let bytes = (wb.len() + n * k * 4 + n * o * 4) as f64;
    (us, bytes / us / 1e3)
}

#[test]
#[ignore = "timing table at the real shapes: run on the GPU host with --ignored"]
fn linear_timings_at_the_real_shapes() {
    let Some(gpu) = test_gpu() else { return };
    println!(
        "{:<20} {:>6} {:>5} {:>10} {:>9} {:>9}",
        "linear", "type", "n", "µs", "GB/s", "TFLOP/s"
    );
    for &(name, k, o, dtype) in &SHAPES {
        for n in [1, 512] {
            let (us, gbs) = time_linear(&gpu, k, o, dtype, n);
            let tf = 2.0 * (n * k * o) as f64 / us / 1e6;
            println!(
                "{name:<20} {:>6} {n:>5} {us:>10.2} {gbs:>9.0} {tf:>9.1}",
                dtype.name()
            );
        }
    }
}
