//! The MLA family's parity cases at the real Xing4.0 shapes (32 heads, nope 128, rope 64,
//! kv_lora 512, v_head 128): `mla_query` and `mla_value_out` on the GEMV (one token) and the
//! tensor cores (64 tokens), `mla_kv_cache_write` for a decode token and a prefill chunk,
//! `mla_attention` on the split-K kernel (decode over a long cache, a few tokens, a chunk) and
//! the flash kernel (a 64-token chunk, the width it supports).
//!
//! Bounds. Per-head GEMV: [`nmse_f32_dot`] of the dot length. Per-head tensor cores: the
//! tests' `head_tol` adds `6·√k·rms²·2⁻¹⁶` (the hi/lo split) to `dot_tol`, against outputs of
//! rms `√k·rms²`. The cache write: [`NMSE_F32`] (rope and norm as the reference rounds them).
//! Attention: the tests' `ATT_TOL` (rel 1e-5, abs 3e-5) for split-K and `PREFILL_TOL` (rel
//! 4e-3, abs 1.5e-3) for flash, against an output of rms `rms(v)/√n_eff`, `n_eff` the rows a
//! query reads over e^σ² (σ ≈ 1.16, the scores' spread at these widths) — the longest reach
//! taken, the smallest output and so the loosest bound.

use half::bf16;

use super::{
    AttentionPath, HeadKernel, KvCacheWrite, MlaAttention, MlaKv, MlaKvCacheWrite, MlaQuery,
    MlaQueryKv, MlaValueOut, f16_saturated,
};
use crate::parity::{
    HostValue, NMSE_F32, ParityCase, Rng, nmse_bound, nmse_f32_dot, uniform, weight,
};
use crate::rope::{RopeParams, Yarn};
use crate::tensor::{DType, TensorMeta};

/// `v` (an f32 cache) as the F16 cache the lowering stores: each value rounded and saturated
/// as the writers store it.
fn f16_cache(v: HostValue) -> HostValue {
    let bytes: Vec<u8> = v
        .data
        .bytes()
        .chunks_exact(4)
        .flat_map(|b| f16_saturated(f32::from_le_bytes([b[0], b[1], b[2], b[3]])).to_le_bytes())
        .collect();
    HostValue::from_bytes(TensorMeta::new(v.meta.shape.clone(), DType::F16), &bytes)
}

/// Input `at` of `ins` (the cache) narrowed to F16 when `f16` is set.
fn with_cache(mut ins: Vec<HostValue>, at: usize, f16: bool) -> Vec<HostValue> {
    if f16 {
        let c = ins[at].clone();
        ins[at] = f16_cache(c);
    }
    ins
}

const NH: usize = 32;
const NOPE: usize = 128;
const ROT: usize = 64;
const LORA: usize = 512;
const VH: usize = 128;
const W: usize = LORA + ROT;
/// The model's softmax scale (1/√192 with the YaRN magnitude).
const KQ_SCALE: f32 = 0.144_679_63;
/// rms of U(−1, 1).
const U_RMS: f64 = 0.577_350_3;

/// The released model's YaRN block over `n_rot` rotated dims.
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

fn bf16_weight(r: &mut Rng, shape: [usize; 3]) -> HostValue {
    let n: usize = shape.iter().product();
    let bytes: Vec<u8> = (0..n)
        .flat_map(|_| bf16::from_f32(r.uniform(-1.0, 1.0)).to_le_bytes())
        .collect();
    HostValue::from_bytes(TensorMeta::new(shape, DType::BF16), &bytes)
}

fn head_kernel(n: usize) -> HeadKernel {
    if n <= super::HEAD_GEMV_ROWS_LIMIT {
        HeadKernel::Gemv
    } else {
        HeadKernel::TensorCore
    }
}

fn head_bound(kernel: HeadKernel, k: usize) -> f64 {
    if kernel == HeadKernel::Gemv {
        return nmse_f32_dot(k);
    }
    let dot = 16.0 * (k as f64).sqrt() * f64::from(f32::EPSILON);
    nmse_bound(1e-5, dot + 6.0 * 2f64.powi(-16))
}

fn head_label(kernel: HeadKernel) -> &'static str {
    if kernel == HeadKernel::Gemv {
        "gemv"
    } else {
        "tensor-core"
    }
}

/// The attention bound for `rel`/`abs` over queries reading at most `rows` rows.
fn attention_bound(rel: f64, abs: f64, rows: usize) -> f64 {
    let n_eff = (rows as f64 / 1.16f64.powi(2).exp()).max(1.0);
    nmse_bound(rel, abs / (U_RMS / n_eff.sqrt()))
}

/// The NMSE bound of an attention path over `rows` rows: f32-class for the split products,
/// f16-class for the kernels with f16 operands.
fn attention_path_bound(kernel: AttentionPath, rows: usize) -> f64 {
    match kernel {
        AttentionPath::Flash | AttentionPath::SplitKF16 | AttentionPath::FlashThenSplit { .. } => {
            attention_bound(4e-3, 1.5e-3, rows)
        }
        _ => attention_bound(1e-5, 3e-5, rows),
    }
}

fn attention_path_name(kernel: AttentionPath) -> &'static str {
    match kernel {
        AttentionPath::Flash => "flash",
        AttentionPath::SplitKF16 => "split-k f16",
        AttentionPath::FlashThenSplit { f16: true, .. } => "flash then split-k f16",
        AttentionPath::FlashThenSplit { f16: false, .. } => "flash then split-k",
        _ => "split-k",
    }
}

/// The attention op the cases run, over [`BLOCK`]-position blocks.
fn attention_op(kernel: AttentionPath) -> MlaAttention {
    MlaAttention {
        n_head: NH,
        kv_lora: LORA,
        kq_scale: KQ_SCALE,
        block_size: BLOCK,
        kernel,
    }
}

/// Q, a cache of U(−1, 1) whose rows past every position are NaN (a read past a position
/// shows), the positions.
/// Positions of a cache block in these cases (the engine's).
const BLOCK: usize = 64;

/// One sequence over pool rows `0..ctx` in order; rows past the last position are NaN, so a
/// kernel reading one shows.
fn attention_inputs(r: &mut Rng, ctx: usize, pos: &[i32]) -> Vec<HostValue> {
    let n = pos.len();
    let last = pos.iter().copied().max().unwrap_or(0).max(0) as usize;
    let mut cache = r.vec(ctx * W, -1.0, 1.0);
    for v in cache.iter_mut().skip((last + 1) * W) {
        *v = f32::NAN;
    }
    let blocks = ctx.div_ceil(BLOCK);
    vec![
        uniform(r, &[n, NH, W], -1.0, 1.0),
        HostValue::f32([ctx, W], &cache),
        HostValue::i32([n], pos),
        HostValue::i32([1, blocks], &(0..blocks as i32).collect::<Vec<_>>()),
        HostValue::i32([n], &vec![0; n]),
    ]
}

/// Rows `(sequence, position)` over a pool whose blocks are handed out in a shuffled order:
/// each sequence's table names its own blocks, the table is `width` wide (unused entries
/// name a spare block), and every pool row no sequence may read is NaN.
fn paged_attention_inputs(r: &mut Rng, rows: &[(i32, i32)], width: usize) -> Vec<HostValue> {
    let n = rows.len();
    let seqs = rows.iter().map(|&(s, _)| s).max().unwrap_or(0) as usize + 1;
    let need: Vec<usize> = (0..seqs)
        .map(|s| {
            let last = rows
                .iter()
                .filter(|&&(q, _)| q as usize == s)
                .map(|&(_, p)| p)
                .max()
                .unwrap_or(0);
            last as usize / BLOCK + 1
        })
        .collect();
    let pool_blocks = need.iter().sum::<usize>() + 2;
    // A Fisher–Yates shuffle of the pool's blocks.
    let mut order: Vec<i32> = (0..pool_blocks as i32).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, r.below(i + 1));
    }
    let spare = order[pool_blocks - 1];
    let mut table = vec![spare; seqs * width];
    let mut cache = vec![f32::NAN; pool_blocks * BLOCK * W];
    let mut next = 0;
    for s in 0..seqs {
        let last = rows
            .iter()
            .filter(|&&(q, _)| q as usize == s)
            .map(|&(_, p)| p as usize)
            .max()
            .unwrap_or(0);
        for b in 0..need[s] {
            let block = order[next] as usize;
            next += 1;
            table[s * width + b] = block as i32;
            for p in b * BLOCK..((b + 1) * BLOCK).min(last + 1) {
                let row = block * BLOCK + p % BLOCK;
                for v in &mut cache[row * W..(row + 1) * W] {
                    *v = r.uniform(-1.0, 1.0);
                }
            }
        }
    }
    let pos: Vec<i32> = rows.iter().map(|&(_, p)| p).collect();
    let row_seq: Vec<i32> = rows.iter().map(|&(s, _)| s).collect();
    vec![
        uniform(r, &[n, NH, W], -1.0, 1.0),
        HostValue::f32([pool_blocks * BLOCK, W], &cache),
        HostValue::i32([n], &pos),
        HostValue::i32([seqs, width], &table),
        HostValue::i32([n], &row_seq),
    ]
}

pub fn cases() -> Vec<ParityCase> {
    let mut v = Vec::new();
    for n in [1, 64] {
        let kernel = head_kernel(n);
        v.push(ParityCase::new(
            format!("mla_query/{} n={n}", head_label(kernel)),
            MlaQuery {
                n_head: NH,
                qk_nope: NOPE,
                qk_rope: ROT,
                kv_lora: LORA,
                rope: rope(ROT),
                kernel,
            },
            11 + n as u64,
            head_bound(kernel, NOPE),
            move |r| {
                let q = uniform(r, &[n, NH * (NOPE + ROT)], -1.0, 1.0);
                let kb = bf16_weight(r, [NH, LORA, NOPE]);
                let pos: Vec<i32> = (0..n).map(|_| r.below(1 << 18) as i32).collect();
                vec![q, kb, HostValue::i32([n], &pos)]
            },
        ));
        v.push(ParityCase::new(
            format!("mla_value_out/{} n={n}", head_label(kernel)),
            MlaValueOut {
                n_head: NH,
                kv_lora: LORA,
                v_head: VH,
                kernel,
            },
            3 + n as u64,
            head_bound(kernel, LORA),
            move |r| {
                let o = uniform(r, &[n, NH, LORA], -1.0, 1.0);
                vec![o, bf16_weight(r, [NH, VH, LORA])]
            },
        ));
    }
    // Per-head weights in the other types the CPU reads (a Q8_0 or F16 conversion keeps
    // attn_k_b/attn_v_b in them): the generic kernel, a decode token and a prefill chunk.
    for (dtype, n) in [(DType::F16, 1), (DType::Q8_0, 37), (DType::F32, 3)] {
        let kernel = HeadKernel::Generic;
        v.push(ParityCase::new(
            format!("mla_query/generic {dtype} n={n}"),
            MlaQuery {
                n_head: 4,
                qk_nope: NOPE,
                qk_rope: ROT,
                kv_lora: LORA,
                rope: rope(ROT),
                kernel,
            },
            21 + n as u64,
            nmse_f32_dot(NOPE),
            move |r| {
                let q = uniform(r, &[n, 4 * (NOPE + ROT)], -1.0, 1.0);
                let kb = weight(r, dtype, &[4, LORA, NOPE]);
                let pos: Vec<i32> = (0..n).map(|_| r.below(1 << 18) as i32).collect();
                vec![q, kb, HostValue::i32([n], &pos)]
            },
        ));
        v.push(ParityCase::new(
            format!("mla_value_out/generic {dtype} n={n}"),
            MlaValueOut {
                n_head: 4,
                kv_lora: LORA,
                v_head: VH,
                kernel,
            },
            31 + n as u64,
            nmse_f32_dot(LORA),
            move |r| {
                let o = uniform(r, &[n, 4, LORA], -1.0, 1.0);
                vec![o, weight(r, dtype, &[4, VH, LORA])]
            },
        ));
    }
    for (n, ctx, f16) in [
        (1usize, 4096usize, false),
        (64, 1024, false),
        (1, 4096, true),
        (64, 1024, true),
    ] {
        let kv = MlaKv {
            kv_lora: LORA,
            qk_rope: ROT,
            eps: 1e-6,
            rope: rope(ROT),
        };
        // Reads kv, the norm weight and the positions; writes n rows of the cache.
        let bytes = 2 * n * W * 4 + LORA * 4 + n * 4;
        v.push(
            ParityCase::new(
                format!(
                    "mla_kv_cache_write/n={n} ctx={ctx}{}",
                    if f16 { " f16 cache" } else { "" }
                ),
                MlaKvCacheWrite { kv },
                0xcace + n as u64,
                NMSE_F32,
                move |r| {
                    let cache = uniform(r, &[ctx, W], -1.0, 1.0);
                    let kv = uniform(r, &[n, W], -3.0, 3.0);
                    let g = uniform(r, &[LORA], 0.5, 1.5);
                    // Positions may repeat (the later token wins); slots are a shuffled
                    // pool's rows, and the last token is a padding row (slot -1, no write).
                    let pos: Vec<i32> = (0..n).map(|_| r.below(ctx) as i32).collect();
                    let mut slots: Vec<i32> =
                        pos.iter().map(|&p| (ctx as i32 - 1 - p) ^ 1).collect();
                    if n > 1 {
                        slots[n - 1] = -1;
                    }
                    let (pos, slots) = (HostValue::i32([n], &pos), HostValue::i32([n], &slots));
                    with_cache(vec![cache, kv, g, pos, slots], 0, f16)
                },
            )
            .moving(bytes),
        );
    }
    // The plain row copy into an F32 and an F16 cache (the fusions off).
    for f16 in [false, true] {
        let (n, ctx) = (5usize, 256usize);
        v.push(ParityCase::new(
            format!(
                "kv_cache_write/n={n}{}",
                if f16 { " f16 cache" } else { "" }
            ),
            KvCacheWrite,
            0xc0de + u64::from(f16),
            NMSE_F32,
            move |r| {
                let cache = uniform(r, &[ctx, W], -1.0, 1.0);
                // Values past f16's range: the F16 cache saturates them.
                let k = uniform(r, &[n, W], -7e4, 7e4);
                let slots: Vec<i32> = vec![3, 200, -1, 3, 17];
                with_cache(vec![cache, k, HostValue::i32([n], &slots)], 0, f16)
            },
        ));
    }
    // The cache rows beside the query: one token, more tokens than heads (each cache block
    // takes several in turn; 4 heads), and 64 tokens (the tiles: two launches).
    for (n, nh, f16) in [
        (1usize, NH, false),
        (7, 4, false),
        (64, NH, false),
        (1, NH, true),
        (7, 4, true),
        (64, NH, true),
    ] {
        let kernel = head_kernel(n);
        let ctx = 1024;
        v.push(ParityCase::new(
            format!(
                "mla_query_kv/{} n={n} heads={nh}{}",
                head_label(kernel),
                if f16 { " f16 cache" } else { "" }
            ),
            MlaQueryKv {
                query: MlaQuery {
                    n_head: nh,
                    qk_nope: NOPE,
                    qk_rope: ROT,
                    kv_lora: LORA,
                    rope: rope(ROT),
                    kernel,
                },
                kv: MlaKv {
                    kv_lora: LORA,
                    qk_rope: ROT,
                    eps: 1e-6,
                    rope: rope(ROT),
                },
            },
            0x9e7 + n as u64,
            head_bound(kernel, NOPE),
            move |r| {
                let cache = uniform(r, &[ctx, W], -1.0, 1.0);
                let kv = uniform(r, &[n, W], -3.0, 3.0);
                let g = uniform(r, &[LORA], 0.5, 1.5);
                let pos: Vec<i32> = (0..n).map(|_| r.below(ctx) as i32).collect();
                let slots: Vec<i32> = pos.iter().map(|&p| (ctx as i32 - 1 - p) ^ 1).collect();
                let q = uniform(r, &[n, nh * (NOPE + ROT)], -1.0, 1.0);
                let kb = bf16_weight(r, [nh, LORA, NOPE]);
                let (pos, slots) = (HostValue::i32([n], &pos), HostValue::i32([n], &slots));
                with_cache(vec![cache, kv, g, pos, slots, q, kb], 0, f16)
            },
        ));
    }
    let split = |name: &str, ctx: usize, pos: Vec<i32>, kernel: AttentionPath, f16: bool| {
        let n = pos.len();
        let rows = pos.iter().copied().max().unwrap_or(0) as usize + 1;
        let bound = attention_path_bound(kernel, rows);
        let path = attention_path_name(kernel);
        // Q, the rows up to the last position, the output.
        let bytes = n * NH * W * 4 + rows * W * 4 + n * NH * LORA * 4;
        ParityCase::new(
            format!(
                "mla_attention/{path} {name} n={n} ctx={ctx}{}",
                if f16 { " f16 cache" } else { "" }
            ),
            attention_op(kernel),
            pos[0] as u64 + 1,
            bound,
            move |r| with_cache(attention_inputs(r, ctx, &pos), 1, f16),
        )
        .moving(bytes)
    };
    // Several sequences in one step over shuffled blocks: a decode batch (one row each, one
    // of them a padding row at position 0 of a sequence of its own) and a mixed step (decode
    // rows, then a chunk of a third sequence).
    let paged =
        |name: &str, rows: Vec<(i32, i32)>, width: usize, kernel: AttentionPath, f16: bool| {
            let n = rows.len();
            let reach = rows.iter().map(|&(_, p)| p).max().unwrap_or(0) as usize + 1;
            let bytes: usize = n * NH * W * 4
                + rows
                    .iter()
                    .map(|&(_, p)| (p as usize + 1) * W * 4)
                    .sum::<usize>()
                    / n.max(1)
                + n * NH * LORA * 4;
            ParityCase::new(
                format!(
                    "mla_attention/{} paged {name} n={n}{}",
                    attention_path_name(kernel),
                    if f16 { " f16 cache" } else { "" }
                ),
                attention_op(kernel),
                0x9a6e + n as u64,
                attention_path_bound(kernel, reach),
                move |r| with_cache(paged_attention_inputs(r, &rows, width), 1, f16),
            )
            .moving(bytes)
        };
    // The f16 kernels over the F32 cache, and over the F16 cache the lowering stores for them.
    for (kernel, fc) in [
        (AttentionPath::SplitK, false),
        (AttentionPath::SplitKF16, false),
        (AttentionPath::SplitKF16, true),
    ] {
        v.push(paged(
            "decode batch",
            vec![(0, 700), (1, 63), (2, 64), (3, 2999), (4, 0)],
            64,
            kernel,
            fc,
        ));
        let mut mixed = vec![(0, 130), (1, 1100)];
        mixed.extend((200..232).map(|p| (2, p)));
        v.push(paged("mixed step", mixed, 32, kernel, fc));
        // A mixed step as the engine lays it out: a 300-token chunk of the table's first
        // sequence, then one decode row of each of four others (one at position 0).
        let mut mixed: Vec<(i32, i32)> = (700..1000).map(|p| (0, p)).collect();
        mixed.extend([(1, 63), (2, 2999), (3, 64), (4, 0)]);
        let f16 = kernel == AttentionPath::SplitKF16;
        v.push(paged(
            "chunk then decode rows",
            mixed,
            64,
            AttentionPath::FlashThenSplit { lead: 300, f16 },
            fc,
        ));
        // A short chunk deep in its sequence beside decode rows: the flash launch splits the
        // chunk's keys over the chip (40 tokens × 32 heads: 20 blocks, 6 splits).
        let mut mixed: Vec<(i32, i32)> = (1960..2000).map(|p| (0, p)).collect();
        mixed.extend([(1, 5), (2, 1999)]);
        v.push(paged(
            "short chunk then decode rows",
            mixed,
            64,
            AttentionPath::FlashThenSplit { lead: 40, f16 },
            fc,
        ));
        // 24 sequences over tables of 512 positions: 5 chunks a token, merged by the
        // few-chunk combine.
        let batch: Vec<(i32, i32)> = (0..24).map(|s| (s, 40 + 19 * s)).collect();
        v.push(paged("decode batch of 24", batch, 8, kernel, fc));
        // 8 sequences over tables of 832 positions: 16 chunks a token, the few-chunk
        // combine's widest.
        let batch: Vec<(i32, i32)> = (0..8).map(|s| (s, 500 + 37 * s)).collect();
        v.push(paged("decode batch of 8", batch, 13, kernel, fc));
    }
    // The f32-class split kernel, the f16 one, and the f16 one over the F16 cache the
    // lowering stores for it.
    for (kernel, f16) in [
        (AttentionPath::SplitK, false),
        (AttentionPath::SplitKF16, false),
        (AttentionPath::SplitKF16, true),
    ] {
        v.push(split("decode", 8192, vec![3000], kernel, f16));
        if !f16 {
            v.push(split("decode at row 0", 8192, vec![0], kernel, f16));
        }
        v.push(split(
            "few tokens",
            4096,
            vec![4000, 17, 2048, 4095],
            kernel,
            f16,
        ));
    }
    let chunk: Vec<i32> = (960..1024).collect();
    v.push(split(
        "chunk",
        1024,
        chunk.clone(),
        AttentionPath::SplitK,
        false,
    ));
    v.push(split(
        "chunk",
        1024,
        chunk.clone(),
        AttentionPath::Flash,
        false,
    ));
    v.push(split(
        "chunk at the start",
        1024,
        (0..64).collect(),
        AttentionPath::Flash,
        false,
    ));
    v.push(split("chunk", 1024, chunk, AttentionPath::Flash, true));
    v
}
