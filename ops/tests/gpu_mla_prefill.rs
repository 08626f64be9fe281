//! CUDA parity of the tensor-core prefill attention (`launch_mla_prefill`) against
//! `MlaAttention`'s CPU reference, over one sequence's cache and over a chunk's sequence whose
//! blocks are shuffled in a paged pool among others'; skips without a GPU, saying why. The timing table at the real
//! Xing4.0 shapes (against the split kernel, `AttentionPath::SplitK`, which the graph's lowering
//! chooses below 256 tokens or where `MlaAttention::flash_supports` refuses the width) is
//! ignored: run it on the GPU host with `--include-ignored`.
//!
//! Tolerance. The kernel rounds Q, the cache rows and the softmax weights to f16 (2^-11
//! relative), so its error is a few f16 units of the *value scale*, not of each output element:
//! an output that averages values of ±1 to nearly 0 still carries their rounding. A host model
//! of the three roundings at the real width (576/512, kq_scale 0.1447, values U(−1, 1)) gave up
//! to 2.4e-4 from V alone (half an f16 ulp of values near 1, already past F16's abs 1e-4) and
//! ~5e-4 with the scores' rounding (a score over 576 dims moves by ~√576·2^-12·|q||k|·scale)
//! and the weights'; a host emulation of the kernel itself (its fragments and roundings) on 18
//! random shapes peaked at 6.7e-4. [`PREFILL_TOL`] keeps F16's rel 4e-3 and allows abs 1.5e-3,
//! three f16 ulps of values just under 1 and over twice that peak; the reports print margins.

use cuda::DeviceBuffer;
use ops::gpu::{DeviceTensor, GpuCtx, Scratch};
use ops::mla::{
    AttentionKernel, AttentionPath, DevicePages, MlaAttention, Pages, SplitProducts, attention_tile,
};
use ops::mla_prefill::{launch_mla_prefill, mla_prefill_scratch_bytes};
use ops::parity::{HostValue, Rng, Tolerance, check, compare, run_cpu, run_gpu, test_gpu};
use ops::tensor::{HostTensor, HostTensorMut};
use ops::{DType, Op, OpError, TensorMeta};
use proptest::prelude::*;

mod support;
use support::PagedPool;

const PREFILL_TOL: Tolerance = Tolerance {
    rel: 4e-3,
    abs: 1.5e-3,
};

/// The model's softmax scale (1/√192 with the YaRN magnitude), as the engine passes it.
const KQ_SCALE: f32 = 0.144_679_63;

/// Positions of a cache block (the engine's).
const BLOCK: usize = 64;

/// The positions a step's block table reaches (inputs 3, the table, and the op's block size):
/// the cache's extent for the kernels.
fn table_reach(att: &MlaAttention, table: &TensorMeta) -> usize {
    table.shape.get(1).copied().unwrap_or(0) * att.block_size
}

/// The split kernel whatever the token count and whatever `att.kernel` says (a lowered plan
/// gives 256 tokens and more `AttentionPath::Flash`, the prefill kernel), with its default
/// tile and correction terms.
fn split_kernel(
    att: &MlaAttention,
    gpu: &GpuCtx,
    inputs: &[DeviceTensor<'_>],
    outputs: &[DeviceTensor<'_>],
    scratch: Scratch,
) -> Result<(), OpError> {
    let n = inputs[2].meta.shape[0];
    let rows = table_reach(att, inputs[3].meta);
    let kernel = AttentionKernel {
        tile: attention_tile(n, rows, att.n_head),
        products: SplitProducts::Bf16Corrections,
    };
    att.cuda_with(gpu, inputs, outputs, scratch, kernel)
}

/// [`MlaAttention`] on the split kernel at any token count, for the comparisons below.
#[derive(Debug)]
struct Split(MlaAttention);

impl Op for Split {
    fn name(&self) -> &'static str {
        "mla_attention_split"
    }
    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        self.0.infer(inputs)
    }
    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.0.cpu(inputs, outputs)
    }
    fn describe(&self) -> String {
        format!("{} (split kernel)", self.0.describe())
    }
    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        split_kernel(&self.0, ctx, inputs, outputs, scratch)
    }
    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        self.0.cuda_scratch_bytes(inputs)
    }
}

/// The prefill kernel behind the `Op` interface, so the parity harness can run it: the CPU side
/// is `MlaAttention`'s reference, which refuses a position outside the block table's reach; for
/// those tokens it gives the kernel's documented answer, zeros, and runs the reference on the
/// others.
#[derive(Debug)]
struct Prefill(MlaAttention);

impl Op for Prefill {
    fn name(&self) -> &'static str {
        "mla_prefill"
    }

    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        self.0.infer(inputs)
    }

    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        let (rows, w) = (table_reach(&self.0, inputs[3].meta), inputs[1].meta.inner());
        let pos = inputs[2].i32()?;
        let valid: Vec<usize> = (0..pos.len())
            .filter(|&t| pos[t] >= 0 && (pos[t] as usize) < rows)
            .collect();
        if valid.len() == pos.len() {
            return self.0.cpu(inputs, outputs);
        }
        let (nh, lora) = (self.0.n_head, self.0.kv_lora);
        let q = inputs[0].f32()?;
        let qv: Vec<f32> = valid
            .iter()
            .flat_map(|&t| q[t * nh * w..(t + 1) * nh * w].iter().copied())
            .collect();
        let pv: Vec<i32> = valid.iter().map(|&t| pos[t]).collect();
        let row_seq = inputs[4].i32()?;
        let sv: Vec<i32> = valid.iter().map(|&t| row_seq[t]).collect();
        let pages = Pages {
            block_table: inputs[3].i32()?,
            width: inputs[3].meta.shape[1],
            row_seq: &sv,
            block_size: self.0.block_size,
        };
        let mut ov = vec![0f32; valid.len() * nh * lora];
        self.0
            .compute(&qv, inputs[1].f32()?, w, &pv, pages, &mut ov)?;
        let out = outputs[0].f32_mut()?;
        out.fill(0.0);
        let tok = nh * lora;
        for (k, &t) in valid.iter().enumerate() {
            out[t * tok..(t + 1) * tok].copy_from_slice(&ov[k * tok..(k + 1) * tok]);
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!(
            "mla_prefill n_head={} kv_lora={} kq_scale={:?}",
            self.0.n_head, self.0.kv_lora, self.0.kq_scale
        )
    }

    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        let metas: Vec<&TensorMeta> = inputs.iter().map(|t| t.meta).collect();
        let want = self.infer(&metas)?;
        assert_eq!(outputs[0].meta, &want[0]);
        let (n, rows, w) = (
            inputs[2].meta.shape[0],
            table_reach(&self.0, inputs[3].meta),
            inputs[1].meta.shape[1],
        );
        let pages = DevicePages {
            block_table: inputs[3].ptr,
            row_seq: inputs[4].ptr,
            table_width: inputs[3].meta.shape[1],
            block_size: self.0.block_size,
        };
        // SAFETY: the harness allocated every view with the bytes its metadata needs, the output
        // and scratch apart from the inputs, and synchronizes before freeing them.
        unsafe {
            launch_mla_prefill(
                ctx,
                inputs[0].ptr,
                inputs[1].ptr,
                inputs[1].meta.dtype,
                inputs[2].ptr,
                pages,
                outputs[0].ptr,
                n,
                self.0.n_head,
                w,
                self.0.kv_lora,
                rows,
                self.0.kq_scale,
                scratch,
            )
        }
    }

    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        match (inputs.get(1), inputs.get(2), inputs.get(3)) {
            (Some(c), Some(p), Some(t)) => mla_prefill_scratch_bytes(
                p.shape[0],
                self.0.n_head,
                table_reach(&self.0, t),
                c.inner(),
                self.0.kv_lora,
            ),
            _ => 0,
        }
    }
}

/// The attention whose reference the kernels are held to, its own CUDA path the split kernel
/// (the wrappers above launch the kernel under test themselves).
fn attention(n_head: usize, kv_lora: usize) -> MlaAttention {
    MlaAttention {
        n_head,
        kv_lora,
        kq_scale: KQ_SCALE,
        block_size: BLOCK,
        kernel: AttentionPath::SplitK,
    }
}

/// One sequence over a cache of `ctx` rows (a whole number of blocks of `block`, in order): Q,
/// the cache of U(−1, 1) whose rows past the largest valid position are NaN (so a read past it
/// shows), the positions, the identity block table `[1, ctx / block]` and the row map (all
/// sequence 0).
fn inputs(seed: u64, nh: usize, w: usize, ctx: usize, block: usize, pos: &[i32]) -> Vec<HostValue> {
    assert!(ctx.is_multiple_of(block), "{ctx} rows in blocks of {block}");
    let mut r = Rng::new(seed);
    let n = pos.len();
    let last = pos
        .iter()
        .filter(|&&p| p >= 0 && (p as usize) < ctx)
        .max()
        .map_or(0, |&p| p as usize + 1);
    let mut cache = r.vec(ctx * w, -1.0, 1.0);
    for v in cache.iter_mut().skip(last * w) {
        *v = f32::NAN;
    }
    let blocks = ctx / block;
    vec![
        HostValue::f32([n, nh, w], &r.vec(n * nh * w, -1.0, 1.0)),
        HostValue::f32([ctx, w], &cache),
        HostValue::i32([n], pos),
        HostValue::i32([1, blocks], &(0..blocks as i32).collect::<Vec<_>>()),
        HostValue::i32([n], &vec![0; n]),
    ]
}

fn consecutive(first: i32, n: usize) -> Vec<i32> {
    (0..n as i32).map(|i| first + i).collect()
}

#[test]
fn prefill_attention_matches_the_cpu_reference_on_random_shapes() {
    let Some(gpu) = test_gpu() else { return };
    // Consecutive positions from a random start (below 0 or running past the cache: those tokens
    // get zeros), now and then one replaced by a position outside the cache; cache blocks of 1
    // to 64 rows, the cache a whole number of them.
    proptest!(ProptestConfig::with_cases(32), |(
        nh in 1usize..41, lora64 in 1usize..9, n in 1usize..71, ctx in 1usize..601,
        bshift in 0usize..7, start in 0usize..10_000, stray in 0usize..3, seed in any::<u64>(),
    )| {
        let (lora, w, block) = (64 * lora64, 64 * lora64 + 64, 1 << bshift);
        let ctx = ctx.next_multiple_of(block);
        let mut r = Rng::new(seed ^ 0x9e37);
        let first = (start % (ctx + 8)) as i32 - 8;
        let pos: Vec<i32> = consecutive(first, n)
            .into_iter()
            .map(|p| match (stray, r.below(8)) {
                (1, 0) => -1 - r.below(4) as i32,
                (2, 0) => (ctx + r.below(4)) as i32,
                _ => p,
            })
            .collect();
        let ins = inputs(seed, nh, w, ctx, block, &pos);
        let att = MlaAttention { block_size: block, ..attention(nh, lora) };
        check(&gpu, &Prefill(att), &ins, PREFILL_TOL).map_err(TestCaseError::fail)?;
    });
}

#[test]
fn prefill_attention_over_shuffled_blocks_equals_attention_over_the_sequence_s_contiguous_copy() {
    let Some(gpu) = test_gpu() else { return };
    // A chunk of one sequence among up to 4 whose blocks (1 to 64 rows) are handed out in a
    // shuffled order, every pool row no sequence holds NaN (the kernel's narrowing would turn
    // one finite: the reference, over the sequence's own contiguous cache, shows it). Held to
    // that reference, and to the bits of the same blocks in their natural order.
    proptest!(ProptestConfig::with_cases(24), |(
        lens in prop::collection::vec(1usize..600, 1..5), pick in any::<prop::sample::Index>(),
        nh in 1usize..41, lora64 in 1usize..9, n in 1usize..71, bshift in 0usize..7,
        extra_width in 0usize..3, at in any::<prop::sample::Index>(), seed in any::<u64>(),
    )| {
        let (lora, w, block) = (64 * lora64, 64 * lora64 + 64, 1 << bshift);
        let att = MlaAttention { block_size: block, ..attention(nh, lora) };
        let mut r = Rng::new(seed ^ 0x5eed);
        let shuffled = PagedPool::new(&mut r, &lens, block, extra_width, true);
        let in_order = PagedPool::new(&mut r, &lens, block, extra_width, false);
        let seqs: Vec<Vec<f32>> = lens.iter().map(|&l| r.vec(l * w, -1.0, 1.0)).collect();
        // The chunk: consecutive positions of sequence `s`, all below its length.
        let s = pick.index(lens.len());
        let n = n.min(lens[s]);
        let first = at.index(lens[s] - n + 1) as i32;
        let pos = consecutive(first, n);
        let q = r.vec(n * nh * w, -1.0, 1.0);
        let paged = |pool: &PagedPool| {
            vec![
                HostValue::f32([n, nh, w], &q),
                HostValue::f32([pool.pool_rows(), w], &pool.scatter(&seqs, w)),
                HostValue::i32([n], &pos),
                HostValue::i32([pool.seqs(), pool.width], &pool.table),
                HostValue::i32([n], &vec![s as i32; n]),
            ]
        };
        let alone = vec![
            HostValue::f32([n, nh, w], &q),
            HostValue::f32([shuffled.reach(), w], &shuffled.contiguous(&seqs[s], w)),
            HostValue::i32([n], &pos),
            HostValue::i32([1, shuffled.width], &shuffled.contiguous_table()),
            HostValue::i32([n], &vec![0; n]),
        ];
        let op = Prefill(att);
        let want = run_cpu(&op, &alone).map_err(|e| TestCaseError::fail(format!("cpu: {e}")))?;
        let got = run_gpu(&gpu, &op, &paged(&shuffled))
            .map_err(|e| TestCaseError::fail(format!("shuffled: {e}")))?;
        compare(&want[0].0, want[0].1.bytes(), &got[0].1, PREFILL_TOL)
            .map_err(|e| TestCaseError::fail(format!("lens={lens:?} s={s} pos={first}..: {e}")))?;
        let nat = run_gpu(&gpu, &op, &paged(&in_order))
            .map_err(|e| TestCaseError::fail(format!("in order: {e}")))?;
        prop_assert!(
            got[0].1 == nat[0].1,
            "lens={:?} s={} pos={}..: the shuffled pool gives other bits than the blocks in order",
            lens, s, first
        );
    });
}

#[test]
fn prefill_attention_at_the_real_shapes_matches_the_cpu_reference() {
    let Some(gpu) = test_gpu() else { return };
    let op = Prefill(attention(32, 512));
    // A 64-token chunk at the start of the cache and at the end of a 1024-row bucket.
    for first in [0, 960] {
        let ins = inputs(
            first as u64 + 5,
            32,
            576,
            1024,
            BLOCK,
            &consecutive(first, 64),
        );
        let cpu = run_cpu(&op, &ins).expect("cpu");
        let gpu_out = run_gpu(&gpu, &op, &ins).expect("gpu");
        let (meta, want, got) = (&cpu[0].0, cpu[0].1.bytes(), &gpu_out[0].1);
        let r =
            compare(meta, want, got, PREFILL_TOL).unwrap_or_else(|e| panic!("pos={first}..: {e}"));
        let f16_ok = compare(meta, want, got, Tolerance::F16).is_ok();
        eprintln!(
            "parity mla_prefill n=64 pos={first}.. bucket=1024: {r} (within Tolerance::F16: {f16_ok})"
        );
    }
}

#[test]
fn prefill_attention_gives_the_same_bits_on_every_run() {
    let Some(gpu) = test_gpu() else { return };
    // A 300-row cache in blocks of 4 (the engine's 64 would not divide it).
    for (nh, n, ctx, block, first) in [(32, 64, 1024, BLOCK, 900), (40, 19, 300, 4, 250)] {
        let op = Prefill(MlaAttention {
            block_size: block,
            ..attention(nh, 512)
        });
        let ins = inputs(9, nh, 576, ctx, block, &consecutive(first, n));
        let a = run_gpu(&gpu, &op, &ins).expect("first run");
        let b = run_gpu(&gpu, &op, &ins).expect("second run");
        assert!(a[0].1 == b[0].1, "nh={nh} n={n}: two runs differ");
    }
}

/// A whole 512-token chunk, where the CPU reference is too slow: against the split kernel,
/// which computes in f32-class 3xTF32 (its own parity tests hold it to 3e-5 of the reference).
#[test]
fn a_512_token_chunk_matches_the_split_kernel() {
    let Some(gpu) = test_gpu() else { return };
    let att = attention(32, 512);
    for (first, bucket) in [(3584, 4096), (0, 512)] {
        let ins = inputs(17, 32, 576, bucket, BLOCK, &consecutive(first, 512));
        let new = run_gpu(&gpu, &Prefill(att.clone()), &ins).expect("prefill kernel");
        let old = run_gpu(&gpu, &Split(att.clone()), &ins).expect("split kernel");
        let r = compare(&old[0].0, &old[0].1, &new[0].1, PREFILL_TOL)
            .unwrap_or_else(|e| panic!("pos={first}.. bucket={bucket}: {e}"));
        // The op on the kernel the lowering gives a 512-token chunk (the flash kernel) is the
        // prefill kernel, bit for bit.
        let lowered = MlaAttention {
            kernel: support::attention_for(&att, 512, 576),
            ..att.clone()
        };
        assert_eq!(lowered.kernel, AttentionPath::Flash);
        let op = run_gpu(&gpu, &lowered, &ins).expect("the op on the flash kernel");
        assert!(
            op[0].1 == new[0].1,
            "pos={first}.. bucket={bucket}: the op's flash path differs from the prefill kernel"
        );
        eprintln!("mla_prefill vs split kernel, 512 tokens pos={first}.. bucket={bucket}: {r}");
    }
}

#[test]
fn shapes_the_kernel_does_not_cover_are_refused_before_any_launch() {
    let Some(gpu) = test_gpu() else { return };
    // Rope of 32 instead of 64: a shape error naming the op.
    let ins = inputs(1, 4, 96, 64, BLOCK, &[3]);
    let e = run_gpu(&gpu, &Prefill(attention(4, 64)), &ins).unwrap_err();
    assert!(
        matches!(
            e,
            OpError::Shape {
                op: "mla_prefill",
                ..
            }
        ),
        "{e}"
    );
    // The op asked for the flash kernel at that width refuses it too, naming itself.
    let flash = MlaAttention {
        kernel: AttentionPath::Flash,
        ..attention(4, 64)
    };
    assert!(!flash.flash_supports(96));
    let e = run_gpu(&gpu, &flash, &ins).unwrap_err();
    assert!(
        matches!(
            e,
            OpError::Shape {
                op: "mla_attention",
                ..
            }
        ),
        "{e}"
    );
}

// ---- timings ----------------------------------------------------------------------------

fn upload(gpu: &GpuCtx, bytes: &[u8]) -> DeviceBuffer<u8> {
    gpu.device.upload(bytes).expect("upload")
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// One 512-token chunk at positions `first..first+512` over a bucket of `bucket` rows, the new
/// kernel and the split kernel, each over several cache copies (the rows come from HBM, as
/// across layers).
fn time_chunk(gpu: &GpuCtx, first: usize, bucket: usize) {
    let (n, nh, w, lora) = (512usize, 32usize, 576usize, 512usize);
    let att = attention(nh, lora);
    let copies = (150usize << 20).div_ceil(bucket * w * 4).clamp(2, 8);
    let mut r = Rng::new(31);
    let layer = f32_bytes(&r.vec(bucket * w, -1.0, 1.0));
    let caches: Vec<_> = (0..copies).map(|_| upload(gpu, &layer)).collect();
    let q = upload(gpu, &f32_bytes(&r.vec(n * nh * w, -1.0, 1.0)));
    let pos: Vec<u8> = consecutive(first as i32, n)
        .iter()
        .flat_map(|p| p.to_le_bytes())
        .collect();
    let pb = upload(gpu, &pos);
    // One sequence over the bucket, its blocks in order.
    let blocks = bucket / BLOCK;
    let table: Vec<u8> = (0..blocks as i32).flat_map(|b| b.to_le_bytes()).collect();
    let tb = upload(gpu, &table);
    let rb = upload(gpu, &vec![0u8; n * 4]);
    let pages = DevicePages {
        block_table: tb.device_ptr(),
        row_seq: rb.device_ptr(),
        table_width: blocks,
        block_size: BLOCK,
    };
    let out = upload(gpu, &vec![0u8; n * nh * lora * 4]);
    let (qm, cm, pm, tm, rm, om) = (
        TensorMeta::f32([n, nh, w]),
        TensorMeta::f32([bucket, w]),
        TensorMeta::i32([n]),
        TensorMeta::i32([1, blocks]),
        TensorMeta::i32([n]),
        TensorMeta::f32([n, nh, lora]),
    );
    let new_bytes = mla_prefill_scratch_bytes(n, nh, bucket, w, lora);
    let old_bytes = att.cuda_scratch_bytes(&[&qm, &cm, &pm, &tm, &rm]);
    let scratch = upload(gpu, &vec![0u8; new_bytes.max(old_bytes).max(16)]);
    let view = |meta, b: &DeviceBuffer<u8>| DeviceTensor {
        meta,
        ptr: b.device_ptr(),
        bytes: b.num_bytes(),
    };
    let new = |i: usize| {
        // SAFETY: every buffer above is allocated with the bytes its shape needs and outlives
        // the timing (time_calls synchronizes).
        unsafe {
            launch_mla_prefill(
                gpu,
                q.device_ptr(),
                caches[i % copies].device_ptr(),
                DType::F32,
                pb.device_ptr(),
                pages,
                out.device_ptr(),
                n,
                nh,
                w,
                lora,
                bucket,
                KQ_SCALE,
                Scratch {
                    ptr: scratch.device_ptr(),
                    bytes: new_bytes,
                },
            )
        }
    };
    let old = |i: usize| {
        split_kernel(
            &att,
            gpu,
            &[
                view(&qm, &q),
                view(&cm, &caches[i % copies]),
                view(&pm, &pb),
                view(&tm, &tb),
                view(&rm, &rb),
            ],
            &[view(&om, &out)],
            Scratch {
                ptr: scratch.device_ptr(),
                bytes: old_bytes,
            },
        )
    };
    let flops: f64 = (0..n)
        .map(|i| 2.0 * nh as f64 * (first + i + 1) as f64 * (w + lora) as f64)
        .sum();
    let ms_new = time_ms(gpu, copies, &new);
    let ms_old = time_ms(gpu, copies, &old);
    for (what, ms) in [
        ("mla_prefill (f16 mma)", ms_new),
        ("mla_attention split (3xTF32)", ms_old),
    ] {
        println!(
            "{what:<30} n=512 pos={first}..{} bucket={bucket}: {ms:>8.3} ms {:>7.1} TFLOP/s",
            first + n - 1,
            flops / ms / 1e9
        );
    }
    println!("{:<30} speed-up {:.2}x", "", ms_old / ms_new);
}

#[test]
#[ignore = "timing table at the real shapes: run on the GPU host with --include-ignored"]
fn mla_prefill_timings_at_the_real_shapes() {
    let Some(gpu) = test_gpu() else { return };
    time_chunk(&gpu, 3584, 4096);
    time_chunk(&gpu, 0, 512);
}

/// Milliseconds per call (see `ops::parity::time_calls_us`).
fn time_ms(gpu: &GpuCtx, reps: usize, call: &dyn Fn(usize) -> Result<(), OpError>) -> f64 {
    ops::parity::time_calls_us(gpu, reps, call).expect("timing") / 1e3
}
