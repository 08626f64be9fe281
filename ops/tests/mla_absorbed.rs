//! Absorbed MLA (spec §3.5, §5): the five ops chained against the expanded HF form in f64,
//! causal masking, decode against chunked prefill, attention over a paged pool against each
//! sequence's contiguous copy, and cache-write and block-table errors.

use half::bf16;
use ops::mla::{ContiguousPages, KvCacheWrite, MlaAttention, MlaKv, MlaQuery, MlaValueOut};
use ops::rope::{RopeParams, Yarn, kq_scale};
use ops::{DType, HostTensor, HostTensorMut, Op, OpError, TensorMeta};
use proptest::prelude::*;

mod support;
use ops::parity::Rng;
use support::{Buf, PagedPool, bytes_mut, run, run_into};

// ---- the model under test ----------------------------------------------------------------

const FACTOR: f64 = 4.0;

/// Positions of a cache block in the chained tests: small, so their caches span several.
const BLOCK: usize = 4;

struct Mla {
    h: usize,
    nope: usize,
    rope: usize,
    lora: usize,
    vh: usize,
    p: RopeParams,
    kb: Vec<f32>,
    vb: Vec<f32>,
    kb_buf: Buf,
    vb_buf: Buf,
    norm_w: Vec<f32>,
}

impl Mla {
    /// Random weights; with `bf16`, `Kb`/`Vb` are stored as BF16 and `kb`/`vb` hold their values.
    fn new(
        h: usize,
        nope: usize,
        rope: usize,
        lora: usize,
        vh: usize,
        bf16_weights: bool,
        rng: &mut Rng,
    ) -> Mla {
        let p = RopeParams::yarn(
            rope,
            10000.0,
            &Yarn {
                factor: FACTOR as f32,
                n_ctx_orig: 4096,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale: 1.0,
                mscale_all_dim: 1.0,
            },
        );
        let mut kb = rng.unit_vec(h * lora * nope);
        let mut vb = rng.unit_vec(h * vh * lora);
        let store = |v: &mut Vec<f32>, shape: [usize; 3]| -> Buf {
            if bf16_weights {
                let q: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
                *v = q.iter().map(|x| x.to_f32()).collect();
                let bytes: Vec<u8> = q.iter().flat_map(|x| x.to_le_bytes()).collect();
                Buf::raw(TensorMeta::new(shape, DType::BF16), &bytes)
            } else {
                Buf::f32(&shape, v)
            }
        };
        let kb_buf = store(&mut kb, [h, lora, nope]);
        let vb_buf = store(&mut vb, [h, vh, lora]);
        let norm_w = (0..lora).map(|_| 0.5 + rng.unit().abs()).collect();
        Mla {
            h,
            nope,
            rope,
            lora,
            vh,
            p,
            kb,
            vb,
            kb_buf,
            vb_buf,
            norm_w,
        }
    }

    fn w(&self) -> usize {
        self.lora + self.rope
    }

    fn q_width(&self) -> usize {
        self.h * (self.nope + self.rope)
    }

    fn scale(&self) -> f32 {
        kq_scale(&self.p, 1.0, self.nope + self.rope)
    }

    /// One chunk through MlaKv → KvCacheWrite → MlaQuery → MlaAttention → MlaValueOut, over a
    /// cache of one sequence (blocks of [`BLOCK`] in order, so its slots are its positions).
    fn chunk(&self, cache: &mut Buf, q: &[f32], kv: &[f32], pos: &[i32]) -> Vec<f32> {
        let n = pos.len();
        let posb = Buf::i32(&[n], pos);
        let pages = ContiguousPages::new(cache.meta.shape[0], BLOCK, n);
        let table = Buf::i32(&[1, pages.block_table.len()], &pages.block_table);
        let row_seq = Buf::i32(&[n], &pages.row_seq);
        let kv_op = MlaKv {
            kv_lora: self.lora,
            qk_rope: self.rope,
            eps: 1e-6,
            rope: self.p,
        };
        let norm = Buf::f32(&[self.lora], &self.norm_w);
        let k = run(&kv_op, &[&Buf::f32(&[n, self.w()], kv), &norm, &posb])
            .unwrap()
            .remove(0);
        // The executor gives input 0 and output 0 one buffer; here the output starts as the cache.
        *cache = run_into(
            &KvCacheWrite,
            &[&cache.clone(), &k, &posb],
            vec![cache.clone()],
        )
        .unwrap()
        .remove(0);
        let q_op = MlaQuery {
            n_head: self.h,
            qk_nope: self.nope,
            qk_rope: self.rope,
            kv_lora: self.lora,
            rope: self.p,
            kernel: Default::default(),
        };
        let qq = run(
            &q_op,
            &[&Buf::f32(&[n, self.q_width()], q), &self.kb_buf, &posb],
        )
        .unwrap()
        .remove(0);
        let att = MlaAttention {
            n_head: self.h,
            kv_lora: self.lora,
            kq_scale: self.scale(),
            block_size: BLOCK,
            kernel: Default::default(),
        };
        let o_lat = run(&att, &[&qq, cache, &posb, &table, &row_seq])
            .unwrap()
            .remove(0);
        let vo = MlaValueOut {
            n_head: self.h,
            kv_lora: self.lora,
            v_head: self.vh,
            kernel: Default::default(),
        };
        run(&vo, &[&o_lat, &self.vb_buf]).unwrap().remove(0).f32s()
    }

    /// The HF expanded form in f64 for the token at position `i` (tokens `0..=i` given):
    /// `k_nope = KbT·ckv`, `v = Vb·ckv`, score `(q_nope·k_nope + q_pe·k_pe)·scale`.
    fn expanded(&self, qs: &[Vec<f32>], kvs: &[Vec<f32>], i: usize) -> Vec<f64> {
        let (h, nope, rope, lora, vh) = (self.h, self.nope, self.rope, self.lora, self.vh);
        let qk = nope + rope;
        let ckv: Vec<Vec<f64>> = kvs[..=i]
            .iter()
            .map(|kv| {
                let x: Vec<f64> = kv[..lora].iter().map(|&v| v as f64).collect();
                let ms = x.iter().map(|v| v * v).sum::<f64>() / lora as f64;
                let r = 1.0 / (ms + 1e-6).sqrt();
                x.iter()
                    .zip(&self.norm_w)
                    .map(|(v, &w)| v * r * w as f64)
                    .collect()
            })
            .collect();
        let kpe: Vec<Vec<f64>> = kvs[..=i]
            .iter()
            .enumerate()
            .map(|(t, kv)| rope_f64(&kv[lora..], t as f64, rope))
            .collect();
        let m = 1.0 + 0.1 * FACTOR.ln();
        let scale = m * m / (qk as f64).sqrt();
        let mut out = vec![0f64; h * vh];
        for hh in 0..h {
            let qrow = &qs[i][hh * qk..(hh + 1) * qk];
            let qn: Vec<f64> = qrow[..nope].iter().map(|&v| v as f64).collect();
            let qpe = rope_f64(&qrow[nope..], i as f64, rope);
            let mut scores = Vec::new();
            let mut vals = Vec::new();
            for t in 0..=i {
                let knope: Vec<f64> = (0..nope)
                    .map(|d| {
                        (0..lora)
                            .map(|c| self.kb[(hh * lora + c) * nope + d] as f64 * ckv[t][c])
                            .sum()
                    })
                    .collect();
                let v: Vec<f64> = (0..vh)
                    .map(|j| {
                        (0..lora)
                            .map(|c| self.vb[(hh * vh + j) * lora + c] as f64 * ckv[t][c])
                            .sum()
                    })
                    .collect();
                let s: f64 = qn.iter().zip(&knope).map(|(a, b)| a * b).sum::<f64>()
                    + qpe.iter().zip(&kpe[t]).map(|(a, b)| a * b).sum::<f64>();
                scores.push(s * scale);
                vals.push(v);
            }
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            for (p, v) in e.iter().zip(&vals) {
                for j in 0..vh {
                    out[hh * vh + j] += p / sum * v[j];
                }
            }
        }
        out
    }
}

/// Spec §3.5 rope in f64 (adjacent pairs, YaRN blend, magnitude 1), for factor 4 / orig 4096.
fn rope_f64(v: &[f32], pos: f64, n_rot: usize) -> Vec<f64> {
    let base: f64 = 1e4;
    let c = |beta: f64| {
        n_rot as f64 * (4096.0 / (2.0 * std::f64::consts::PI * beta)).ln() / (2.0 * base.ln())
    };
    let (lo, hi) = (
        c(32.0).floor().max(0.0),
        c(1.0).ceil().min(n_rot as f64 - 1.0),
    );
    let mut out: Vec<f64> = v.iter().map(|&x| x as f64).collect();
    for i in 0..n_rot / 2 {
        let tx = pos * base.powf(-2.0 * i as f64 / n_rot as f64);
        let ramp = 1.0 - ((i as f64 - lo) / (hi - lo).max(0.001)).clamp(0.0, 1.0);
        let th = tx / FACTOR * (1.0 - ramp) + tx * ramp;
        let (a, b) = (out[2 * i], out[2 * i + 1]);
        out[2 * i] = a * th.cos() - b * th.sin();
        out[2 * i + 1] = a * th.sin() + b * th.cos();
    }
    out
}

/// A zero cache of at least `ctx` rows, whole blocks of [`BLOCK`].
fn empty_cache(ctx: usize, w: usize) -> Buf {
    let rows = ctx.next_multiple_of(BLOCK);
    Buf::f32(&[rows, w], &vec![0.0; rows * w])
}

fn flat(rows: &[Vec<f32>]) -> Vec<f32> {
    rows.concat()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn the_absorbed_form_equals_the_expanded_form(
        h in 1usize..4,
        nope in 1usize..7,
        rope_pairs in 1usize..5,
        lora in 1usize..9,
        vh in 1usize..6,
        t in 1usize..10,
        split in 0usize..10,
        extra in 0usize..5,
        bf in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let mut rng = Rng(seed | 1);
        let m = Mla::new(h, nope, 2 * rope_pairs, lora, vh, bf, &mut rng);
        let qs: Vec<Vec<f32>> = (0..t).map(|_| rng.unit_vec(m.q_width())).collect();
        let kvs: Vec<Vec<f32>> = (0..t).map(|_| rng.unit_vec(m.w())).collect();
        let s = split.min(t);
        let mut cache = empty_cache(t + extra, m.w());
        // Positions [0, s) as one earlier chunk, then [s, t) as the chunk under test.
        if s > 0 {
            let pos: Vec<i32> = (0..s as i32).collect();
            m.chunk(&mut cache, &flat(&qs[..s]), &flat(&kvs[..s]), &pos);
        }
        let pos: Vec<i32> = (s as i32..t as i32).collect();
        let got = m.chunk(&mut cache, &flat(&qs[s..]), &flat(&kvs[s..]), &pos);
        for (r, i) in (s..t).enumerate() {
            let want = m.expanded(&qs, &kvs, i);
            let mag = want.iter().fold(1f64, |a, &b| a.max(b.abs()));
            for (j, w) in want.iter().enumerate() {
                let g = got[r * h * vh + j] as f64;
                prop_assert!((g - w).abs() <= 2e-5 * mag, "token {} elem {}: {} vs {}", i, j, g, w);
            }
        }
    }
}

#[test]
fn cache_rows_past_a_querys_position_do_not_change_its_output() {
    let mut rng = Rng(0x5eed);
    let (nh, w, lora, ctx) = (3, 12, 8, 16);
    let att = MlaAttention {
        n_head: nh,
        kv_lora: lora,
        kq_scale: 0.3,
        block_size: BLOCK,
        kernel: Default::default(),
    };
    let pages = ContiguousPages::new(ctx, BLOCK, 1);
    let table = Buf::i32(&[1, ctx / BLOCK], &pages.block_table);
    let row_seq = Buf::i32(&[1], &pages.row_seq);
    let rows = rng.unit_vec(ctx * w);
    for p in [0usize, 3, 7, ctx - 1] {
        let q = Buf::f32(&[1, nh, w], &rng.unit_vec(nh * w));
        let pos = Buf::i32(&[1], &[p as i32]);
        let mut zeros = rows.clone();
        let mut huge = rows.clone();
        for (i, (z, hv)) in zeros
            .iter_mut()
            .zip(huge.iter_mut())
            .enumerate()
            .skip((p + 1) * w)
        {
            *z = 0.0;
            *hv = if i % 2 == 0 { 1e30 } else { -1e30 };
        }
        let a = run(
            &att,
            &[&q, &Buf::f32(&[ctx, w], &zeros), &pos, &table, &row_seq],
        )
        .unwrap()
        .remove(0);
        let b = run(
            &att,
            &[&q, &Buf::f32(&[ctx, w], &huge), &pos, &table, &row_seq],
        )
        .unwrap()
        .remove(0);
        assert_eq!(a.words, b.words, "position {p}");
        assert!(a.f32s().iter().all(|x| x.is_finite()));
        // The test can fail: a row at the position itself does move the output.
        zeros[p * w] += 1.0;
        let c = run(
            &att,
            &[&q, &Buf::f32(&[ctx, w], &zeros), &pos, &table, &row_seq],
        )
        .unwrap()
        .remove(0);
        assert_ne!(a.words, c.words, "position {p}");
    }
}

#[test]
fn decoding_one_token_at_a_time_equals_a_chunked_prefill() {
    let mut rng = Rng(0xdec0de);
    let m = Mla::new(2, 4, 4, 8, 3, true, &mut rng);
    let (s, n, ctx) = (3usize, 5usize, 16usize);
    let qs: Vec<Vec<f32>> = (0..s + n).map(|_| rng.unit_vec(m.q_width())).collect();
    let kvs: Vec<Vec<f32>> = (0..s + n).map(|_| rng.unit_vec(m.w())).collect();
    let mut prefix = empty_cache(ctx, m.w());
    let pos0: Vec<i32> = (0..s as i32).collect();
    m.chunk(&mut prefix, &flat(&qs[..s]), &flat(&kvs[..s]), &pos0);

    let mut chunked = prefix.clone();
    let pos: Vec<i32> = (s as i32..(s + n) as i32).collect();
    let a = m.chunk(&mut chunked, &flat(&qs[s..]), &flat(&kvs[s..]), &pos);

    let mut stepped = prefix;
    let mut b = Vec::new();
    for i in s..s + n {
        b.extend(m.chunk(&mut stepped, &qs[i], &kvs[i], &[i as i32]));
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&a), bits(&b));
    assert_eq!(chunked.words, stepped.words);
}

/// `KvCacheWrite` of `k` at `slots` into a copy of `cache`, through the aliased output as the
/// executor runs it: the result, and the cache after it (unchanged on an error).
fn write_slots(cache: &Buf, k: &Buf, slots: &[i32]) -> (Result<(), OpError>, Vec<f32>) {
    let slots = Buf::i32(&[slots.len()], slots);
    let mut outs = [cache.clone()];
    let ins: Vec<HostTensor<'_>> = [cache, k, &slots]
        .iter()
        .map(|b| HostTensor::new(&b.meta, b.bytes()))
        .collect();
    let res = {
        let mut views: Vec<HostTensorMut<'_>> = outs
            .iter_mut()
            .map(|b| HostTensorMut::new(&b.meta, bytes_mut(&mut b.words)))
            .collect();
        KvCacheWrite.cpu(&ins, &mut views)
    };
    (res, outs[0].f32s())
}

#[test]
fn kv_cache_write_refuses_a_slot_outside_the_pool_and_writes_nothing() {
    let (ctx, w) = (4, 3);
    let before: Vec<f32> = (0..ctx * w).map(|i| i as f32).collect();
    let cache = Buf::f32(&[ctx, w], &before);
    let k = Buf::f32(&[2, w], &[9.0; 6]);
    for bad in [4, i32::MAX] {
        let (res, after) = write_slots(&cache, &k, &[1, bad]);
        match res.unwrap_err() {
            OpError::Data { op, msg } => {
                assert_eq!(op, "kv_cache_write");
                assert!(
                    msg.contains(&format!(
                        "slot {bad} of token 1 is outside the cache pool [0, {ctx})"
                    )),
                    "{msg}"
                );
            }
            other => panic!("expected a data error, got {other:?}"),
        }
        assert_eq!(after, before, "slot {bad}");
    }
}

#[test]
fn kv_cache_write_skips_a_padding_row_s_negative_slot() {
    let (ctx, w) = (4, 3);
    let before: Vec<f32> = (0..ctx * w).map(|i| i as f32).collect();
    let cache = Buf::f32(&[ctx, w], &before);
    let k = Buf::f32(&[3, w], &[9.0, 9.0, 9.0, 7.0, 7.0, 7.0, 5.0, 5.0, 5.0]);
    for pad in [-1, i32::MIN] {
        let (res, after) = write_slots(&cache, &k, &[pad, 2, pad]);
        res.unwrap_or_else(|e| panic!("slot {pad}: {e}"));
        let mut want = before.clone();
        want[2 * w..3 * w].fill(7.0);
        assert_eq!(after, want, "only row 2 (token 1) may change, slot {pad}");
    }
}

#[test]
fn kv_cache_write_updates_its_output_in_place_without_reading_the_aliased_input() {
    assert_eq!(KvCacheWrite.aliases(), &[(0, 0)]);
    let (ctx, w) = (4, 2);
    let live: Vec<f32> = (0..ctx * w).map(|i| i as f32).collect();
    let poisoned = Buf::f32(&[ctx, w], &[f32::NAN; 8]);
    let k = Buf::f32(&[1, w], &[-5.0, -6.0]);
    let pos = Buf::i32(&[1], &[2]);
    let out = run_into(
        &KvCacheWrite,
        &[&poisoned, &k, &pos],
        vec![Buf::f32(&[ctx, w], &live)],
    )
    .unwrap()
    .remove(0);
    assert_eq!(out.f32s(), vec![0.0, 1.0, 2.0, 3.0, -5.0, -6.0, 6.0, 7.0]);
}

#[test]
fn attention_refuses_a_position_past_the_block_table() {
    let att = MlaAttention {
        n_head: 1,
        kv_lora: 2,
        kq_scale: 1.0,
        block_size: 2,
        kernel: Default::default(),
    };
    let q = Buf::f32(&[1, 1, 3], &[0.0; 3]);
    let cache = Buf::f32(&[4, 3], &[0.0; 12]);
    let (table, row_seq) = (Buf::i32(&[1, 2], &[0, 1]), Buf::i32(&[1], &[0]));
    let err = run(&att, &[&q, &cache, &Buf::i32(&[1], &[4]), &table, &row_seq]).unwrap_err();
    assert!(
        matches!(
            err,
            OpError::Data {
                op: "mla_attention",
                ..
            }
        ),
        "{err:?}"
    );
    // Position 3 is the table's last; it runs.
    run(&att, &[&q, &cache, &Buf::i32(&[1], &[3]), &table, &row_seq]).unwrap();
}

#[test]
fn attention_refuses_a_block_outside_the_pool_or_a_sequence_outside_the_table() {
    let att = MlaAttention {
        n_head: 1,
        kv_lora: 2,
        kq_scale: 1.0,
        block_size: 2,
        kernel: Default::default(),
    };
    let q = Buf::f32(&[1, 1, 3], &[0.0; 3]);
    // A pool of two blocks; two sequences' tables of two entries.
    let cache = Buf::f32(&[4, 3], &[0.0; 12]);
    let pos = Buf::i32(&[1], &[3]);
    for (table, seq, what) in [
        ([1, 2, 0, 1], 0, "block 2 past the pool"),
        ([1, 0, 0, 1], 2, "sequence 2 of a table of 2"),
        ([1, 0, 0, 1], -1, "a negative sequence"),
    ] {
        let ins = [
            &q,
            &cache,
            &pos,
            &Buf::i32(&[2, 2], &table),
            &Buf::i32(&[1], &[seq]),
        ];
        let err = run(&att, &ins).unwrap_err();
        assert!(
            matches!(
                err,
                OpError::Data {
                    op: "mla_attention",
                    ..
                }
            ),
            "{what}: {err:?}"
        );
    }
    // Entries past the position are never read: a bad one there is no error.
    let ins = [
        &q,
        &cache,
        &Buf::i32(&[1], &[1]),
        &Buf::i32(&[2, 2], &[1, 7, 0, 1]),
        &Buf::i32(&[1], &[0]),
    ];
    run(&att, &ins).unwrap();
}

#[test]
fn attention_refuses_a_negative_block_id() {
    let att = MlaAttention {
        n_head: 1,
        kv_lora: 2,
        kq_scale: 1.0,
        block_size: 2,
        kernel: Default::default(),
    };
    let ins = [
        &Buf::f32(&[1, 1, 3], &[0.0; 3]),
        &Buf::f32(&[4, 3], &[0.0; 12]),
        &Buf::i32(&[1], &[3]),
        &Buf::i32(&[1, 2], &[1, -1]),
        &Buf::i32(&[1], &[0]),
    ];
    let err = run(&att, &ins).unwrap_err();
    assert!(
        matches!(
            err,
            OpError::Data {
                op: "mla_attention",
                ..
            }
        ),
        "{err:?}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn attention_over_shuffled_blocks_equals_attention_over_each_sequence_s_contiguous_copy(
        lens in prop::collection::vec(1usize..40, 1..5),
        block in 1usize..9,
        extra_width in 0usize..3,
        nh in 1usize..4,
        lora in 1usize..9,
        rope in 0usize..5,
        n in 1usize..12,
        seed in any::<u64>(),
    ) {
        // Blocks of any size (the CPU needs no power of two), tokens of every sequence in one
        // step in a random order, each at a random position of its sequence (often its last);
        // every pool row no sequence holds is NaN, so a read of one shows.
        let mut r = Rng::new(seed);
        let w = lora + rope;
        let pool = PagedPool::new(&mut r, &lens, block, extra_width, true);
        let seqs: Vec<Vec<f32>> = lens.iter().map(|&l| r.unit_vec(l * w)).collect();
        let row_seq: Vec<i32> = (0..n).map(|_| r.below(lens.len()) as i32).collect();
        let pos: Vec<i32> = row_seq
            .iter()
            .map(|&s| {
                let l = lens[s as usize];
                (if r.below(2) == 0 { l - 1 } else { r.below(l) }) as i32
            })
            .collect();
        let q = r.unit_vec(n * nh * w);
        let att = MlaAttention {
            n_head: nh,
            kv_lora: lora,
            kq_scale: 0.7,
            block_size: block,
            kernel: Default::default(),
        };
        let paged = run(
            &att,
            &[
                &Buf::f32(&[n, nh, w], &q),
                &Buf::f32(&[pool.pool_rows(), w], &pool.scatter(&seqs, w)),
                &Buf::i32(&[n], &pos),
                &Buf::i32(&[pool.seqs(), pool.width], &pool.table),
                &Buf::i32(&[n], &row_seq),
            ],
        )
        .unwrap()
        .remove(0);
        let tok = nh * lora;
        prop_assert!(paged.f32s().iter().all(|x| x.is_finite()));
        for (s, rows) in seqs.iter().enumerate() {
            let (mine, qs, ps) = support::sequence_rows(s, &q, nh * w, &pos, &row_seq);
            if mine.is_empty() {
                continue;
            }
            let k = mine.len();
            let alone = run(
                &att,
                &[
                    &Buf::f32(&[k, nh, w], &qs),
                    &Buf::f32(&[pool.reach(), w], &pool.contiguous(rows, w)),
                    &Buf::i32(&[k], &ps),
                    &Buf::i32(&[1, pool.width], &pool.contiguous_table()),
                    &Buf::i32(&[k], &vec![0; k]),
                ],
            )
            .unwrap()
            .remove(0);
            for (j, &i) in mine.iter().enumerate() {
                prop_assert_eq!(
                    &paged.words[i * tok..(i + 1) * tok],
                    &alone.words[j * tok..(j + 1) * tok],
                    "token {} (sequence {}, position {})", i, s, pos[i]
                );
            }
        }
    }
}

#[test]
fn a_query_of_the_wrong_width_is_a_shape_error_naming_it() {
    let mut rng = Rng(7);
    let m = Mla::new(2, 4, 4, 8, 3, false, &mut rng);
    let op = MlaQuery {
        n_head: 2,
        qk_nope: 4,
        qk_rope: 4,
        kv_lora: 8,
        rope: m.p,
        kernel: Default::default(),
    };
    let q = TensorMeta::f32([1, 15]);
    let pos = TensorMeta::i32([1]);
    match op.infer(&[&q, &m.kb_buf.meta, &pos]) {
        Err(OpError::Shape { op, msg }) => {
            assert_eq!(op, "mla_query");
            assert!(msg.starts_with("q must be F32[1,16]"), "{msg}");
        }
        other => panic!("expected a shape error, got {other:?}"),
    }
}

#[test]
fn describe_lists_every_parameter() {
    let mut rng = Rng(7);
    let m = Mla::new(2, 4, 4, 8, 3, false, &mut rng);
    let d = MlaQuery {
        n_head: 2,
        qk_nope: 4,
        qk_rope: 4,
        kv_lora: 8,
        rope: m.p,
        kernel: Default::default(),
    }
    .describe();
    for want in [
        "mla_query",
        "n_head=2",
        "qk_nope=4",
        "qk_rope=4",
        "kv_lora=8",
        "n_rot=4",
        "freq_scale=0.25",
        "n_ctx_orig=4096",
    ] {
        assert!(d.contains(want), "{d}");
    }
    assert!(!d.contains('\n'));
}
