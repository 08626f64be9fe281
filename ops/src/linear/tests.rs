use half::{bf16, f16};

use super::plan::*;
use super::*;
use crate::testkit::*;
use loader::GgmlType;

/// Weight bytes of `rows × cols` values for `dtype`: float types from random
/// values, block types from random bytes with a finite random f16 scale.
fn random_weight(r: &mut Rng, dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
    let n = rows * cols;
    match dtype {
        DType::F32 => r
            .vec(n, -1.0, 1.0)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::F16 => r
            .vec(n, -1.0, 1.0)
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect(),
        DType::BF16 => r
            .vec(n, -1.0, 1.0)
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect(),
        DType::Q8_0 | DType::Q6_K | DType::IQ4_NL => {
            let ty = dtype.ggml().unwrap();
            let mut bytes: Vec<u8> = (0..ty.row_bytes(n).unwrap())
                .map(|_| r.next_u32() as u8)
                .collect();
            // Where each block keeps its f16 scale.
            let at = if ty == GgmlType::Q6_K { 208 } else { 0 };
            for b in bytes.chunks_exact_mut(ty.block_bytes()) {
                let d = f16::from_f32(r.uniform(-0.02, 0.02));
                b[at..at + 2].copy_from_slice(&d.to_le_bytes());
            }
            bytes
        }
        DType::I32 => unreachable!("not a weight type"),
    }
}

#[test]
fn linear_matches_the_f64_product_of_the_dequantized_weight_for_every_weight_type() {
    let mut r = Rng::new(11);
    let types = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q6_K,
        DType::IQ4_NL,
    ];
    for dtype in types {
        let (n, n_in, n_out) = (3, 512, 37);
        let wb = random_weight(&mut r, dtype, n_out, n_in);
        let mut wf = vec![0f32; n_out * n_in];
        loader::quant::dequantize(dtype.ggml().unwrap(), &wb, &mut wf).unwrap();
        let x = r.vec(n * n_in, -4.0, 4.0);
        let w = Owned::from_bytes(TensorMeta::new([n_out, n_in], dtype), &wb);
        let y = run(&Linear::default(), &[&Owned::f32([n, n_in], &x), &w]).unwrap()[0].to_f32();
        // f32 dot of n_in terms: |error| ≤ γ_n · Σ|w·x| with γ_n = n·u/(1 − n·u).
        let u = f32::EPSILON as f64 / 2.0;
        let gamma = n_in as f64 * u / (1.0 - n_in as f64 * u);
        for t in 0..n {
            for o in 0..n_out {
                let terms = (0..n_in).map(|i| wf[o * n_in + i] as f64 * x[t * n_in + i] as f64);
                let want: f64 = terms.clone().sum();
                let abs: f64 = terms.map(f64::abs).sum();
                let got = y[t * n_out + o] as f64;
                assert!(
                    (got - want).abs() <= gamma * abs + 1e-30,
                    "{dtype} y[{t}][{o}] = {got}, f64 {want}"
                );
            }
        }
    }
}

#[test]
fn linear_refuses_a_mismatched_input_width_a_partial_block_and_a_non_f32_input() {
    let e = infer(
        &Linear::default(),
        &[
            TensorMeta::f32([2, 64]),
            TensorMeta::new([8, 32], DType::BF16),
        ],
    )
    .unwrap_err();
    assert!(matches!(e, OpError::Shape { op: "linear", .. }), "{e}");
    let e = infer(
        &Linear::default(),
        &[
            TensorMeta::f32([2, 48]),
            TensorMeta::new([8, 48], DType::Q8_0),
        ],
    )
    .unwrap_err();
    assert!(
        matches!(e, OpError::Shape { .. }) && e.to_string().contains("Q8_0"),
        "{e}"
    );
    let e = infer(
        &Linear::default(),
        &[
            TensorMeta::new([2, 32], DType::BF16),
            TensorMeta::f32([8, 32]),
        ],
    )
    .unwrap_err();
    assert!(matches!(e, OpError::Shape { .. }), "{e}");
    let e = infer(
        &Linear::default(),
        &[TensorMeta::f32([2, 32]), TensorMeta::i32([8, 32])],
    )
    .unwrap_err();
    assert!(matches!(e, OpError::Shape { .. }), "{e}");
    assert_eq!(
        infer(
            &Linear::default(),
            &[
                TensorMeta::f32([2, 256]),
                TensorMeta::new([8, 256], DType::Q6_K)
            ]
        ),
        Ok(vec![TensorMeta::f32([2, 8])])
    );
}

#[test]
fn rows_plans_fit_one_block_and_give_every_chunk_to_one_k_part() {
    for nch in 1..=96 {
        for n_out in [1, 7, 100, 1024, 3584, 9216] {
            for (slots, swiglu) in [(1, false), (4, false), (4, true), (32, true)] {
                let p = RowsPlan::choose(nch, n_out, slots, swiglu, 132)
                    .unwrap_or_else(|| panic!("no plan for {nch} chunks, {n_out} rows"));
                let at = format!("{nch} chunks, {n_out} rows, {slots} slots: {p:?}");
                assert!(p.threads <= 256 && p.threads.is_multiple_of(32), "{at}");
                assert!(
                    p.rt * p.kp <= p.threads && p.threads < p.rt * p.kp + 32,
                    "{at}"
                );
                assert!(p.kp <= nch && p.cw == nch.div_ceil(p.kp), "{at}");
                // The kernel gives part q the chunks [q·nch/kp, (q+1)·nch/kp).
                let covered: usize = (0..p.kp)
                    .map(|q| (q + 1) * nch / p.kp - q * nch / p.kp)
                    .inspect(|&c| assert!(c <= p.cw, "{at}"))
                    .sum();
                assert_eq!(covered, nch, "{at}");
                assert!(p.smem_bytes(8) <= 110 * 1024, "{at}");
                assert!(!swiglu || p.rt.is_multiple_of(2), "{at}");
            }
        }
    }
}

#[test]
fn the_decode_expert_shapes_keep_every_multiprocessor_within_five_percent_of_an_even_share() {
    // (chunks, rows per expert, experts, SwiGLU): Xing4.0's gate+up and down at top-4.
    for (nch, n_out, slots, swiglu) in [(14, 1024, 4, true), (4, 3584, 4, false)] {
        let p = RowsPlan::choose(nch, n_out, slots, swiglu, 132).unwrap();
        let outs = if swiglu { p.rt / 2 } else { p.rt };
        let blocks = n_out.div_ceil(outs) * slots;
        let busiest = blocks.div_ceil(132) * p.threads * p.cw;
        let rows = n_out * slots * if swiglu { 2 } else { 1 };
        let even = (rows * nch) as f64 / 132.0;
        assert!(busiest as f64 <= 1.05 * even, "{p:?}: {busiest} vs {even}");
    }
}

#[test]
fn bf16_decode_plans_cover_the_row_with_an_instantiated_kernel() {
    for units in 1..=4096 {
        for o in [1, 576, 6144] {
            let (ju, r, s) = bf16_dec_plan(8 * units, o, 132).unwrap();
            assert!(32 * s * ju >= units, "{units} units: {ju} x {s} warps");
            assert!(s.is_power_of_two() && s <= 8, "{units} units: {s} warps");
            assert!(
                [(16, 1), (8, 1), (4, 1), (4, 4), (2, 4), (1, 4)].contains(&(ju, r)),
                "{units} units: no gemv_bf16_dec_{ju}_{r}"
            );
        }
    }
    assert_eq!(bf16_dec_plan(8 * 4097, 10, 132), None);
}

#[test]
fn prefill_tiles_run_alone_on_a_multiprocessor_only_when_the_grid_leaves_them_alone() {
    // (n, out) at 132 multiprocessors: the shared expert's 1024 rows make 64 and 128
    // blocks at 1024 and 2048 tokens; its down projection and the dense FFN make 224+.
    let fit = |n, o| TqFit::choose(DType::IQ4_NL, n, o, 132);
    assert_eq!(fit(1024, 1024), TqFit::One);
    assert_eq!(fit(2048, 1024), TqFit::One);
    for (n, o) in [(1024, 3584), (2048, 3584), (1024, 9216), (2048, 9216)] {
        assert_eq!(fit(n, o), TqFit::Two, "n={n} out={o}");
    }
    // gpu_linear.rs's test of two-a-multiprocessor blocks relies on this grid taking them.
    assert_eq!(fit(150, 8500), TqFit::Two);
    assert_eq!(fit(256, 66 * 128), TqFit::One);
    assert_eq!(TqFit::choose(DType::F32, 2048, 9216, 132), TqFit::One);
}

#[test]
fn tiles_that_leave_multiprocessors_idle_split_k_into_the_empty_slots() {
    let split = |n, k, o| {
        let fit = TqFit::choose(DType::IQ4_NL, n, o, 132);
        TqSplit::choose(fit, n, k, o, 132)
    };
    // The shared expert's gate or up (3584 -> 1024): 16 tiles at a 256-row mixed step, 40 at
    // 576, 64 at 1024 (one a multiprocessor), 128 at 2048.
    assert_eq!(split(256, 3584, 1024), TqSplit { splits: 8, per: 7 });
    assert_eq!(split(576, 3584, 1024), TqSplit { splits: 3, per: 19 });
    assert_eq!(split(1024, 3584, 1024), TqSplit { splits: 2, per: 28 });
    assert_eq!(split(2048, 3584, 1024).splits, 1);
    // Its down projection (1024 -> 3584): 56 tiles at 256 rows; two a multiprocessor past 132.
    assert_eq!(split(256, 1024, 3584), TqSplit { splits: 2, per: 8 });
    assert_eq!(split(576, 1024, 3584).splits, 1);
    // The dense FFN and the lm head fill the chip unsplit.
    assert_eq!(split(256, 3584, 9216).splits, 1);
    assert_eq!(
        TqSplit::choose(TqFit::Short32, 8, 3584, 131_072, 132).splits,
        1
    );
    // A split keeps at least four slices; K of fewer stays whole.
    assert_eq!(split(100, 512, 7), TqSplit { splits: 2, per: 4 });
    assert_eq!(split(100, 192, 7), TqSplit { splits: 1, per: 3 });
}

#[test]
fn the_scratch_holds_the_partial_sums_of_every_card_up_to_the_planned_one() {
    for (n, k, o) in [
        (9, 32, 1),
        (100, 512, 7),
        (256, 3584, 1024),
        (576, 3584, 1024),
        (150, 480, 8500),
        (300, 1024, 3584),
        (1000, 9216, 3584),
        (64, 4096, 300),
    ] {
        let fit = TqFit::choose(DType::IQ4_NL, n, o, TQ_SPLIT_MAX_SMS);
        let bound = TqSplit::choose(fit, n, k, o, TQ_SPLIT_MAX_SMS).partial_bytes(n, o);
        for sms in [1, 16, 78, 108, 114, 132, 144, 170, 256, 1024] {
            let fit = TqFit::choose(DType::IQ4_NL, n, o, sms);
            let split = TqSplit::choose(fit, n, k, o, sms);
            assert!(
                split.partial_bytes(n, o) <= bound,
                "n={n} k={k} o={o} at {sms} multiprocessors: {split:?}"
            );
            assert!(
                split.splits * split.per >= k.div_ceil(TQ_BK),
                "{split:?} covers K"
            );
            assert!(
                (split.splits - 1) * split.per < k.div_ceil(TQ_BK),
                "{split:?} no empty split"
            );
        }
    }
}

#[test]
fn a_decode_steps_few_rows_take_token_tiles_of_32_or_64_not_128() {
    let q6 = |n| TqFit::choose(DType::Q6_K, n, 131_072, 132);
    for n in [2, 8, 32] {
        assert_eq!(q6(n), TqFit::Short32, "n={n}");
    }
    for n in [33, 64] {
        assert_eq!(q6(n), TqFit::Short64, "n={n}");
    }
    assert_eq!(q6(65), TqFit::Two);
    // F32 weights' raw registers fit only the one-a-multiprocessor tiles.
    assert_eq!(TqFit::choose(DType::F32, 8, 512, 132), TqFit::One);
    assert_eq!(
        TqFit::Short32.tokens() * 3 + 256,
        TqFit::Short32.smem_bytes() as usize / 144
    );
}

#[test]
fn prefill_scratch_holds_x_as_bf16_and_for_bf16_weights_the_cublas_workspace() {
    let metas = |dtype| {
        [
            TensorMeta::f32([100, 512]),
            TensorMeta::new([7, 512], dtype),
        ]
    };
    let [x, w] = metas(DType::IQ4_NL);
    let tc = Linear::with(LinearKernel::TensorCore);
    // One tile: K's 8 slices split in two, their partial sums after x.
    assert_eq!(
        tc.cuda_scratch_bytes(&[&x, &w]),
        256 + 100 * 512 * 2 + 256 + 2 * 100 * 7 * 4
    );
    let [x, w] = [
        TensorMeta::f32([2048, 3584]),
        TensorMeta::new([9216, 3584], DType::IQ4_NL),
    ];
    assert_eq!(tc.cuda_scratch_bytes(&[&x, &w]), 256 + 2048 * 3584 * 2);
    let [x, w] = metas(DType::BF16);
    assert_eq!(
        tc.cuda_scratch_bytes(&[&x, &w]),
        256 + 100 * 512 * 2 + CUBLAS_WORKSPACE
    );
    // The GEMV and widths that take the fallback need none.
    let gemv = Linear::with(LinearKernel::Gemv {
        weights_first: true,
    });
    let w = TensorMeta::new([7, 512], DType::BF16);
    assert_eq!(
        gemv.cuda_scratch_bytes(&[&TensorMeta::f32([8, 512]), &w]),
        0
    );
    let w = TensorMeta::new([7, 48], DType::F32);
    assert_eq!(tc.cuda_scratch_bytes(&[&TensorMeta::f32([100, 48]), &w]), 0);
}

#[test]
fn a_weight_buffer_shorter_than_its_shape_is_an_error_not_a_panic() {
    let x = Owned::f32([1, 32], &[1.0; 32]);
    let w = Owned::from_bytes(TensorMeta::new([2, 32], DType::IQ4_NL), &[0u8; 18]);
    assert!(run(&Linear::default(), &[&x, &w]).is_err());
}

#[test]
fn skinny_bf16_plans_give_every_chunk_to_one_split_and_every_row_to_one_token_tile() {
    for n in [2usize, 7, 8, 9, 16, 32, 64, 65, 128, 129, 512] {
        for (k, outs, tiles) in [
            (3584usize, 1344usize, 42usize),
            (4096, 3584, 112),
            (768, 6144, 192),
            (32, 40, 2),
            (1184, 40, 2),
        ] {
            let p = Bf16SkinnyPlan::choose(n, k, outs, tiles);
            let nch = k / 32;
            assert!(
                [1, 2, 4, 8].contains(&p.nt),
                "nt {} is not instantiated",
                p.nt
            );
            assert!(p.token_tiles * 8 * p.nt >= n && (p.token_tiles - 1) * 8 * p.nt < n);
            assert!(p.splits >= 1 && p.per >= 1);
            // Four blocks' rings fit a multiprocessor's 227 KiB.
            assert!(
                p.shared_bytes() > 0 && 4 * p.shared_bytes() <= 227 * 1024,
                "{p:?}"
            );
            assert!(
                p.splits * p.per >= nch && (p.splits - 1) * p.per < nch,
                "{p:?} k={k}"
            );
            let xb = (n * k * 2).next_multiple_of(256);
            if p.splits > 1 {
                // The partial sums cost no more traffic than the weight.
                assert!(
                    p.splits * n * outs * 4 * 2 <= 2 * k * outs,
                    "{p:?} n={n} k={k}"
                );
                assert_eq!(
                    p.scratch_bytes(n, k, outs),
                    256 + xb + p.splits * n * outs * 4
                );
            } else {
                assert_eq!(p.scratch_bytes(n, k, outs), 256 + xb);
            }
        }
    }
    // q_a with kv_a at 8 rows is 42 row tiles: K is split so the chip has warps to run.
    let qa = Bf16SkinnyPlan::choose(8, 3584, 1344, 42);
    assert!(qa.splits * 42 >= 4 * 132, "{qa:?}");
    // Many row tiles already fill the chip: no split, no partial sums.
    let wide = Bf16SkinnyPlan::choose(64, 256, 4096, 128);
    assert_eq!((wide.splits, wide.nt, wide.token_tiles), (1, 8, 1));
}

#[test]
fn the_q6_k_decode_product_takes_one_column_tile_per_two_tokens_and_fits_shared_memory() {
    let (k, o, sms) = (3584, 131_072, 132);
    for (n, tiles) in [(1, 1), (2, 1), (3, 2), (4, 2), (5, 4), (8, 4)] {
        let p = Q6kMmaPlan::choose(n, k, o, sms).expect("the lm head's shape");
        assert_eq!(p.tiles, tiles, "n={n}");
        assert_eq!(p.blocks, sms, "n={n}: one block a multiprocessor");
        assert!(
            p.smem_bytes(k) <= 227 * 1024,
            "n={n}: {} bytes",
            p.smem_bytes(k)
        );
    }
    // Few rows: no more blocks than 16-row tiles over 8 warps.
    assert_eq!(Q6kMmaPlan::choose(8, 256, 5, sms).unwrap().blocks, 1);
    assert_eq!(Q6kMmaPlan::choose(1, 3584, 4096, sms).unwrap().blocks, 32);
    // Past 8 tokens, partial blocks, or x too long for shared memory: the other paths.
    assert_eq!(Q6kMmaPlan::choose(9, k, o, sms), None);
    assert_eq!(Q6kMmaPlan::choose(1, 3584 + 64, o, sms), None);
    assert_eq!(Q6kMmaPlan::choose(8, 65_536, o, sms), None);
    assert!(matches!(
        linear_path(
            LinearKernel::Gemv {
                weights_first: true
            },
            DType::Q6_K,
            (3, k, o),
            0,
            0,
            sms
        ),
        LinearPath::Q6kMma(Q6kMmaPlan { tiles: 2, .. })
    ));
}
