//! CUDA parity of the MLA ops (`MlaQuery` and `MlaKv` with their rope, `KvCacheWrite`,
//! `MlaAttention`, `MlaValueOut`) against their CPU references; skips without a GPU, saying
//! why. Timings at the real Xing4.0 shapes are ignored (run on the GPU host with
//! `--include-ignored`).
//!
//! Tolerances. Where the kernel reproduces the reference's roundings (rope, norm, copies) the
//! plain f32 tolerance holds. Dot products are summed in another order than the CPU's
//! eight-lane `dot`: two orders of n terms differ by about √n·ε times the typical partial
//! sum, itself about √n·rms(w)·rms(x) (rounding errors of random sign), so [`dot_tol`]
//! allows 16× that, n·ε·rms(w)·rms(x)·16. Attention turns score errors into relative weight
//! errors through `exp`; with scores of O(1) that stays near 1e-6 of the value scale, and
//! [`ATT_TOL`] allows 3e-5. The attention kernels multiply on the tensor cores with each
//! operand split in a TF32 part and a remainder, the two correction products in TF32
//! (3xTF32, ~2^-21 of each product kept) or in one BF16 mma (~2^-20); the f32 accumulators
//! truncate rather than round, so a 576-term score is off by at most ~72 k-steps × 2^-23 of
//! its partial sums, ~1e-5 of a score of O(1): the same 3e-5 holds. Seen on the H200 at the
//! real shapes: worst |Δ| 7e-7 (3xTF32, within [`Tolerance::F32`] everywhere) and 1.5e-6
//! (BF16 corrections); the reports print the margins.

use cuda::DeviceBuffer;
use half::bf16;
use ops::gpu::{DeviceTensor, GpuCtx, Scratch};
use ops::mla::{
    AttentionKernel, KvCacheWrite, MlaAttention, MlaKv, MlaQuery, MlaValueOut, attention_chunks,
    attention_tile,
};
use ops::parity::{HostValue, ParityReport, Tolerance, check, compare, run_cpu, run_gpu, test_gpu};
use ops::rope::{RopeParams, Yarn};
use ops::tensor::{HostTensor, HostTensorMut};
use ops::{DType, Op, OpError, TensorMeta};
use proptest::prelude::*;

struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }
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
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// The released model's YaRN block (spec §1.1) over `n_rot` rotated dims.
fn rope(n_rot: usize) -> RopeParams {
    RopeParams::yarn(
        n_rot,
        10000.0,
        &Yarn {
            factor: 64.0,
            n_ctx_orig: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: 1.0,
            mscale_all_dim: 1.0,
        },
    )
}

/// rms of U(−1, 1), the test values' distribution.
const U_RMS: f32 = 0.577_350_3;

fn dot_tol(n: usize, wrms: f32, xrms: f32) -> Tolerance {
    Tolerance::new(1e-5, 16.0 * n as f32 * f32::EPSILON * wrms * xrms)
}

const ATT_TOL: Tolerance = Tolerance {
    rel: 1e-5,
    abs: 3e-5,
};

fn bf16_weight(r: &mut Rng, shape: [usize; 3]) -> HostValue {
    let n: usize = shape.iter().product();
    let bytes: Vec<u8> = (0..n)
        .flat_map(|_| bf16::from_f32(r.uniform(-1.0, 1.0)).to_le_bytes())
        .collect();
    HostValue::from_bytes(TensorMeta::new(shape, DType::BF16), &bytes)
}

fn positions(r: &mut Rng, n: usize, below: usize) -> Vec<i32> {
    (0..n).map(|_| r.below(below) as i32).collect()
}

fn report(what: &str, r: &ParityReport) {
    eprintln!("parity {what}: {r}");
}

// ---- MlaQuery -------------------------------------------------------------------------

fn query_case(
    seed: u64,
    n: usize,
    nh: usize,
    nope: usize,
    rot: usize,
    lora: usize,
) -> (MlaQuery, Vec<HostValue>) {
    let mut r = Rng::new(seed);
    let op = MlaQuery {
        n_head: nh,
        qk_nope: nope,
        qk_rope: rot,
        kv_lora: lora,
        rope: rope(rot),
    };
    let q = HostValue::f32(
        [n, nh * (nope + rot)],
        &r.vec(n * nh * (nope + rot), -1.0, 1.0),
    );
    let kb = bf16_weight(&mut r, [nh, lora, nope]);
    // Positions up to 2^18: rope angles far past 2π, where range reduction matters.
    let pos = HostValue::i32([n], &positions(&mut r, n, 1 << 18));
    (op, vec![q, kb, pos])
}

#[test]
fn mla_query_matches_its_cpu_reference_on_random_shapes() {
    let Some(gpu) = test_gpu() else { return };
    // Up to 8 tokens take the GEMV, more the tiled GEMM.
    proptest!(ProptestConfig::with_cases(32), |(
        n in 1usize..80, nh in 1usize..5, nope8 in 1usize..20, rot2 in 1usize..9,
        lora in 1usize..80, seed in any::<u64>(),
    )| {
        let (op, ins) = query_case(seed, n, nh, 8 * nope8, 2 * rot2, lora);
        check(&gpu, &op, &ins, dot_tol(8 * nope8, U_RMS, U_RMS)).map_err(TestCaseError::fail)?;
    });
}

#[test]
fn mla_query_at_the_real_shapes_matches_for_one_and_64_tokens() {
    let Some(gpu) = test_gpu() else { return };
    for n in [1, 64] {
        let (op, ins) = query_case(11 + n as u64, n, 32, 128, 64, 512);
        let r = check(&gpu, &op, &ins, dot_tol(128, U_RMS, U_RMS)).expect("parity");
        report(&format!("mla_query n={n}"), &r);
    }
}

// ---- MlaKv ----------------------------------------------------------------------------

fn kv_case(seed: u64, n: usize, lora: usize, rot: usize) -> (MlaKv, Vec<HostValue>) {
    let mut r = Rng::new(seed);
    let op = MlaKv {
        kv_lora: lora,
        qk_rope: rot,
        eps: 1e-6,
        rope: rope(rot),
    };
    let w = lora + rot;
    let kv = HostValue::f32([n, w], &r.vec(n * w, -3.0, 3.0));
    let g = HostValue::f32([lora], &r.vec(lora, 0.5, 1.5));
    let pos = HostValue::i32([n], &positions(&mut r, n, 1 << 18));
    (op, vec![kv, g, pos])
}

#[test]
fn mla_kv_matches_its_cpu_reference_on_random_shapes() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(24), |(
        n in 1usize..6, lora in 1usize..600, rot2 in 1usize..33, seed in any::<u64>(),
    )| {
        let (op, ins) = kv_case(seed, n, lora, 2 * rot2);
        check(&gpu, &op, &ins, Tolerance::F32).map_err(TestCaseError::fail)?;
    });
    for n in [1, 64] {
        let (op, ins) = kv_case(5 + n as u64, n, 512, 64);
        let r = check(&gpu, &op, &ins, Tolerance::F32).expect("parity");
        report(&format!("mla_kv n={n}"), &r);
    }
}

// ---- KvCacheWrite ---------------------------------------------------------------------

#[test]
fn kv_cache_write_matches_its_cpu_reference() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(24), |(
        ctx in 1usize..40, w in 1usize..80, n in 1usize..6, seed in any::<u64>(),
    )| {
        let mut r = Rng::new(seed);
        // Positions may repeat: the later token's row wins, as in the CPU's loop.
        let ins = vec![
            HostValue::f32([ctx, w], &r.vec(ctx * w, -1.0, 1.0)),
            HostValue::f32([n, w], &r.vec(n * w, -1.0, 1.0)),
            HostValue::i32([n], &positions(&mut r, n, ctx)),
        ];
        check(&gpu, &KvCacheWrite, &ins, Tolerance::F32).map_err(TestCaseError::fail)?;
    });
}

#[test]
fn kv_cache_write_skips_positions_outside_the_cache() {
    let Some(gpu) = test_gpu() else { return };
    let (ctx, w) = (6, 5);
    let mut r = Rng::new(3);
    let cache = r.vec(ctx * w, -1.0, 1.0);
    let k = r.vec(4 * w, 2.0, 3.0);
    let ins = vec![
        HostValue::f32([ctx, w], &cache),
        HostValue::f32([4, w], &k),
        HostValue::i32([4], &[-1, 2, ctx as i32, i32::MAX]),
    ];
    let out = run_gpu(&gpu, &KvCacheWrite, &ins).expect("kv_cache_write");
    let got: Vec<f32> = out[0]
        .1
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let mut want = cache.clone();
    want[2 * w..3 * w].copy_from_slice(&k[w..2 * w]);
    assert_eq!(got, want, "only row 2 (token 1) may change");
}

// ---- MlaAttention ---------------------------------------------------------------------

/// Q, a cache whose rows past every position are NaN (so a read past the position shows),
/// and the positions.
fn attention_inputs(seed: u64, nh: usize, w: usize, ctx: usize, pos: &[i32]) -> Vec<HostValue> {
    let mut r = Rng::new(seed);
    let n = pos.len();
    let last = pos.iter().copied().max().unwrap_or(0).max(0) as usize;
    let mut cache = r.vec(ctx * w, -1.0, 1.0);
    for v in cache.iter_mut().skip((last + 1) * w) {
        *v = f32::NAN;
    }
    vec![
        HostValue::f32([n, nh, w], &r.vec(n * nh * w, -1.0, 1.0)),
        HostValue::f32([ctx, w], &cache),
        HostValue::i32([n], pos),
    ]
}

/// The attention with the split kernel fixed, so every variant faces every case.
#[derive(Debug)]
struct Tiled(MlaAttention, AttentionKernel);

impl Op for Tiled {
    fn name(&self) -> &'static str {
        self.0.name()
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
        format!("{} {:?}", self.0.describe(), self.1)
    }
    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        scratch: Scratch,
    ) -> Result<(), OpError> {
        self.0.cuda_with(ctx, inputs, outputs, scratch, self.1)
    }
    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        self.0.cuda_scratch_bytes(inputs)
    }
}

/// Every split kernel: 16- and 32-row tiles, corrections in TF32 or BF16.
const KERNELS: [AttentionKernel; 4] = [
    AttentionKernel {
        tile: 16,
        bf16_corrections: false,
    },
    AttentionKernel {
        tile: 32,
        bf16_corrections: false,
    },
    AttentionKernel {
        tile: 16,
        bf16_corrections: true,
    },
    AttentionKernel {
        tile: 32,
        bf16_corrections: true,
    },
];

/// The CPU reference once, then each split kernel against it within [`ATT_TOL`]: per kernel
/// the report and whether the plain [`Tolerance::F32`] would have held too.
fn attention_parity(
    gpu: &GpuCtx,
    att: &MlaAttention,
    ins: &[HostValue],
) -> Result<Vec<(AttentionKernel, ParityReport, bool)>, String> {
    let cpu = run_cpu(att, ins).map_err(|e| format!("{}: cpu: {e}", att.describe()))?;
    let (meta, want) = (&cpu[0].0, cpu[0].1.bytes());
    KERNELS
        .iter()
        .map(|&kernel| {
            let op = Tiled(att.clone(), kernel);
            let got = run_gpu(gpu, &op, ins).map_err(|e| format!("{}: {e}", op.describe()))?;
            let r = compare(meta, want, &got[0].1, ATT_TOL)
                .map_err(|e| format!("{}: {e}", op.describe()))?;
            let f32_ok = compare(meta, want, &got[0].1, Tolerance::F32).is_ok();
            Ok((kernel, r, f32_ok))
        })
        .collect()
}

#[test]
fn mla_attention_matches_its_cpu_reference_on_random_shapes() {
    let Some(gpu) = test_gpu() else { return };
    // Up to ~3000 rows (many chunks of several tiles), head counts across one and two groups
    // of 32, widths up to the real 576/512; each token at row 0, at the bucket's last row or
    // anywhere.
    proptest!(ProptestConfig::with_cases(24), |(
        n in 1usize..5, nh in 1usize..70, lora4 in 1usize..129, rot4 in 0usize..17,
        ctx in 1usize..3000, seed in any::<u64>(),
    )| {
        let (lora, w) = (4 * lora4, 4 * (lora4 + rot4).min(144));
        let att = MlaAttention { n_head: nh, kv_lora: lora, kq_scale: 0.1 };
        let mut r = Rng::new(seed ^ 0x55);
        let pos: Vec<i32> = (0..n)
            .map(|_| match r.below(3) {
                0 => 0,
                1 => ctx as i32 - 1,
                _ => r.below(ctx) as i32,
            })
            .collect();
        let ins = attention_inputs(seed, nh, w, ctx, &pos);
        attention_parity(&gpu, &att, &ins).map_err(TestCaseError::fail)?;
    });
}

fn real_attention() -> MlaAttention {
    MlaAttention {
        n_head: 32,
        kv_lora: 512,
        kq_scale: 0.144_679_63,
    }
}

#[test]
fn attention_at_the_real_shapes_reads_only_rows_up_to_the_position() {
    let Some(gpu) = test_gpu() else { return };
    let op = real_attention();
    let cases: [(usize, &[i32]); 7] = [
        (8192, &[0]),
        (8192, &[1]),
        (8192, &[100]),
        (8192, &[3000]),
        (8192, &[8191]),
        (16384, &[12000]),
        // A few tokens at once (the "few tokens" decode split: several chunks each).
        (4096, &[4000, 17, 2048, 4095]),
    ];
    for (bucket, pos) in cases {
        let ins = attention_inputs(pos[0] as u64 + 1, 32, 576, bucket, pos);
        for (k, r, f32_ok) in attention_parity(&gpu, &op, &ins).expect("parity") {
            report(
                &format!(
                    "mla_attention tile={} bf16={} pos={pos:?} bucket={bucket} \
                     (within Tolerance::F32: {f32_ok})",
                    k.tile, k.bf16_corrections
                ),
                &r,
            );
        }
    }
}

#[test]
fn attention_gives_the_same_bits_on_every_run() {
    let Some(gpu) = test_gpu() else { return };
    let op = real_attention();
    // One token over many chunks (the combine's order matters) and 40 heads over two groups.
    for (nh, bucket, pos) in [(32, 16384, 9000), (40, 2048, 2047)] {
        let att = MlaAttention {
            n_head: nh,
            ..op.clone()
        };
        let ins = attention_inputs(3, nh, 576, bucket, &[pos]);
        for kernel in KERNELS {
            let tiled = Tiled(att.clone(), kernel);
            let a = run_gpu(&gpu, &tiled, &ins).expect("first run");
            let b = run_gpu(&gpu, &tiled, &ins).expect("second run");
            assert!(
                a[0].1 == b[0].1,
                "nh={nh} pos={pos} {kernel:?}: two runs differ"
            );
        }
    }
}

/// The last row of `out` (F32 `[n, 32, 512]`).
fn last_row(out: &[(TensorMeta, Vec<u8>)]) -> Vec<f32> {
    let b = &out[0].1;
    let row = 32 * 512 * 4;
    b[b.len() - row..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn decode_equals_the_last_row_of_a_chunked_prefill_on_the_gpu() {
    let Some(gpu) = test_gpu() else { return };
    let op = real_attention();
    let (ctx, p) = (2048usize, 1500i32);
    // 8 tokens split into several chunks each; 200 tokens take one chunk a token (no combine).
    for n in [8usize, 200] {
        let pos: Vec<i32> = (0..n as i32).map(|i| p - (n as i32 - 1) + i).collect();
        let prefill = attention_inputs(21, 32, 576, ctx, &pos);
        let chunks = attention_chunks(n, ctx, 32);
        assert!(
            if n == 8 { chunks > 1 } else { chunks == 1 },
            "{n} tokens: {chunks} chunks a token"
        );
        let q_last = &prefill[0].data.bytes()[(n - 1) * 32 * 576 * 4..];
        let decode = vec![
            HostValue::from_bytes(TensorMeta::f32([1, 32, 576]), q_last),
            prefill[1].clone(),
            HostValue::i32([1], &[p]),
        ];
        let a = last_row(&run_gpu(&gpu, &op, &prefill).expect("prefill"));
        let b = last_row(&run_gpu(&gpu, &op, &decode).expect("decode"));
        let mut worst = 0f32;
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            let d = (x - y).abs();
            assert!(
                d <= ATT_TOL.abs + ATT_TOL.rel * y.abs(),
                "n={n} element {i}: prefill {x}, decode {y}"
            );
            worst = worst.max(d);
        }
        eprintln!("decode vs prefill n={n}: max |Δ| {worst:.3e}");
    }
}

// ---- MlaValueOut ----------------------------------------------------------------------

fn value_case(
    seed: u64,
    n: usize,
    nh: usize,
    lora: usize,
    vh: usize,
) -> (MlaValueOut, Vec<HostValue>) {
    let mut r = Rng::new(seed);
    let op = MlaValueOut {
        n_head: nh,
        kv_lora: lora,
        v_head: vh,
    };
    let o = HostValue::f32([n, nh, lora], &r.vec(n * nh * lora, -1.0, 1.0));
    (op, vec![o, bf16_weight(&mut r, [nh, vh, lora])])
}

#[test]
fn mla_value_out_matches_its_cpu_reference() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(32), |(
        n in 1usize..80, nh in 1usize..5, lora8 in 1usize..129, vh in 1usize..150,
        seed in any::<u64>(),
    )| {
        let (op, ins) = value_case(seed, n, nh, 8 * lora8, vh);
        check(&gpu, &op, &ins, dot_tol(8 * lora8, U_RMS, U_RMS)).map_err(TestCaseError::fail)?;
    });
    for n in [1, 64] {
        let (op, ins) = value_case(3 + n as u64, n, 32, 512, 128);
        let r = check(&gpu, &op, &ins, dot_tol(512, U_RMS, U_RMS)).expect("parity");
        report(&format!("mla_value_out n={n}"), &r);
    }
}

#[test]
fn the_cuda_kernels_refuse_shapes_they_do_not_cover() {
    let Some(gpu) = test_gpu() else { return };
    // W not a multiple of 4.
    let op = MlaAttention {
        n_head: 2,
        kv_lora: 5,
        kq_scale: 0.1,
    };
    let e = run_gpu(&gpu, &op, &attention_inputs(1, 2, 6, 4, &[1])).unwrap_err();
    assert!(
        matches!(e, OpError::Shape { .. }) && e.to_string().contains("multiples of 4"),
        "{e}"
    );
    // A per-head weight that is not BF16.
    let (op, mut ins) = value_case(1, 1, 2, 8, 3);
    let w: Vec<f32> = vec![0.5; 2 * 3 * 8];
    ins[1] = HostValue::f32([2, 3, 8], &w);
    let e = run_gpu(&gpu, &op, &ins).unwrap_err();
    assert!(e.to_string().contains("BF16"), "{e}");
    // The CPU reference still runs both.
    assert!(run_cpu(&op, &ins).is_ok());
}

// ---- timings ----------------------------------------------------------------------------

/// The attention kernels' source, to time the merge kernel on its own.
const MLA_SOURCE: &str = include_str!("../kernels/mla.cu");

fn upload(gpu: &GpuCtx, bytes: &[u8]) -> DeviceBuffer<u8> {
    gpu.device.upload(bytes).expect("upload")
}

fn view<'a>(meta: &'a TensorMeta, b: &DeviceBuffer<u8>) -> DeviceTensor<'a> {
    DeviceTensor {
        meta,
        ptr: b.device_ptr(),
        bytes: b.num_bytes(),
    }
}

fn line(what: &str, us: f64, bytes: f64) {
    println!("{what:<64} {us:>9.2} µs {:>7.0} GB/s", bytes / us / 1e3);
}

/// Per call one of enough caches of `bucket` rows that the rows read exceed the 60 MB L2, the
/// default and every split kernel; `first_pos` is the first token's position.
fn time_attention(gpu: &GpuCtx, n: usize, first_pos: usize, bucket: usize) {
    let op = real_attention();
    let w = 576;
    let rows = first_pos + n;
    let layers = (150usize << 20).div_ceil(rows * w * 4).clamp(2, 64);
    let mut r = Rng::new(77);
    let layer = r.vec(bucket * w, -1.0, 1.0);
    let lb: Vec<u8> = layer.iter().flat_map(|v| v.to_le_bytes()).collect();
    let caches: Vec<_> = (0..layers).map(|_| upload(gpu, &lb)).collect();
    let qv: Vec<u8> = r
        .vec(n * 32 * w, -1.0, 1.0)
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let q = upload(gpu, &qv);
    let pos: Vec<u8> = (0..n)
        .flat_map(|i| ((first_pos + i) as i32).to_le_bytes())
        .collect();
    let pb = upload(gpu, &pos);
    let out = upload(gpu, &vec![0u8; n * 32 * 512 * 4]);
    let (qm, cm, pm, om) = (
        TensorMeta::f32([n, 32, w]),
        TensorMeta::f32([bucket, w]),
        TensorMeta::i32([n]),
        TensorMeta::f32([n, 32, 512]),
    );
    let sbytes = op.cuda_scratch_bytes(&[&qm, &cm, &pm]);
    let scratch = upload(gpu, &vec![0u8; sbytes.max(16)]);
    let default = attention_tile(n, bucket, 32);
    for kernel in std::iter::once(None).chain(KERNELS.map(Some)) {
        let call = |i: usize| {
            let ins = [
                view(&qm, &q),
                view(&cm, &caches[i % layers]),
                view(&pm, &pb),
            ];
            let outs = [view(&om, &out)];
            let scratch = Scratch {
                ptr: scratch.device_ptr(),
                bytes: sbytes,
            };
            match kernel {
                None => op.cuda(gpu, &ins, &outs, scratch),
                Some(k) => op.cuda_with(gpu, &ins, &outs, scratch, k),
            }
        };
        let us = time_us(gpu, 4 * layers, &call);
        // Rows read: the union over the tokens (each token's rows are read by its own blocks,
        // from L2 after the first); Q, the output and the partials written and read back.
        let bytes = (rows * w * 4 + n * 32 * w * 4 + n * 32 * 512 * 4 + 2 * sbytes) as f64;
        let flops: f64 = (0..n)
            .map(|i| 2.0 * 32.0 * (first_pos + i + 1) as f64 * (576.0 + 512.0))
            .sum();
        let which = match kernel {
            None => format!("default (tile={default})"),
            Some(k) => format!("tile={} bf16={}", k.tile, k.bf16_corrections),
        };
        line(
            &format!(
                "mla_attention n={n} rows={rows} bucket={bucket} {which} ({} chunks)",
                attention_chunks(n, bucket, 32)
            ),
            us,
            bytes,
        );
        println!(
            "{:<64} {:>9.1} TFLOP/s (f32-class math)",
            "",
            flops / us / 1e6
        );
    }
    let chunks = attention_chunks(n, bucket, 32);
    if chunks > 1 {
        // The merge kernel alone, on the partials the last call left in the scratch (laid out
        // as mla.rs does: o[n][chunks][32][512], then (m, l)), to split the time between the
        // two kernels.
        let combine = gpu
            .kernel("mla.cu", MLA_SOURCE, "mla_attn_combine")
            .expect("combine kernel");
        let part_ml = scratch.device_ptr() + (n * chunks * 32 * 512 * 4) as u64;
        let call = |_: usize| {
            // SAFETY: mla_attn_combine's C signature; reads the scratch's partials (sized by
            // cuda_scratch_bytes for these shapes) and writes `out`.
            unsafe {
                gpu.device
                    .launch(&combine)
                    .grid((4, 32, n as u32))
                    .block(256)
                    .arg(scratch.device_ptr())
                    .arg(part_ml)
                    .arg(pb.device_ptr())
                    .arg(out.device_ptr())
                    .arg(32i32)
                    .arg(512i32)
                    .arg(bucket as i32)
                    .arg(chunks as i32)
                    .arg(default as i32)
                    .enqueue()
                    .map_err(|e| OpError::Type(e.to_string()))
            }
        };
        let us = time_us(gpu, 64, &call);
        line(
            &format!("  of which mla_attn_combine alone (tile={default})"),
            us,
            (2 * n * chunks * 32 * 514 * 4) as f64,
        );
    }
}

fn time_head_gemv(gpu: &GpuCtx, n: usize, value_out: bool) {
    let mut r = Rng::new(5);
    let (nh, lora) = (32, 512);
    let (n_in, n_out, x_w, y_w) = if value_out {
        (512, 128, nh * lora, nh * 128)
    } else {
        (128, 512, nh * 192, nh * 576)
    };
    let wbytes: Vec<u8> = (0..nh * n_in * n_out)
        .flat_map(|_| bf16::from_f32(r.uniform(-1.0, 1.0)).to_le_bytes())
        .collect();
    // Rotate over enough copies of the 4 MB weight that it is not served from L2.
    let copies = if n <= 8 { 32 } else { 2 };
    let ws: Vec<_> = (0..copies).map(|_| upload(gpu, &wbytes)).collect();
    let xb: Vec<u8> = r
        .vec(n * x_w, -1.0, 1.0)
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let x = upload(gpu, &xb);
    let y = upload(gpu, &vec![0u8; n * y_w * 4]);
    let pb: Vec<u8> = (0..n).flat_map(|i| (i as i32 * 7).to_le_bytes()).collect();
    let p = upload(gpu, &pb);
    let wm = TensorMeta::new(
        if value_out {
            [nh, 128, 512]
        } else {
            [nh, 512, 128]
        },
        DType::BF16,
    );
    let pm = TensorMeta::i32([n]);
    let (xm, ym) = if value_out {
        (
            TensorMeta::f32([n, nh, lora]),
            TensorMeta::f32([n, nh * 128]),
        )
    } else {
        (
            TensorMeta::f32([n, nh * 192]),
            TensorMeta::f32([n, nh, 576]),
        )
    };
    let q_op = MlaQuery {
        n_head: nh,
        qk_nope: 128,
        qk_rope: 64,
        kv_lora: lora,
        rope: rope(64),
    };
    let v_op = MlaValueOut {
        n_head: nh,
        kv_lora: lora,
        v_head: 128,
    };
    let call = |i: usize| {
        let w = view(&wm, &ws[i % copies]);
        if value_out {
            v_op.cuda(
                gpu,
                &[view(&xm, &x), w],
                &[view(&ym, &y)],
                Scratch::default(),
            )
        } else {
            q_op.cuda(
                gpu,
                &[view(&xm, &x), w, view(&pm, &p)],
                &[view(&ym, &y)],
                Scratch::default(),
            )
        }
    };
    let us = time_us(gpu, 4 * copies, &call);
    let bytes = (wbytes.len() + xb.len() + n * y_w * 4) as f64;
    let name = if value_out {
        "mla_value_out"
    } else {
        "mla_query"
    };
    line(
        &format!("{name} n={n} (BF16 {n_out}x{n_in} x 32 heads)"),
        us,
        bytes,
    );
}

fn time_kv(gpu: &GpuCtx, n: usize) {
    let (op, ins) = kv_case(1, n, 512, 64);
    let bufs: Vec<_> = ins.iter().map(|v| upload(gpu, v.data.bytes())).collect();
    let om = TensorMeta::f32([n, 576]);
    let out = upload(gpu, &vec![0u8; n * 576 * 4]);
    let call = |_: usize| {
        let v: Vec<DeviceTensor<'_>> = ins
            .iter()
            .zip(&bufs)
            .map(|(h, b)| view(&h.meta, b))
            .collect();
        op.cuda(gpu, &v, &[view(&om, &out)], Scratch::default())
    };
    let us = time_us(gpu, 50, &call);
    line(
        &format!("mla_kv n={n}"),
        us,
        (2 * n * 576 * 4 + 2048) as f64,
    );
}

#[test]
#[ignore = "timing table at the real shapes: run on the GPU host with --include-ignored"]
fn mla_timings_at_the_real_shapes() {
    let Some(gpu) = test_gpu() else { return };
    for n in [1, 512] {
        time_head_gemv(&gpu, n, false);
        time_kv(&gpu, n);
        time_head_gemv(&gpu, n, true);
    }
    // Decode at the buckets' sizes: rows = pos + 1, the bucket the next power of two.
    for rows in [512usize, 4224, 16448, 32832] {
        time_attention(&gpu, 1, rows - 1, rows.next_power_of_two());
    }
    // Prefill chunks of 512 tokens (one chunk a token, no combine).
    time_attention(&gpu, 512, 0, 4096);
    time_attention(&gpu, 512, 3584, 4096);
}

fn time_us(gpu: &GpuCtx, reps: usize, call: &dyn Fn(usize) -> Result<(), OpError>) -> f64 {
    ops::parity::time_calls_us(gpu, reps, call).expect("timing")
}
