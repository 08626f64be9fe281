//! CUDA parity of the MLA ops (`MlaQuery` and `MlaKv` with their rope, `KvCacheWrite`,
//! `MlaAttention` over one sequence's cache and over several sequences' blocks shuffled in a
//! paged pool, `MlaValueOut`) against their CPU references; skips without a GPU, saying
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
//! (BF16 corrections); the reports print the margins. The split kernel with f16 operands
//! (`SplitProducts::F16`) has the prefill flash kernel's roundings and its tolerance,
//! [`F16_ATT_TOL`].
//!
//! The per-head products (`MlaQuery`'s Kb, `MlaValueOut`'s Vb) of more than
//! [`HEAD_GEMV_ROWS_LIMIT`] tokens run on the tensor cores (`HeadKernel::TensorCore`, as the
//! lowering chooses them; [`support::head_for`]): the BF16 weight is exact, x is split
//! into hi = bf16(x) and lo = bf16(x − hi), and hi·w + lo·w are summed in f32. x − hi − lo
//! is within 2^-16 of x (each bf16 rounding keeps 8 significant bits), so each product may be
//! off by up to 2^-16 of itself; over k products of random sign that is a sum with a standard
//! deviation of at most √k·rms(w)·rms(x)·2^-16. [`head_tol`] adds 6 of those to
//! [`dot_tol`]: at the real k = 128 that is 3.5e-4 against outputs of rms 3.8 (1e-4 of
//! them), at k = 512 6.9e-4 against 7.5. These are the attention's inputs and outputs, where
//! a relative 1e-4 is far below what bf16 caches or the model's own bf16 weights carry. The
//! kernels' mechanics (indexing, tails, accumulation) are pinned at the plain [`dot_tol`] on
//! inputs with 16 significant bits, which the split represents exactly.

use cuda::DeviceBuffer;
use half::bf16;
use ops::gpu::{DeviceTensor, GpuCtx, Scratch};
use ops::mla::{
    AttentionKernel, AttentionPath, HEAD_GEMV_ROWS_LIMIT, KvCacheWrite, MlaAttention, MlaKv,
    MlaKvCacheWrite, MlaQuery, MlaValueOut, SplitProducts, attention_chunks, attention_tile,
};
use ops::parity::{
    HostValue, ParityReport, Rng, Tolerance, check, compare, run_cpu, run_gpu, test_gpu,
};
use ops::rope::{RopeConsts, RopeParams, Yarn};
use ops::tensor::{HostTensor, HostTensorMut};
use ops::{DType, Op, OpError, TensorMeta};
use proptest::prelude::*;

mod support;
use support::{PagedPool, attention_for, head_for};

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

/// The per-head products' tolerance for `n` tokens of `k`-long dots of U(−1, 1) values: see
/// the module doc. Up to [`HEAD_GEMV_ROWS_LIMIT`] tokens they run as an f32 GEMV; more take the
/// split-operand tensor-core kernels.
fn head_tol(n: usize, k: usize) -> Tolerance {
    let t = dot_tol(k, U_RMS, U_RMS);
    if head_for(n) == ops::mla::HeadKernel::Gemv {
        return t;
    }
    let split = 6.0 * (k as f32).sqrt() * U_RMS * U_RMS * 2f32.powi(-16);
    Tolerance::new(t.rel, t.abs + split)
}

/// `v` with its f32 values cut to 16 significant bits, which hi + lo carries exactly.
fn sixteen_bits(v: &HostValue) -> HostValue {
    let bytes: Vec<u8> = v
        .data
        .bytes()
        .chunks_exact(4)
        .flat_map(|b| (u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & !0xff).to_le_bytes())
        .collect();
    HostValue::from_bytes(v.meta.clone(), &bytes)
}

/// Token counts for the per-head products: the GEMV's and the tensor cores' (one or several
/// token tiles, mostly partial).
fn head_tokens() -> impl Strategy<Value = usize> {
    prop_oneof![1usize..=HEAD_GEMV_ROWS_LIMIT, HEAD_GEMV_ROWS_LIMIT + 1..300]
}

const ATT_TOL: Tolerance = Tolerance {
    rel: 1e-5,
    abs: 3e-5,
};

/// The split kernel with f16 operands rounds Q·kq_scale, the cache rows and the softmax
/// weights to f16 as the prefill flash kernel does: its tolerance (gpu_mla_prefill.rs says
/// why rel 4e-3, abs 1.5e-3; values here are U(−1, 1) as there).
const F16_ATT_TOL: Tolerance = Tolerance {
    rel: 4e-3,
    abs: 1.5e-3,
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
        kernel: head_for(n),
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
    // Odd q widths (an odd rope half) and odd output widths take the kernels' unaligned
    // loads and stores; up to 300 rows cover several column tiles.
    proptest!(ProptestConfig::with_cases(32), |(
        n in head_tokens(), nh in 1usize..5, nope8 in 1usize..20, rot2 in 1usize..9,
        lora in 1usize..300, seed in any::<u64>(),
    )| {
        let (op, ins) = query_case(seed, n, nh, 8 * nope8, 2 * rot2, lora);
        check(&gpu, &op, &ins, head_tol(n, 8 * nope8)).map_err(TestCaseError::fail)?;
    });
}

#[test]
fn mla_query_at_the_real_shapes_matches_for_1_64_and_300_tokens() {
    let Some(gpu) = test_gpu() else { return };
    for n in [1, 64, 300] {
        let (op, ins) = query_case(11 + n as u64, n, 32, 128, 64, 512);
        let r = check(&gpu, &op, &ins, head_tol(n, 128)).expect("parity");
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

#[test]
fn mla_kv_into_the_cache_gives_mla_kv_then_kv_cache_write() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(24), |(
        // Positions repeat (a later token wins) and, past 256 tokens, the scan for a later
        // duplicate wraps over the block.
        n in prop_oneof![1usize..6, 250usize..400], ctx in 1usize..50, lora in 1usize..600,
        rot2 in 1usize..33, seed in any::<u64>(),
    )| {
        // Inputs (cache, kv, norm_w, positions, slots): the positions (up to 2^18, for the
        // rope) are apart from the slots (the pool rows), which repeat and now and then are
        // a padding row's -1.
        let (kv, mut ins) = kv_case(seed, n, lora, 2 * rot2);
        let mut r = Rng::new(seed ^ 0xcace);
        let w = lora + 2 * rot2;
        let slots: Vec<i32> = positions(&mut r, n, ctx + 1).iter().map(|&s| s - 1).collect();
        ins.insert(0, HostValue::f32([ctx, w], &r.vec(ctx * w, -1.0, 1.0)));
        ins.push(HostValue::i32([n], &slots));
        check(&gpu, &MlaKvCacheWrite { kv }, &ins, Tolerance::F32).map_err(TestCaseError::fail)?;
    });
}

// ---- KvCacheWrite ---------------------------------------------------------------------

#[test]
fn kv_cache_write_matches_its_cpu_reference() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(24), |(
        // More tokens than a block has threads: the scan for a later duplicate wraps.
        ctx in 1usize..40, w in 1usize..80, n in prop_oneof![1usize..6, 250usize..600],
        seed in any::<u64>(),
    )| {
        let mut r = Rng::new(seed);
        // Slots may repeat (the later token's row wins, as in the CPU's loop) and be a padding
        // row's -1 (nothing written).
        let slots: Vec<i32> = positions(&mut r, n, ctx + 1).iter().map(|&s| s - 1).collect();
        let ins = vec![
            HostValue::f32([ctx, w], &r.vec(ctx * w, -1.0, 1.0)),
            HostValue::f32([n, w], &r.vec(n * w, -1.0, 1.0)),
            HostValue::i32([n], &slots),
        ];
        check(&gpu, &KvCacheWrite, &ins, Tolerance::F32).map_err(TestCaseError::fail)?;
    });
}

#[test]
fn kv_cache_write_skips_padding_slots_and_slots_outside_the_pool() {
    let Some(gpu) = test_gpu() else { return };
    // Padding rows' negative slots write nothing; slots past the pool (which the CPU refuses
    // and the engine never makes) are skipped too.
    let (ctx, w) = (6, 5);
    let mut r = Rng::new(3);
    let cache = r.vec(ctx * w, -1.0, 1.0);
    let k = r.vec(5 * w, 2.0, 3.0);
    let ins = vec![
        HostValue::f32([ctx, w], &cache),
        HostValue::f32([5, w], &k),
        HostValue::i32([5], &[-1, 2, ctx as i32, i32::MAX, i32::MIN]),
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

/// Positions of a cache block at the real shapes (the engine's).
const BLOCK: usize = 64;

/// The inputs of one sequence over a cache of `ctx` rows padded to whole blocks of `block`
/// (its blocks in order): Q, the cache, whose rows past every position are NaN (so a read past
/// the position shows), the positions, the identity block table `[1, blocks]` and the row map
/// (all sequence 0).
fn attention_inputs(
    seed: u64,
    nh: usize,
    w: usize,
    ctx: usize,
    block: usize,
    pos: &[i32],
) -> Vec<HostValue> {
    let mut r = Rng::new(seed);
    let n = pos.len();
    let rows = ctx.next_multiple_of(block);
    let last = pos.iter().copied().max().unwrap_or(0).max(0) as usize;
    let mut cache = r.vec(rows * w, -1.0, 1.0);
    for v in cache.iter_mut().skip((last + 1) * w) {
        *v = f32::NAN;
    }
    let blocks = rows / block;
    vec![
        HostValue::f32([n, nh, w], &r.vec(n * nh * w, -1.0, 1.0)),
        HostValue::f32([rows, w], &cache),
        HostValue::i32([n], pos),
        HostValue::i32([1, blocks], &(0..blocks as i32).collect::<Vec<_>>()),
        HostValue::i32([n], &vec![0; n]),
    ]
}

/// The inputs of a step over `pool`: Q, the pool holding `seqs` (NaN in every row no sequence
/// holds), the positions, the block table and the row map.
fn paged_inputs(
    pool: &PagedPool,
    seqs: &[Vec<f32>],
    q: &[f32],
    nh: usize,
    w: usize,
    pos: &[i32],
    row_seq: &[i32],
) -> Vec<HostValue> {
    let n = pos.len();
    vec![
        HostValue::f32([n, nh, w], q),
        HostValue::f32([pool.pool_rows(), w], &pool.scatter(seqs, w)),
        HostValue::i32([n], pos),
        HostValue::i32([pool.seqs(), pool.width], &pool.table),
        HostValue::i32([n], row_seq),
    ]
}

/// The CPU reference of a step over `pool` computed as each sequence's tokens alone over that
/// sequence's own contiguous cache (same reach, blocks in order): the output's bytes.
fn per_sequence_reference(
    att: &MlaAttention,
    pool: &PagedPool,
    seqs: &[Vec<f32>],
    q: &[f32],
    w: usize,
    pos: &[i32],
    row_seq: &[i32],
) -> Result<Vec<u8>, OpError> {
    let (n, nh, lora) = (pos.len(), att.n_head, att.kv_lora);
    let tok = nh * lora * 4;
    let mut out = vec![0u8; n * tok];
    for (s, rows) in seqs.iter().enumerate() {
        let (mine, qs, ps) = support::sequence_rows(s, q, nh * w, pos, row_seq);
        if mine.is_empty() {
            continue;
        }
        let k = mine.len();
        let ins = vec![
            HostValue::f32([k, nh, w], &qs),
            HostValue::f32([pool.reach(), w], &pool.contiguous(rows, w)),
            HostValue::i32([k], &ps),
            HostValue::i32([1, pool.width], &pool.contiguous_table()),
            HostValue::i32([k], &vec![0; k]),
        ];
        let alone = run_cpu(att, &ins)?;
        let b = alone[0].1.bytes();
        for (j, &i) in mine.iter().enumerate() {
            out[i * tok..(i + 1) * tok].copy_from_slice(&b[j * tok..(j + 1) * tok]);
        }
    }
    Ok(out)
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

/// Every split kernel: 16- and 32-row tiles, corrections in TF32 or BF16, or f16 operands.
const KERNELS: [AttentionKernel; 6] = [
    AttentionKernel {
        tile: 16,
        products: SplitProducts::Tf32x3,
    },
    AttentionKernel {
        tile: 32,
        products: SplitProducts::Tf32x3,
    },
    AttentionKernel {
        tile: 16,
        products: SplitProducts::Bf16Corrections,
    },
    AttentionKernel {
        tile: 32,
        products: SplitProducts::Bf16Corrections,
    },
    AttentionKernel {
        tile: 16,
        products: SplitProducts::F16,
    },
    AttentionKernel {
        tile: 32,
        products: SplitProducts::F16,
    },
];

/// A split kernel's tolerance: [`ATT_TOL`] for the f32-class products, [`F16_ATT_TOL`] for
/// f16 operands.
fn kernel_tol(kernel: AttentionKernel) -> Tolerance {
    match kernel.products {
        SplitProducts::F16 => F16_ATT_TOL,
        _ => ATT_TOL,
    }
}

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
            let r = compare(meta, want, &got[0].1, kernel_tol(kernel))
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
    // of 32, widths up to the real 576/512, cache blocks of 1 to 64 rows (the cache padded to
    // whole blocks); each token at row 0, at the bucket's last row or anywhere.
    proptest!(ProptestConfig::with_cases(24), |(
        n in 1usize..5, nh in 1usize..70, lora4 in 1usize..129, rot4 in 0usize..17,
        ctx in 1usize..3000, bshift in 0usize..7, seed in any::<u64>(),
    )| {
        let (lora, w, block) = (4 * lora4, 4 * (lora4 + rot4).min(144), 1 << bshift);
        let att = MlaAttention {
            n_head: nh, kv_lora: lora, kq_scale: 0.1, block_size: block,
            kernel: AttentionPath::SplitK,
        };
        let bucket = ctx.next_multiple_of(block);
        let mut r = Rng::new(seed ^ 0x55);
        let pos: Vec<i32> = (0..n)
            .map(|_| match r.below(3) {
                0 => 0,
                1 => bucket as i32 - 1,
                _ => r.below(bucket) as i32,
            })
            .collect();
        let ins = attention_inputs(seed, nh, w, ctx, block, &pos);
        attention_parity(&gpu, &att, &ins).map_err(TestCaseError::fail)?;
    });
}

#[test]
fn attention_over_shuffled_blocks_equals_attention_over_each_sequence_s_contiguous_copy() {
    let Some(gpu) = test_gpu() else { return };
    // Up to 4 sequences of up to ~2000 positions in one step, a few tokens of each in a random
    // order (at position 0, at the sequence's last or anywhere), blocks of 1 to 64 rows handed
    // out in a shuffled order, every pool row no sequence holds NaN (so a read of one shows).
    // Each split kernel over the pool is held to the CPU over each sequence's own contiguous
    // cache, and gives the bits it gives over the same blocks in their natural order.
    proptest!(ProptestConfig::with_cases(16), |(
        lens in prop::collection::vec(1usize..2000, 1..5), n in 1usize..9, nh in 1usize..70,
        lora4 in 1usize..129, rot4 in 0usize..17, bshift in 0usize..7, extra_width in 0usize..3,
        seed in any::<u64>(),
    )| {
        let (lora, w, block) = (4 * lora4, 4 * (lora4 + rot4).min(144), 1 << bshift);
        let att = MlaAttention {
            n_head: nh, kv_lora: lora, kq_scale: 0.1, block_size: block,
            kernel: AttentionPath::SplitK,
        };
        let mut r = Rng::new(seed ^ 0x9a6e);
        let shuffled = PagedPool::new(&mut r, &lens, block, extra_width, true);
        let in_order = PagedPool::new(&mut r, &lens, block, extra_width, false);
        let seqs: Vec<Vec<f32>> = lens.iter().map(|&l| r.vec(l * w, -1.0, 1.0)).collect();
        let row_seq: Vec<i32> = (0..n).map(|_| r.below(lens.len()) as i32).collect();
        let pos: Vec<i32> = row_seq
            .iter()
            .map(|&s| {
                let l = lens[s as usize];
                (match r.below(3) {
                    0 => 0,
                    1 => l - 1,
                    _ => r.below(l),
                }) as i32
            })
            .collect();
        let q = r.vec(n * nh * w, -1.0, 1.0);
        let ins = paged_inputs(&shuffled, &seqs, &q, nh, w, &pos, &row_seq);
        let natural = paged_inputs(&in_order, &seqs, &q, nh, w, &pos, &row_seq);
        let want = per_sequence_reference(&att, &shuffled, &seqs, &q, w, &pos, &row_seq)
            .map_err(|e| TestCaseError::fail(format!("cpu: {e}")))?;
        let meta = TensorMeta::f32([n, nh, lora]);
        for kernel in KERNELS {
            let op = Tiled(att.clone(), kernel);
            let got = run_gpu(&gpu, &op, &ins)
                .map_err(|e| TestCaseError::fail(format!("{}: {e}", op.describe())))?;
            compare(&meta, &want, &got[0].1, kernel_tol(kernel))
                .map_err(|e| TestCaseError::fail(format!("{} lens={lens:?}: {e}", op.describe())))?;
            let nat = run_gpu(&gpu, &op, &natural)
                .map_err(|e| TestCaseError::fail(format!("{}: {e}", op.describe())))?;
            prop_assert!(
                got[0].1 == nat[0].1,
                "{}: the shuffled pool gives other bits than the blocks in order",
                op.describe()
            );
        }
    });
}

/// The model's attention on the split kernel (see [`real_attention_for`] for the lowering's
/// choice).
fn real_attention() -> MlaAttention {
    MlaAttention {
        n_head: 32,
        kv_lora: 512,
        kq_scale: 0.144_679_63,
        block_size: BLOCK,
        kernel: AttentionPath::SplitK,
    }
}

/// [`real_attention`] on the kernel a plan of `n` tokens over rows `w` wide would carry.
fn real_attention_for(n: usize, w: usize) -> MlaAttention {
    let op = real_attention();
    MlaAttention {
        kernel: attention_for(&op, n, w),
        ..op
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
        let ins = attention_inputs(pos[0] as u64 + 1, 32, 576, bucket, BLOCK, pos);
        for (k, r, f32_ok) in attention_parity(&gpu, &op, &ins).expect("parity") {
            report(
                &format!(
                    "mla_attention tile={} {:?} pos={pos:?} bucket={bucket} \
                     (within Tolerance::F32: {f32_ok})",
                    k.tile, k.products
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
        let ins = attention_inputs(3, nh, 576, bucket, BLOCK, &[pos]);
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

/// `ins` with its cache (input 1, F32) stored as F16, as the lowering stores it for the f16
/// kernels: NaN rows stay NaN.
fn with_f16_cache(mut ins: Vec<HostValue>) -> Vec<HostValue> {
    let meta = TensorMeta::new(ins[1].meta.shape.clone(), DType::F16);
    let bytes: Vec<u8> = ins[1]
        .data
        .bytes()
        .chunks_exact(4)
        .flat_map(|c| {
            half::f16::from_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]])).to_le_bytes()
        })
        .collect();
    ins[1] = HostValue::from_bytes(meta, &bytes);
    ins
}

/// The warpgroup kernel against the CPU over the same F16 cache, within the f16 kernels'
/// tolerance, and the same bits on a second run: one token in its first page, at a page's last
/// and first rows, deep in a long context (many chunks, the wide merge), a few tokens at once
/// (the few-chunk merge), and a batch of sequences over shuffled blocks of a shared pool, whose
/// rows no sequence holds are NaN (a page's rows past a position are staged, so they must be
/// masked, not multiplied by a zero weight).
#[test]
fn the_warpgroup_split_kernel_matches_the_cpu_over_an_f16_cache() {
    let Some(gpu) = test_gpu() else { return };
    let op = MlaAttention {
        kernel: AttentionPath::SplitKWg,
        ..real_attention()
    };
    assert!(op.wg_supports(576));
    let mut cases: Vec<(String, Vec<HostValue>)> = Vec::new();
    for (bucket, pos) in [
        (8192usize, vec![0i32]),
        (8192, vec![63]),
        (8192, vec![64]),
        (8192, vec![3000]),
        (16384, vec![16383]),
        (4096, vec![4000, 17, 2048, 4095]),
    ] {
        let ins = attention_inputs(pos[0] as u64 + 5, 32, 576, bucket, BLOCK, &pos);
        cases.push((format!("pos={pos:?} bucket={bucket}"), ins));
    }
    {
        let mut r = Rng::new(91);
        let lens = [700usize, 64, 2500, 1, 130, 1999];
        let pool = PagedPool::new(&mut r, &lens, BLOCK, 1, true);
        let seqs: Vec<Vec<f32>> = lens.iter().map(|&l| r.vec(l * 576, -1.0, 1.0)).collect();
        let mut pos = Vec::new();
        let mut row_seq = Vec::new();
        for (s, &l) in lens.iter().enumerate() {
            for k in 0..3 {
                pos.push([l - 1, r.below(l), 0][k] as i32);
                row_seq.push(s as i32);
            }
        }
        let q = r.vec(pos.len() * 32 * 576, -1.0, 1.0);
        let ins = paged_inputs(&pool, &seqs, &q, 32, 576, &pos, &row_seq);
        cases.push((
            format!("{} tokens of 6 sequences, shuffled blocks", pos.len()),
            ins,
        ));
    }
    for (what, ins) in cases {
        let ins = with_f16_cache(ins);
        let r = check(&gpu, &op, &ins, F16_ATT_TOL).unwrap_or_else(|e| panic!("{what}: {e}"));
        report(&format!("mla_attention wg {what}"), &r);
        let a = run_gpu(&gpu, &op, &ins).expect("first run");
        let b = run_gpu(&gpu, &op, &ins).expect("second run");
        assert!(a[0].1 == b[0].1, "{what}: two runs differ");
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
    let (ctx, p) = (2048usize, 1500i32);
    // 8 tokens split into several chunks each; 132 tokens (one full wave of the 132 SMs) take
    // one chunk a token (no combine). Both on the split kernel: from ATTENTION_FLASH_MIN_ROWS
    // tokens a prefill takes the flash kernel, checked against the CPU in gpu_mla_prefill.
    let mut report = Vec::new();
    for n in [8usize, 132] {
        let pos: Vec<i32> = (0..n as i32).map(|i| p - (n as i32 - 1) + i).collect();
        let prefill = attention_inputs(21, 32, 576, ctx, BLOCK, &pos);
        let chunks = attention_chunks(n, ctx, 32);
        assert!(
            if n == 8 { chunks > 1 } else { chunks == 1 },
            "{n} tokens: {chunks} chunks a token"
        );
        assert_eq!(
            attention_for(&real_attention(), n, 576),
            AttentionPath::SplitK,
            "{n} tokens"
        );
        let q_last = &prefill[0].data.bytes()[(n - 1) * 32 * 576 * 4..];
        let decode = vec![
            HostValue::from_bytes(TensorMeta::f32([1, 32, 576]), q_last),
            prefill[1].clone(),
            HostValue::i32([1], &[p]),
            prefill[3].clone(),
            HostValue::i32([1], &[0]),
        ];
        let a = last_row(&run_gpu(&gpu, &real_attention_for(n, 576), &prefill).expect("prefill"));
        let b = last_row(&run_gpu(&gpu, &real_attention_for(1, 576), &decode).expect("decode"));
        let mut worst = (0f32, 0usize);
        let mut bad = None;
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            let d = (x - y).abs();
            if d > worst.0 {
                worst = (d, i);
            }
            if bad.is_none() && d > ATT_TOL.abs + ATT_TOL.rel * y.abs() {
                bad = Some(format!("n={n} element {i}: prefill {x}, decode {y}"));
            }
        }
        let line = format!(
            "decode vs prefill n={n} ({chunks} chunks, tile {}): max |Δ| {:.3e} at element {}",
            attention_tile(n, ctx, 32),
            worst.0,
            worst.1
        );
        eprintln!("{line}");
        report.push((line, bad));
    }
    let bad: Vec<String> = report.iter().filter_map(|(_, b)| b.clone()).collect();
    assert!(bad.is_empty(), "{bad:?}");
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
        kernel: head_for(n),
    };
    let o = HostValue::f32([n, nh, lora], &r.vec(n * nh * lora, -1.0, 1.0));
    (op, vec![o, bf16_weight(&mut r, [nh, vh, lora])])
}

#[test]
fn mla_value_out_matches_its_cpu_reference() {
    let Some(gpu) = test_gpu() else { return };
    proptest!(ProptestConfig::with_cases(32), |(
        n in head_tokens(), nh in 1usize..5, lora8 in 1usize..129, vh in 1usize..150,
        seed in any::<u64>(),
    )| {
        let (op, ins) = value_case(seed, n, nh, 8 * lora8, vh);
        check(&gpu, &op, &ins, head_tol(n, 8 * lora8)).map_err(TestCaseError::fail)?;
    });
    for n in [1, 64, 300] {
        let (op, ins) = value_case(3 + n as u64, n, 32, 512, 128);
        let r = check(&gpu, &op, &ins, head_tol(n, 512)).expect("parity");
        report(&format!("mla_value_out n={n}"), &r);
    }
}

#[test]
fn the_tensor_core_products_are_f32_exact_on_inputs_of_16_significant_bits() {
    let Some(gpu) = test_gpu() else { return };
    // With hi + lo = x exactly, only the order of the f32 sums differs from the reference.
    proptest!(ProptestConfig::with_cases(16), |(
        n in HEAD_GEMV_ROWS_LIMIT + 1..300, nh in 1usize..4, k8 in 1usize..80, m in 1usize..300,
        rot2 in 1usize..9, seed in any::<u64>(),
    )| {
        let (op, mut ins) = query_case(seed, n, nh, 8 * k8, 2 * rot2, m);
        ins[0] = sixteen_bits(&ins[0]);
        check(&gpu, &op, &ins, dot_tol(8 * k8, U_RMS, U_RMS)).map_err(TestCaseError::fail)?;
        let (op, mut ins) = value_case(seed, n, nh, 8 * k8, m);
        ins[0] = sixteen_bits(&ins[0]);
        check(&gpu, &op, &ins, dot_tol(8 * k8, U_RMS, U_RMS)).map_err(TestCaseError::fail)?;
    });
    let (op, mut ins) = value_case(9, 1000, 32, 512, 128);
    ins[0] = sixteen_bits(&ins[0]);
    let r = check(&gpu, &op, &ins, dot_tol(512, U_RMS, U_RMS)).expect("parity");
    report("mla_value_out n=1000, 16-bit inputs", &r);
}

#[test]
fn the_per_head_products_give_the_same_bits_on_every_run() {
    let Some(gpu) = test_gpu() else { return };
    for n in [5, 100, 1000] {
        let (op, ins) = query_case(1, n, 32, 128, 64, 512);
        let a = run_gpu(&gpu, &op, &ins).expect("first run");
        let b = run_gpu(&gpu, &op, &ins).expect("second run");
        assert!(a[0].1 == b[0].1, "mla_query n={n}: two runs differ");
        let (op, ins) = value_case(1, n, 32, 512, 128);
        let a = run_gpu(&gpu, &op, &ins).expect("first run");
        let b = run_gpu(&gpu, &op, &ins).expect("second run");
        assert!(a[0].1 == b[0].1, "mla_value_out n={n}: two runs differ");
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
        block_size: 4,
        kernel: AttentionPath::SplitK,
    };
    let e = run_gpu(&gpu, &op, &attention_inputs(1, 2, 6, 4, 4, &[1])).unwrap_err();
    assert!(
        matches!(e, OpError::Shape { .. }) && e.to_string().contains("multiples of 4"),
        "{e}"
    );
    // A cache block that is not a power of two (the kernels map positions with shifts), on
    // both kernels; the CPU reference takes it.
    for kernel in [AttentionPath::SplitK, AttentionPath::Flash] {
        let op = MlaAttention {
            n_head: 2,
            kv_lora: 64,
            kq_scale: 0.1,
            block_size: 3,
            kernel,
        };
        let ins = attention_inputs(1, 2, 128, 6, 3, &[4]);
        let e = run_gpu(&gpu, &op, &ins).unwrap_err();
        assert!(
            matches!(e, OpError::Shape { .. }) && e.to_string().contains("power-of-two"),
            "{kernel:?}: {e}"
        );
        assert!(run_cpu(&op, &ins).is_ok());
    }
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
const MLA_SOURCE: &str = concat!(
    include_str!("../src/dequant/dequant.cuh"),
    include_str!("../src/mla/mla.cu"),
    include_str!("../src/mla/mla_attention.cu")
);

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

/// What [`time_attention`] does with its case: time every kernel, or launch the default one
/// twice without a graph, so a profiler's kernel filter sees exactly those launches.
#[derive(Clone, Copy, PartialEq)]
enum Timing {
    Table,
    TwoLaunchesForAProfiler,
}

/// A kernel [`time_attention`] times beside the op's own.
#[derive(Clone, Copy)]
enum Timed {
    Split(AttentionKernel),
    Warpgroup,
}

/// Times the attention of `n` tokens from `first_pos` over one sequence's `bucket` positions,
/// the cache stored as `cache` (F32, or F16 as the lowering stores it for the f16 kernels:
/// only those kernels then run, and the warpgroup kernel where the shape allows it). Per call
/// one of enough caches of `bucket` rows that the rows read exceed the 60 MB L2: the op on the
/// lowering's kernel, then each other kernel.
fn time_attention(
    gpu: &GpuCtx,
    n: usize,
    first_pos: usize,
    bucket: usize,
    cache: DType,
    timing: Timing,
) {
    let w = 576;
    let cache_f16 = cache == DType::F16;
    let mut op = real_attention_for(n, w);
    if cache_f16 && op.kernel == AttentionPath::SplitK {
        // The lowering pairs an F16 cache with the f16-operand split kernel.
        op.kernel = AttentionPath::SplitKF16;
    }
    let rows = first_pos + n;
    let row_bytes = w * if cache_f16 { 2 } else { 4 };
    let layers = (150usize << 20).div_ceil(rows * row_bytes).clamp(2, 64);
    let mut r = Rng::new(77);
    let layer = r.vec(bucket * w, -1.0, 1.0);
    let lb: Vec<u8> = if cache_f16 {
        layer
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect()
    } else {
        layer.iter().flat_map(|v| v.to_le_bytes()).collect()
    };
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
    // One sequence over the bucket, its blocks in order.
    let blocks = bucket / BLOCK;
    let table: Vec<u8> = (0..blocks as i32).flat_map(|b| b.to_le_bytes()).collect();
    let tb = upload(gpu, &table);
    let rb = upload(gpu, &vec![0u8; n * 4]);
    let out = upload(gpu, &vec![0u8; n * 32 * 512 * 4]);
    let (qm, cm, pm, tm, rm, om) = (
        TensorMeta::f32([n, 32, w]),
        TensorMeta::new([bucket, w], cache),
        TensorMeta::i32([n]),
        TensorMeta::i32([1, blocks]),
        TensorMeta::i32([n]),
        TensorMeta::f32([n, 32, 512]),
    );
    let sbytes = op.cuda_scratch_bytes(&[&qm, &cm, &pm, &tm, &rm]);
    let scratch = upload(gpu, &vec![0u8; sbytes.max(16)]);
    let default = attention_tile(n, bucket, 32);
    // One launch over layer copy i % layers: the op's own kernels, or `kernel`.
    // One launch over layer copy i % layers: the op's own kernels (None), a split kernel, or
    // the warpgroup one.
    let launch = |kernel: Option<Timed>, i: usize| {
        let ins = [
            view(&qm, &q),
            view(&cm, &caches[i % layers]),
            view(&pm, &pb),
            view(&tm, &tb),
            view(&rm, &rb),
        ];
        let outs = [view(&om, &out)];
        let scratch = Scratch {
            ptr: scratch.device_ptr(),
            bytes: sbytes,
        };
        match kernel {
            None => op.cuda(gpu, &ins, &outs, scratch),
            Some(Timed::Split(k)) => op.cuda_with(gpu, &ins, &outs, scratch, k),
            Some(Timed::Warpgroup) => op.cuda_wg(gpu, &ins, &outs, scratch),
        }
    };
    if timing == Timing::TwoLaunchesForAProfiler {
        for i in 0..2 {
            launch(None, i).expect("attention launch");
        }
        gpu.device.synchronize().expect("synchronize");
        return;
    }
    let kernels = KERNELS
        .into_iter()
        .filter(|k| !cache_f16 || k.products == SplitProducts::F16);
    for kernel in std::iter::once(None).chain(kernels.map(Some)) {
        let call = |i: usize| launch(kernel.map(Timed::Split), i);
        let us = time_us(gpu, 4 * layers, &call);
        // Rows read: the union over the tokens (each token's rows are read by its own blocks,
        // from L2 after the first); Q, the output and the partials written and read back.
        let bytes = (rows * row_bytes + n * 32 * w * 4 + n * 32 * 512 * 4 + 2 * sbytes) as f64;
        let flops: f64 = (0..n)
            .map(|i| 2.0 * 32.0 * (first_pos + i + 1) as f64 * (576.0 + 512.0))
            .sum();
        let which = match kernel {
            None if op.kernel == AttentionPath::Flash => "default (flash)".to_string(),
            None => format!("default (tile={default})"),
            Some(k) => format!("tile={} {:?}", k.tile, k.products),
        };
        line(
            &format!(
                "mla_attention n={n} rows={rows} bucket={bucket} {cache:?} cache {which} ({} chunks)",
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
    if cache_f16 && op.wg_supports(w) {
        let us = time_us(gpu, 4 * layers, &|i: usize| {
            launch(Some(Timed::Warpgroup), i)
        });
        let bytes = (rows * row_bytes + n * 32 * w * 4 + n * 32 * 512 * 4 + 2 * sbytes) as f64;
        line(
            &format!(
                "mla_attention n={n} rows={rows} bucket={bucket} {cache:?} cache wg ({} chunks)",
                attention_chunks(n, bucket, 32)
            ),
            us,
            bytes,
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

/// How a per-head product is launched: through the op (on the variant the lowering would give
/// it, [`support::head_for`]), or one kernel of mla.cu directly: the f32 SIMT `head_gemm_bf16`
/// the tensor-core kernels replaced, or one `head_mma_bf16_*` tile shape (tokens x outputs)
/// with a fixed number of column tiles a block.
#[derive(Clone, Copy, Debug)]
enum HeadKernel {
    Op,
    SimtGemm,
    Mma(&'static str, usize, usize, usize),
}

const MMA_128: &str = "head_mma_bf16_128x128";
const MMA_64: &str = "head_mma_bf16_64x128";

/// The strided product of mla.rs's `head_gemv`, launched directly.
struct HeadLaunch {
    w: u64,
    x: u64,
    x_tok: usize,
    x_head: usize,
    y: u64,
    y_tok: usize,
    y_head: usize,
    n: usize,
    n_head: usize,
    n_out: usize,
    n_in: usize,
    /// Positions, (n_rot, src, dst) and constants of `MlaQuery`'s rope column.
    rope: Option<(u64, usize, usize, usize, RopeConsts)>,
}

fn launch_head(gpu: &GpuCtx, kernel: HeadKernel, a: &HeadLaunch) -> Result<(), OpError> {
    let (name, bm, bn, per_block) = match kernel {
        HeadKernel::SimtGemm => ("head_gemm_bf16", 64, 64, 1),
        HeadKernel::Mma(name, bm, bn, per_block) => (name, bm, bn, per_block),
        HeadKernel::Op => {
            return Err(OpError::Type("the op launches itself".into()));
        }
    };
    let kern = gpu.kernel("mla.cu", MLA_SOURCE, name)?;
    let none = RopeConsts {
        theta_scale: 0.0,
        freq_scale: 0.0,
        ext_factor: 0.0,
        corr: [0.0; 2],
        mscale: 0.0,
    };
    let (pos, rn, rs, rd, k) = a.rope.unwrap_or((0, 0, 0, 0, none));
    let tiles = a.n_out.div_ceil(bn);
    let per_block = per_block.min(tiles);
    let mma = matches!(kernel, HeadKernel::Mma(..));
    let smem = if mma {
        3 * (bm * 40 * 4 + bn * 40 * 2)
    } else {
        0
    };
    let l = gpu
        .device
        .launch(&kern)
        .grid((
            (tiles.div_ceil(per_block) + usize::from(rn > 0)) as u32,
            a.n_head as u32,
            a.n.div_ceil(bm) as u32,
        ))
        .block(256)
        .shared_mem(smem as u32)
        .arg(a.w)
        .arg(a.x)
        .arg(a.x_tok as i64)
        .arg(a.x_head as i64)
        .arg(a.y)
        .arg(a.y_tok as i64)
        .arg(a.y_head as i64)
        .arg(a.n as i32)
        .arg(a.n_out as i32)
        .arg(a.n_in as i32)
        .arg(tiles as i32);
    let l = if mma {
        let x_vec =
            a.x.is_multiple_of(16) && a.x_tok.is_multiple_of(4) && a.x_head.is_multiple_of(4);
        let y_vec =
            a.y.is_multiple_of(8) && a.y_tok.is_multiple_of(2) && a.y_head.is_multiple_of(2);
        l.arg(per_block as i32)
            .arg(i32::from(x_vec))
            .arg(i32::from(y_vec))
    } else {
        l
    };
    let l = l
        .arg(pos)
        .arg(rn as i32)
        .arg(rs as i32)
        .arg(rd as i32)
        .arg(k.theta_scale)
        .arg(k.freq_scale)
        .arg(k.ext_factor)
        .arg(k.corr[0])
        .arg(k.corr[1])
        .arg(k.mscale);
    // The tiles over the whole K (one part, no partial sums).
    let l = if mma { l.arg(1i32).arg(0u64) } else { l };
    // SAFETY: the argument lists of head_gemm_bf16 and HEAD_MMA_KERNEL, with mla.rs's
    // alignment rule for the vector accesses; the buffers hold the shapes described.
    unsafe { l.enqueue().map_err(|e| OpError::Type(e.to_string())) }
}

#[derive(Clone, Debug)]
enum HeadOp {
    Query(MlaQuery),
    Value(MlaValueOut),
}

impl HeadOp {
    fn op(&self) -> &dyn Op {
        match self {
            HeadOp::Query(q) => q,
            HeadOp::Value(v) => v,
        }
    }

    fn launch(&self, inputs: &[DeviceTensor<'_>], y: u64) -> HeadLaunch {
        match self {
            HeadOp::Query(q) => {
                let (qk, w) = (q.qk_nope + q.qk_rope, q.kv_lora + q.qk_rope);
                HeadLaunch {
                    w: inputs[1].ptr,
                    x: inputs[0].ptr,
                    x_tok: q.n_head * qk,
                    x_head: qk,
                    y,
                    y_tok: q.n_head * w,
                    y_head: w,
                    n: inputs[2].meta.shape[0],
                    n_head: q.n_head,
                    n_out: q.kv_lora,
                    n_in: q.qk_nope,
                    rope: Some((
                        inputs[2].ptr,
                        q.qk_rope,
                        q.qk_nope,
                        q.kv_lora,
                        q.rope.consts(),
                    )),
                }
            }
            HeadOp::Value(v) => HeadLaunch {
                w: inputs[1].ptr,
                x: inputs[0].ptr,
                x_tok: v.n_head * v.kv_lora,
                x_head: v.kv_lora,
                y,
                y_tok: v.n_head * v.v_head,
                y_head: v.v_head,
                n: inputs[0].meta.shape[0],
                n_head: v.n_head,
                n_out: v.v_head,
                n_in: v.kv_lora,
                rope: None,
            },
        }
    }
}

/// A per-head product on one kernel of mla.cu, the CPU reference the op's.
#[derive(Debug)]
struct Forced(HeadOp, HeadKernel);

impl Op for Forced {
    fn name(&self) -> &'static str {
        self.0.op().name()
    }
    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        self.0.op().infer(inputs)
    }
    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        self.0.op().cpu(inputs, outputs)
    }
    fn describe(&self) -> String {
        format!("{} {:?}", self.0.op().describe(), self.1)
    }
    fn cuda(
        &self,
        ctx: &GpuCtx,
        inputs: &[DeviceTensor<'_>],
        outputs: &[DeviceTensor<'_>],
        _scratch: Scratch,
    ) -> Result<(), OpError> {
        launch_head(ctx, self.1, &self.0.launch(inputs, outputs[0].ptr))
    }
}

#[test]
fn every_tile_and_column_grouping_gives_the_same_bits() {
    let Some(gpu) = test_gpu() else { return };
    // Every output's sum over the whole K runs in one order whatever the tile or the column
    // tiles a block runs, so the forced kernels must agree bit for bit with each other. The
    // op itself may split K into the block slots few tiles leave empty (the value product at
    // 9..128 tokens): its partial sums are added in a fixed order, so it is checked against
    // the CPU and against its own second run. Column tiles of 128: 5 (an unaligned q row:
    // 4-byte loads), 4 (the real query) and 3 (a k of 520, not a whole number of 32-slices).
    let cases = [
        query_case(1, 200, 2, 24, 6, 600),
        query_case(2, 300, 32, 128, 64, 512),
    ]
    .map(|(op, ins)| (HeadOp::Query(op), ins))
    .into_iter()
    .chain(
        [
            value_case(3, 150, 3, 520, 300),
            value_case(4, 40, 32, 512, 128),
        ]
        .map(|(op, ins)| (HeadOp::Value(op), ins)),
    );
    for (op, ins) in cases {
        let k = match &op {
            HeadOp::Query(q) => q.qk_nope,
            HeadOp::Value(v) => v.kv_lora,
        };
        let n = ins[0].meta.shape[0];
        let r = check(&gpu, op.op(), &ins, head_tol(n, k)).expect("parity");
        report(&op.op().describe(), &r);
        let first = run_gpu(&gpu, op.op(), &ins).expect("op");
        let again = run_gpu(&gpu, op.op(), &ins).expect("op");
        assert!(
            first[0].1 == again[0].1,
            "{}: two runs differ",
            op.op().describe()
        );
        let tiles = match &op {
            HeadOp::Query(q) => q.kv_lora.div_ceil(128),
            HeadOp::Value(v) => v.v_head.div_ceil(128),
        };
        let mut want = None;
        for (name, bm) in [(MMA_128, 128), (MMA_64, 64)] {
            for per_block in 1..=tiles {
                let f = Forced(op.clone(), HeadKernel::Mma(name, bm, 128, per_block));
                let got = run_gpu(&gpu, &f, &ins).expect("forced kernel");
                let want = want.get_or_insert_with(|| got[0].1.clone());
                assert!(
                    &got[0].1 == want,
                    "{}: not the first tile's bits",
                    f.describe()
                );
            }
        }
    }
}

/// One line per kernel: `mla_query` (128 -> 512 a head, with the rope) or `mla_value_out`
/// (512 -> 128) of n tokens x 32 heads; TFLOP/s count the product's 2·n·32·512·128.
fn time_head_products(gpu: &GpuCtx, n: usize, value_out: bool, kernels: &[HeadKernel]) {
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
        kernel: head_for(n),
    };
    let v_op = MlaValueOut {
        n_head: nh,
        kv_lora: lora,
        v_head: 128,
        kernel: head_for(n),
    };
    let name = if value_out {
        "mla_value_out"
    } else {
        "mla_query"
    };
    for &kernel in kernels {
        let call = |i: usize| {
            let w = view(&wm, &ws[i % copies]);
            if let HeadKernel::Op = kernel {
                return if value_out {
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
                };
            }
            let (x_w1, y_w1) = (x_w / nh, y_w / nh);
            let rope = (!value_out).then(|| (p.device_ptr(), 64, 128, 512, q_op.rope.consts()));
            launch_head(
                gpu,
                kernel,
                &HeadLaunch {
                    w: w.ptr,
                    x: x.device_ptr(),
                    x_tok: x_w,
                    x_head: x_w1,
                    y: y.device_ptr(),
                    y_tok: y_w,
                    y_head: y_w1,
                    n,
                    n_head: nh,
                    n_out,
                    n_in,
                    rope,
                },
            )
        };
        let us = time_us(gpu, 4 * copies, &call);
        let bytes = (wbytes.len() + xb.len() + n * y_w * 4) as f64;
        let which = match kernel {
            HeadKernel::Op => "op".to_string(),
            HeadKernel::SimtGemm => "old head_gemm_bf16".to_string(),
            HeadKernel::Mma(name, .., per_block) => format!("{name} cols/block {per_block}"),
        };
        println!(
            "{:<48} {us:>9.2} µs {:>6.1} TFLOP/s {:>6.0} GB/s",
            format!("{name} n={n} {which}"),
            2.0 * (n * nh * n_in * n_out) as f64 / us / 1e6,
            bytes / us / 1e3
        );
    }
}

#[test]
#[ignore = "timing table at the real shapes: run on the GPU host with --include-ignored"]
fn per_head_product_timings_at_the_real_shapes() {
    let Some(gpu) = test_gpu() else { return };
    for value_out in [false, true] {
        time_head_products(&gpu, 1, value_out, &[HeadKernel::Op]);
        for n in [16, 64, 256, 512, 1024, 2048] {
            let mut kernels = vec![HeadKernel::Op, HeadKernel::SimtGemm];
            // The query has 4 column tiles of 128 outputs, the value output one.
            for per_block in if value_out { vec![1] } else { vec![1, 2, 4] } {
                kernels.push(HeadKernel::Mma(MMA_128, 128, 128, per_block));
                kernels.push(HeadKernel::Mma(MMA_64, 64, 128, per_block));
            }
            time_head_products(&gpu, n, value_out, &kernels);
        }
    }
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
        time_kv(&gpu, n);
    }
    // Decode at the buckets' sizes: rows = pos + 1, the bucket the next power of two.
    // Over the F16 cache the lowering stores by default, then over an F32 one.
    for cache in [DType::F16, DType::F32] {
        for rows in [512usize, 4224, 16448, 32832, 65600, 131072] {
            time_attention(
                &gpu,
                1,
                rows - 1,
                rows.next_power_of_two(),
                cache,
                Timing::Table,
            );
        }
        // A batched decode step's shape: 32 tokens at ~544 positions each.
        time_attention(&gpu, 32, 512, 1024, cache, Timing::Table);
    }
    // Prefill chunks of 512 tokens (one chunk a token, no combine).
    time_attention(&gpu, 512, 0, 4096, DType::F32, Timing::Table);
    time_attention(&gpu, 512, 3584, 4096, DType::F32, Timing::Table);
}

/// One sequence's decode attention at 131,072 positions over the F16 cache, two launches of the
/// default kernels and nothing else on the device: the case for a profiler's report
/// (`scripts/gpu-batch-ab`'s NCU) of where the long-context split kernel spends its time.
#[test]
#[ignore = "a profiler's case: run on the GPU host under ncu with --include-ignored"]
fn long_context_attention_launched_for_a_profiler() {
    let Some(gpu) = test_gpu() else { return };
    time_attention(
        &gpu,
        1,
        131071,
        131072,
        DType::F16,
        Timing::TwoLaunchesForAProfiler,
    );
}

fn time_us(gpu: &GpuCtx, reps: usize, call: &dyn Fn(usize) -> Result<(), OpError>) -> f64 {
    ops::parity::time_calls_us(gpu, reps, call).expect("timing")
}
