//! CUDA parity of the hyper-connection ops (skips without a GPU, saying why), the
//! bit-reproducibility of `hc_pre`, and (ignored by default) its decode timing.

use half::bf16;
use ops::gpu::{DeviceTensor, GpuCtx, Scratch};
use ops::hc::{HcExpand, HcPost, HcPostPreNorm, HcPre, HcPreKernel, HcPreNorm, StreamMean};
use ops::parity::{HostValue, Rng, Tolerance, check, compare, run_cpu, run_gpu, test_gpu};
use ops::{DType, Op, TensorMeta};
use proptest::prelude::*;

mod support;

/// Exact: these kernels round every product and sum as the reference does.
const EXACT: Tolerance = Tolerance { rel: 0.0, abs: 0.0 };

#[test]
fn expand_mean_and_post_are_bit_identical_to_the_cpu_reference() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(32), |(
        hc in prop::sample::select(vec![1usize, 2, 3, 4, 6]), n in 1usize..6, d in 1usize..2000, seed in any::<u64>()
    )| {
        let mut r = Rng(seed | 1);
        let x = HostValue::f32([n, d], &r.vec(n * d, -1e4, 1e4));
        check(&gpu, &HcExpand { hc }, std::slice::from_ref(&x), EXACT).map_err(TestCaseError::fail)?;
        let h = HostValue::f32([n, hc, d], &r.vec(n * hc * d, -1e5, 1e5));
        check(&gpu, &StreamMean { hc }, std::slice::from_ref(&h), EXACT).map_err(TestCaseError::fail)?;
        // hc = 3 and 6 take the run-time-hc kernels; 1, 2, 4 the unrolled ones.
        let post = HostValue::f32([n, hc], &r.vec(n * hc, 0.0, 2.0));
        let comb = HostValue::f32([n, hc, hc], &r.vec(n * hc * hc, 0.0, 1.0));
        check(&gpu, &HcPost { hc }, &[x, h, post, comb], EXACT).map_err(TestCaseError::fail)?;
    });
}

struct PreCase {
    n: usize,
    hc: usize,
    d: usize,
    h: Vec<f32>,
    inputs: Vec<HostValue>,
}

impl PreCase {
    /// Streams of magnitude `h_mag`; `fn` scaled so the mixes are O(1) (f̂ has unit
    /// RMS), scales so that S2 reaches the ±30 clamp, as in the CPU tests.
    fn random(seed: u64, hc: usize, n: usize, d: usize, dtype: DType, h_mag: f32) -> PreCase {
        let mut r = Rng(seed | 1);
        let (k, w) = (2 * hc + hc * hc, hc * d);
        let a = 2.0 / (w as f32).sqrt();
        let fnw = r.vec(k * w, -a, a);
        let fn_bytes: Vec<u8> = match dtype {
            DType::BF16 => fnw
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
            _ => fnw.iter().flat_map(|v| v.to_le_bytes()).collect(),
        };
        let h = r.vec(n * w, -h_mag, h_mag);
        let inputs = vec![
            HostValue::f32([n, hc, d], &h),
            HostValue::from_bytes(TensorMeta::new([k, w], dtype), &fn_bytes),
            HostValue::f32([k], &r.vec(k, -3.0, 3.0)),
            HostValue::f32(
                [3],
                &[
                    r.uniform(-3.0, 3.0),
                    r.uniform(-3.0, 3.0),
                    r.uniform(-20.0, 20.0),
                ],
            ),
        ];
        PreCase {
            n,
            hc,
            d,
            h,
            inputs,
        }
    }

    /// CPU vs GPU, each output with its own tolerance. The mixes differ from the
    /// reference by reordered f32 dots (O(u·Σ|fn·f̂|), ~1e-6 at the real width) and by
    /// applying the RMS scale after the dot; the gates scale that by up to 20 (S2)
    /// through sigmoid/exp/Sinkhorn, so post and comb get 1e-3 relative (1e-5 absolute
    /// for entries Sinkhorn drives to ~0), and x, a pre-weighted sum of streams,
    /// 1e-4·max|H| absolute. A wrong index or a lost split moves them by O(1).
    fn check(&self, gpu: &GpuCtx, p: &HcPre) -> Result<[f32; 3], String> {
        let cpu = run_cpu(p, &self.inputs).map_err(|e| format!("cpu: {e}"))?;
        let dev = run_gpu(gpu, p, &self.inputs).map_err(|e| format!("cuda: {e}"))?;
        let hmax = self.h.iter().fold(0f32, |a, v| a.max(v.abs()));
        let tols = [
            Tolerance::new(1e-3, 1e-4 * hmax.max(1e-3)),
            Tolerance::new(1e-3, 1e-5),
            Tolerance::new(1e-3, 1e-5),
        ];
        let mut rel = [0f32; 3];
        for (i, ((m, c), (_, g))) in cpu.iter().zip(&dev).enumerate() {
            let r = compare(m, c.bytes(), g, tols[i]).map_err(|e| {
                format!(
                    "{} n={} hc={} D={}: output {i}: {e}",
                    p.describe(),
                    self.n,
                    self.hc,
                    self.d
                )
            })?;
            rel[i] = r.max_rel;
        }
        Ok(rel)
    }
}

/// The model's `hc_pre` for `hc` streams on the partial pass `kernel`.
fn pre_with(hc: usize, kernel: HcPreKernel) -> HcPre {
    HcPre {
        hc,
        sinkhorn_iters: 20,
        rms_eps: 1e-6,
        hc_eps: 1e-6,
        clamp: 30.0,
        kernel,
    }
}

/// [`pre_with`] on the partial pass a plan of `n` tokens of streams `d` wide and an `fn` of
/// `fn_dtype` would carry (the rows pass from 64 tokens where it applies, split-K otherwise).
fn pre_op(hc: usize, n: usize, d: usize, fn_dtype: DType) -> HcPre {
    let p = pre_with(hc, HcPreKernel::SplitK);
    HcPre {
        kernel: support::hc_pre_for(&p, n, d, fn_dtype),
        ..p
    }
}

#[test]
fn hc_pre_matches_the_cpu_reference_on_random_shapes() {
    let Some(gpu) = test_gpu() else { return };
    // hc = 6 (36 > 32 Sinkhorn entries) takes the block-wide chain, the others the one-warp one.
    proptest!(ProptestConfig::with_cases(48), |(
        hc in prop::sample::select(vec![1usize, 2, 3, 4, 6]),
        // Widths that are and are not whole 8-value groups (the two partial kernels).
        d in prop_oneof![1usize..300, (1usize..64).prop_map(|v| v * 8)],
        n in 1usize..20,
        bf in any::<bool>(),
        mag_exp in 0i32..5,
        iters in prop::sample::select(vec![0usize, 1, 20]),
        hc_eps in prop::sample::select(vec![1e-6f32, 0.05]),
        clamp in prop::sample::select(vec![30f32, 4.0]),
        seed in any::<u64>(),
    )| {
        let dtype = if bf { DType::BF16 } else { DType::F32 };
        let c = PreCase::random(seed, hc, n, d, dtype, 10f32.powi(mag_exp));
        let p = HcPre { sinkhorn_iters: iters, hc_eps, clamp, ..pre_op(hc, n, d, dtype) };
        c.check(&gpu, &p).map_err(TestCaseError::fail)?;
    });
}

#[test]
fn hc_pre_matches_the_cpu_reference_at_the_real_width() {
    let Some(gpu) = test_gpu() else { return };
    for (n, dtype) in [(1, DType::BF16), (9, DType::BF16), (2, DType::F32)] {
        let c = PreCase::random(40 + n as u64, 4, n, 3584, dtype, 30.0);
        let rel = c
            .check(&gpu, &pre_op(4, n, 3584, dtype))
            .unwrap_or_else(|e| panic!("{e}"));
        println!(
            "hc_pre hc=4 D=3584 {dtype} n={n}: max rel x {:.2e}, post {:.2e}, comb {:.2e}",
            rel[0], rel[1], rel[2]
        );
    }
}

/// The fused norm changes only x: the tolerances are `PreCase::check`'s, with x's absolute
/// part scaled by the norm (x/rms(x)·w is O(|w|) where x was O(max|H|)).
#[test]
fn hc_pre_norm_matches_hc_pre_then_rms_norm_fused_or_not() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(40), |(
        hc in prop::sample::select(vec![1usize, 2, 3, 4]),
        // Whole float4 rows up to 4096 take the fused kernel; other widths and wider rows
        // the separate norm launch.
        d in prop_oneof![1usize..300, (1usize..1024).prop_map(|v| v * 4), 4097usize..4400],
        n in 1usize..5,
        seed in any::<u64>(),
    )| {
        let c = PreCase::random(seed, hc, n, d, DType::BF16, 20.0);
        let mut r = Rng(seed ^ 0x5eed);
        let w = r.vec(d, -2.0, 2.0);
        let wmax = w.iter().fold(0f32, |a, v| a.max(v.abs()));
        let mut inputs = c.inputs.clone();
        inputs.push(HostValue::f32([d], &w));
        let op = HcPreNorm { pre: pre_op(hc, n, d, DType::BF16), norm_eps: 1e-6 };
        let cpu = run_cpu(&op, &inputs).map_err(|e| TestCaseError::fail(format!("cpu: {e}")))?;
        let dev = run_gpu(&gpu, &op, &inputs).map_err(|e| TestCaseError::fail(format!("cuda: {e}")))?;
        let tols = [
            Tolerance::new(1e-3, 1e-3 * wmax.max(1e-3)),
            Tolerance::new(1e-3, 1e-5),
            Tolerance::new(1e-3, 1e-5),
        ];
        for (i, ((m, cv), (_, g))) in cpu.iter().zip(&dev).enumerate() {
            compare(m, cv.bytes(), g, tols[i]).map_err(|e| {
                TestCaseError::fail(format!("hc={hc} n={n} D={d}: output {i}: {e}"))
            })?;
        }
    });
}

/// The fused exit-and-entry: H' must carry hc_post's exact bits (the partial pass forms it in
/// hc_post's rounding order); x, post and comb as `hc_pre_norm`'s test.
#[test]
fn hc_post_pre_norm_gives_hc_posts_bits_and_hc_pre_norms_outputs() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(40), |(
        hc in prop::sample::select(vec![1usize, 2, 3, 4]),
        // Rows of whole 8-value groups take the fused partial kernel, others hc_post first.
        d in prop_oneof![1usize..300, (1usize..512).prop_map(|v| v * 8)],
        n in 1usize..12,
        seed in any::<u64>(),
    )| {
        post_pre_norm_case(&gpu, hc, n, d, seed).map_err(TestCaseError::fail)?;
    });
}

#[test]
fn hc_post_pre_norm_matches_at_the_real_width() {
    let Some(gpu) = test_gpu() else { return };
    for n in [1, 9, 40] {
        post_pre_norm_case(&gpu, 4, n, 3584, n as u64).unwrap_or_else(|e| panic!("{e}"));
    }
}

fn post_pre_norm_case(
    gpu: &GpuCtx,
    hc: usize,
    n: usize,
    d: usize,
    seed: u64,
) -> Result<(), String> {
    let c = PreCase::random(seed, hc, n, d, DType::BF16, 20.0);
    let mut r = Rng(seed ^ 0xfeed);
    let w = r.vec(d, -2.0, 2.0);
    let wmax = w.iter().fold(0f32, |a, v| a.max(v.abs()));
    let mut inputs = vec![
        HostValue::f32([n, d], &r.vec(n * d, -20.0, 20.0)),
        c.inputs[0].clone(),
        HostValue::f32([n, hc], &r.vec(n * hc, 0.0, 2.0)),
        HostValue::f32([n, hc, hc], &r.vec(n * hc * hc, 0.0, 1.0)),
    ];
    inputs.extend(c.inputs[1..].iter().cloned());
    inputs.push(HostValue::f32([d], &w));
    let op = HcPostPreNorm {
        post: HcPost { hc },
        pre_norm: HcPreNorm {
            pre: pre_op(hc, n, d, DType::BF16),
            norm_eps: 1e-6,
        },
    };
    let cpu = run_cpu(&op, &inputs).map_err(|e| format!("cpu: {e}"))?;
    let dev = run_gpu(gpu, &op, &inputs).map_err(|e| format!("cuda: {e}"))?;
    let tols = [
        EXACT,
        Tolerance::new(1e-3, 1e-3 * wmax.max(1e-3)),
        Tolerance::new(1e-3, 1e-5),
        Tolerance::new(1e-3, 1e-5),
    ];
    for (i, ((m, cv), (_, g))) in cpu.iter().zip(&dev).enumerate() {
        compare(m, cv.bytes(), g, tols[i])
            .map_err(|e| format!("hc={hc} n={n} D={d}: output {i}: {e}"))?;
    }
    Ok(())
}

#[test]
fn hc_pre_gives_the_same_bits_on_every_run() {
    let Some(gpu) = test_gpu() else { return };
    for n in [1, 12, 100] {
        let c = PreCase::random(7 + n as u64, 4, n, 3584, DType::BF16, 5.0);
        let op = pre_op(4, n, 3584, DType::BF16);
        let a = run_gpu(&gpu, &op, &c.inputs).expect("first run");
        let b = run_gpu(&gpu, &op, &c.inputs).expect("second run");
        for (i, ((_, x), (_, y))) in a.iter().zip(&b).enumerate() {
            assert!(x == y, "n={n}: output {i} differs between runs");
        }
    }
}

#[test]
#[ignore = "timing at the real shape: run on the GPU host with --ignored"]
fn hc_pre_timing_at_the_real_shape() {
    let Some(gpu) = test_gpu() else { return };
    // 20 iterations is the model; 0 leaves the Sinkhorn chain out, so the difference is its cost.
    for iters in [20, 0] {
        time_hc_pre(
            &gpu,
            &HcPre {
                sinkhorn_iters: iters,
                ..pre_op(4, 1, 3584, DType::BF16)
            },
        );
    }
}

fn time_hc_pre(gpu: &GpuCtx, p: &HcPre) {
    let dev = &gpu.device;
    let (hc, d, n) = (4, 3584, 1);
    let c = PreCase::random(3, hc, n, d, DType::BF16, 3.0);
    // 80 copies of fn (55 MB), as a decode step reads 80 different ones.
    let copies = 80;
    let fns: Vec<_> = (0..copies)
        .map(|_| dev.upload(c.inputs[1].data.bytes()).expect("upload"))
        .collect();
    let ins: Vec<_> = c
        .inputs
        .iter()
        .map(|v| dev.upload(v.data.bytes()).expect("upload"))
        .collect();
    let metas: Vec<&TensorMeta> = c.inputs.iter().map(|v| &v.meta).collect();
    let outs_m = p.infer(&metas).expect("shapes");
    let outs: Vec<_> = outs_m
        .iter()
        .map(|m| {
            dev.upload(&vec![0u8; m.bytes().expect("bytes")])
                .expect("upload")
        })
        .collect();
    let sb = p.cuda_scratch_bytes(&metas);
    let scratch = dev.upload(&vec![0u8; sb]).expect("upload");
    let call = |i: usize| {
        let iv: Vec<DeviceTensor<'_>> = c
            .inputs
            .iter()
            .enumerate()
            .map(|(j, v)| DeviceTensor {
                meta: &v.meta,
                ptr: if j == 1 {
                    fns[i % copies].device_ptr()
                } else {
                    ins[j].device_ptr()
                },
                bytes: v.data.len(),
            })
            .collect();
        let ov: Vec<DeviceTensor<'_>> = outs_m
            .iter()
            .zip(&outs)
            .map(|(m, b)| DeviceTensor {
                meta: m,
                ptr: b.device_ptr(),
                bytes: b.num_bytes(),
            })
            .collect();
        p.cuda(
            gpu,
            &iv,
            &ov,
            Scratch {
                ptr: scratch.device_ptr(),
                bytes: sb,
            },
        )
    };
    call(0).expect("warm-up");
    let reps = 4 * copies;
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
    let us = timer.stop().expect("timer") as f64 * 1e3 / reps as f64;
    let bytes = (c.inputs[1].data.len() + 2 * n * hc * d * 4 + n * d * 4) as f64;
    println!(
        "hc_pre hc=4 D=3584 BF16 n=1 iters={}: {us:.2} µs per call (2 kernels, graph-replayed), {:.0} GB/s",
        p.sinkhorn_iters,
        bytes / us / 1e3
    );
}

/// From 64 tokens the lowering gives hc = 4 with D a multiple of 32 the tensor-core partial
/// pass (`HcPreKernel::Rows`: `hc_pre_rows`, fused with hc_post or not): H' keeps hc_post's
/// bits, x/post/comb the split-K pass's tolerances (the mixes are tf32 hi+lo products, 22 of
/// H's 24 bits, f32 sums).
#[test]
fn the_tensor_core_partial_pass_matches_the_cpu_reference() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(24), |(
        d in (1usize..48).prop_map(|v| v * 32),
        n in 64usize..150,
        fused in any::<bool>(),
        mag_exp in 0i32..4,
        seed in any::<u64>(),
    )| {
        if fused {
            post_pre_norm_case(&gpu, 4, n, d, seed).map_err(TestCaseError::fail)?;
        } else {
            let c = PreCase::random(seed, 4, n, d, DType::BF16, 10f32.powi(mag_exp));
            c.check(&gpu, &pre_op(4, n, d, DType::BF16)).map_err(TestCaseError::fail)?;
        }
    });
}

#[test]
fn the_tensor_core_partial_pass_matches_at_the_real_width() {
    let Some(gpu) = test_gpu() else { return };
    for n in [64, 333] {
        post_pre_norm_case(&gpu, 4, n, 3584, n as u64).unwrap_or_else(|e| panic!("{e}"));
        let c = PreCase::random(90 + n as u64, 4, n, 3584, DType::BF16, 30.0);
        // The lowering's rows pass, and the split-K pass it falls back to when the rows pass
        // is turned off (`hc_rows_chunks_per_warp = 0`), on the same tokens.
        for p in [
            pre_op(4, n, 3584, DType::BF16),
            pre_with(4, HcPreKernel::SplitK),
        ] {
            let rel = c.check(&gpu, &p).unwrap_or_else(|e| panic!("{e}"));
            println!(
                "{} D=3584 n={n}: max rel x {:.2e}, post {:.2e}, comb {:.2e}",
                p.describe(),
                rel[0],
                rel[1],
                rel[2]
            );
        }
    }
}

#[test]
#[ignore = "timing at the real shape: run on the GPU host with --ignored"]
fn hc_boundary_timing_for_prefill_chunks() {
    let Some(gpu) = test_gpu() else { return };
    println!("| tokens | partial pass | µs per boundary | GB/s (H, y, H', x) |");
    println!("| ---: | --- | ---: | ---: |");
    for n in [64, 256, 1024, 2048] {
        for kernel in [
            HcPreKernel::SplitK,
            HcPreKernel::Rows { chunks_per_warp: 1 },
            HcPreKernel::Rows { chunks_per_warp: 2 },
        ] {
            let us = time_boundary(&gpu, n, kernel);
            let bytes = (n * 3584 * 4 * (4 + 1 + 4 + 1)) as f64;
            let path = match kernel {
                HcPreKernel::Rows { chunks_per_warp } => {
                    format!("rows, {chunks_per_warp} chunk(s) a warp")
                }
                _ => "split-K (CUDA cores)".to_string(),
            };
            println!("| {n} | {path} | {us:.1} | {:.0} |", bytes / us / 1e3);
        }
    }
}

/// One `hc_post_pre_norm` at the real width over `n` tokens on the partial pass `kernel`,
/// graph-replayed.
fn time_boundary(gpu: &GpuCtx, n: usize, kernel: HcPreKernel) -> f64 {
    let dev = &gpu.device;
    let (hc, d) = (4, 3584);
    let c = PreCase::random(5, hc, n, d, DType::BF16, 3.0);
    let mut r = Rng(77);
    let mut inputs = vec![
        HostValue::f32([n, d], &r.vec(n * d, -2.0, 2.0)),
        c.inputs[0].clone(),
        HostValue::f32([n, hc], &r.vec(n * hc, 0.0, 2.0)),
        HostValue::f32([n, hc, hc], &r.vec(n * hc * hc, 0.0, 1.0)),
    ];
    inputs.extend(c.inputs[1..].iter().cloned());
    inputs.push(HostValue::f32([d], &r.vec(d, -2.0, 2.0)));
    let op = HcPostPreNorm {
        post: HcPost { hc },
        pre_norm: HcPreNorm {
            pre: pre_with(hc, kernel),
            norm_eps: 1e-6,
        },
    };
    let ins: Vec<_> = inputs
        .iter()
        .map(|v| dev.upload(v.data.bytes()).expect("upload"))
        .collect();
    let metas: Vec<&TensorMeta> = inputs.iter().map(|v| &v.meta).collect();
    let outs_m = op.infer(&metas).expect("shapes");
    let outs: Vec<_> = outs_m
        .iter()
        .map(|m| {
            dev.upload(&vec![0u8; m.bytes().expect("bytes")])
                .expect("upload")
        })
        .collect();
    let sb = op.cuda_scratch_bytes(&metas);
    let scratch = dev.upload(&vec![0u8; sb.max(4)]).expect("upload");
    let call = |_: usize| {
        let iv: Vec<DeviceTensor<'_>> = inputs
            .iter()
            .zip(&ins)
            .map(|(v, b)| DeviceTensor {
                meta: &v.meta,
                ptr: b.device_ptr(),
                bytes: v.data.len(),
            })
            .collect();
        let ov: Vec<DeviceTensor<'_>> = outs_m
            .iter()
            .zip(&outs)
            .map(|(m, b)| DeviceTensor {
                meta: m,
                ptr: b.device_ptr(),
                bytes: b.num_bytes(),
            })
            .collect();
        op.cuda(
            gpu,
            &iv,
            &ov,
            Scratch {
                ptr: scratch.device_ptr(),
                bytes: sb,
            },
        )
    };
    ops::parity::time_calls_us(gpu, 20, &call).expect("timing")
}
