//! The linear family's parity cases (see [`crate::parity::ParityCase`]): `linear` on the GEMV
//! (weights first or not) and the tensor cores over every weight type, `linear_pair` and
//! `norm_linear` on their fused and unfused paths, at decode (1 to 4 rows), batched decode (2 to
//! 129 rows, the skinny kernels) and prefill (100 rows) sizes of the real Xing4.0 shapes (the lm
//! head cut to 4096 rows).
//!
//! Bounds: the GEMV sums in f32 in another order: the tests' `f32_tol`, rel 1e-5 and abs
//! `16·√K·u·Σ|w·x|`, where `Σ|w·x| ≈ 0.75·√K·rms(y)` at these distributions, so abs/rms is
//! `12·K·u` ([`f32_sum_bound`]); the tensor cores narrow x and the decoded weight to bf16
//! ([`NMSE_BF16`], the tests' `bf16_tol` relative part).

use super::{Linear, LinearKernel, LinearPair, NormLinear};
use crate::parity::{HostValue, NMSE_BF16, ParityCase, nmse_bound, uniform, weight};
use crate::tensor::DType;

const GEMV: LinearKernel = LinearKernel::Gemv {
    weights_first: true,
};

/// The GEMV's bound over rows of `k` (see the module doc).
fn f32_sum_bound(k: usize) -> f64 {
    let u = f64::from(f32::EPSILON) / 2.0;
    nmse_bound(1e-5, 12.0 * k as f64 * u)
}

/// The skinny kernel narrows x and the decoded weight to f16 (three more mantissa bits than
/// bf16): the tests' f16 relative part, 4e-3.
const NMSE_F16: f64 = 2.0 * 4e-3 * 4e-3;

fn bound(kernel: LinearKernel, dtype: DType, k: usize) -> f64 {
    match kernel {
        LinearKernel::TensorCore => NMSE_BF16,
        // The skinny BF16 product narrows x to bf16, as the tensor-core path does.
        LinearKernel::Skinny if dtype == DType::BF16 => NMSE_BF16,
        LinearKernel::Skinny => NMSE_F16,
        _ => f32_sum_bound(k),
    }
}

fn label(kernel: LinearKernel) -> &'static str {
    match kernel {
        LinearKernel::TensorCore => "tensor-core",
        LinearKernel::Skinny => "skinny",
        LinearKernel::Gemv {
            weights_first: false,
        } => "gemv-late-weights",
        _ => "gemv",
    }
}

fn linear(
    name: &str,
    kernel: LinearKernel,
    dtype: DType,
    n: usize,
    k: usize,
    o: usize,
) -> ParityCase {
    ParityCase::new(
        format!("linear/{name} {} {dtype} n={n} {k}->{o}", label(kernel)),
        Linear::with(kernel),
        0x11 + (n * 7 + k + o) as u64,
        bound(kernel, dtype, k),
        move |r| {
            let w = weight(r, dtype, &[o, k]);
            vec![uniform(r, &[n, k], -2.0, 2.0), w]
        },
    )
}

pub fn cases() -> Vec<ParityCase> {
    let mut v = Vec::new();
    // Decode: one token on every weight type (the BF16 one-token kernel, the IQ4_NL row split,
    // the generic GEMV), a few tokens, the late-weights variant.
    for (name, dtype, k, o) in [
        ("attn q_a", DType::BF16, 3584, 768),
        ("shared up", DType::IQ4_NL, 3584, 1024),
        ("shared up", DType::Q8_0, 3584, 1024),
        ("lm head (4096 rows)", DType::Q6_K, 3584, 4096),
        ("f16", DType::F16, 1024, 512),
        ("f32", DType::F32, 1024, 512),
    ] {
        v.push(linear(name, GEMV, dtype, 1, k, o));
    }
    v.push(linear(
        "attn o",
        LinearKernel::Gemv {
            weights_first: false,
        },
        DType::BF16,
        1,
        4096,
        3584,
    ));
    for dtype in [DType::BF16, DType::IQ4_NL, DType::Q8_0, DType::Q6_K] {
        v.push(linear("shared down", GEMV, dtype, 4, 1024, 3584));
    }
    // Decode Q6_K on the integer-MMA product: 1, 2 and 4 column tiles (two tokens each),
    // partly empty ones, rows of an odd count of blocks (each starting 2 bytes into a word)
    // and a partial 16-row tile, and fewer rows than one tile.
    for (name, n, k, o) in [
        ("lm head (4096 rows)", 2, 3584, 4096),
        ("lm head (4096 rows)", 3, 3584, 4096),
        ("lm head (4096 rows)", 5, 3584, 4096),
        ("lm head (4096 rows)", 8, 3584, 4096),
        ("odd blocks", 3, 768, 1000),
        ("five rows", 8, 256, 5),
    ] {
        v.push(linear(name, GEMV, DType::Q6_K, n, k, o));
    }
    // Widths of shapes nobody tuned for: one BF16 token whose row is not whole 32-lane rounds
    // of 16-byte units (an attention output of 5 or 7 heads of 128, a hidden width of 768),
    // and an IQ4_NL row that is not whole 256-value chunks (DeepSeek-V2-Lite's dense FFN).
    for (name, dtype, k, o, n) in [
        ("5 heads of 128", DType::BF16, 640, 512, 1),
        ("hidden 768", DType::BF16, 768, 192, 1),
        ("7 heads of 128", DType::BF16, 896, 256, 1),
        ("lite dense down", DType::IQ4_NL, 10944, 512, 1),
        ("lite dense down", DType::IQ4_NL, 10944, 512, 3),
    ] {
        v.push(linear(name, GEMV, dtype, n, k, o));
    }
    // Prefill: cuBLAS for BF16, the decoding mma.sync tiles for the block types.
    for (name, dtype, k, o) in [
        ("attn q_a", DType::BF16, 3584, 768),
        ("shared down", DType::IQ4_NL, 1024, 3584),
        ("shared up", DType::Q8_0, 3584, 1024),
        ("lm head (1024 rows)", DType::Q6_K, 3584, 1024),
    ] {
        v.push(linear(name, LinearKernel::TensorCore, dtype, 100, k, o));
    }
    // A decode step's rows on the tiles of 32 and 64 tokens (the lm head at 2..=64 sequences).
    for (dtype, n) in [
        (DType::Q6_K, 8),
        (DType::Q6_K, 33),
        (DType::Q8_0, 64),
        (DType::F16, 5),
    ] {
        v.push(linear(
            "short tiles",
            LinearKernel::TensorCore,
            dtype,
            n,
            3584,
            1000,
        ));
    }
    // Batched decode on the skinny kernels. IQ4_NL: one row to past a whole 16-row tile. BF16
    // (the attention's projections): 2 to 129 rows (one to three token tiles), K split many ways
    // (q_a's 3,584 inputs over 24 row tiles) or not at all (256 inputs at 64 rows), rows and K
    // that are not whole tiles.
    for (name, dtype, k, o, n) in [
        ("shared down", DType::IQ4_NL, 1024, 3584, 1),
        ("shared down", DType::IQ4_NL, 1024, 3584, 2),
        ("shared down", DType::IQ4_NL, 1024, 3584, 7),
        ("shared up", DType::IQ4_NL, 3584, 1024, 32),
        ("shared down", DType::IQ4_NL, 1024, 3584, 129),
        ("odd rows", DType::IQ4_NL, 512, 1000, 9),
        ("attn q_a", DType::BF16, 3584, 768, 2),
        ("attn q_a", DType::BF16, 3584, 768, 7),
        ("attn o", DType::BF16, 4096, 3584, 32),
        ("attn o", DType::BF16, 4096, 3584, 129),
        ("attn q_b", DType::BF16, 768, 6144, 128),
        ("one split", DType::BF16, 256, 4096, 64),
        ("odd rows", DType::BF16, 96, 1000, 9),
        ("odd rows", DType::BF16, 1184, 40, 17),
    ] {
        v.push(linear(name, LinearKernel::Skinny, dtype, n, k, o));
    }
    // linear_pair: one BF16 token and a skinny BF16 batch take one launch; the rest two linears.
    for (kernel, dtype, n) in [
        (GEMV, DType::BF16, 1),
        (GEMV, DType::Q8_0, 3),
        (LinearKernel::Skinny, DType::BF16, 8),
        (LinearKernel::Skinny, DType::BF16, 65),
        (LinearKernel::TensorCore, DType::BF16, 100),
    ] {
        for (k, o1, o2) in [(3584, 768, 576), (768, 96, 192)] {
            v.push(ParityCase::new(
                format!("linear_pair/q_a+kv_a {} {dtype} n={n} k={k}", label(kernel)),
                LinearPair { kernel },
                0x9a12 + n as u64,
                bound(kernel, dtype, k),
                move |r| {
                    let x = uniform(r, &[n, k], -2.0, 2.0);
                    let w1 = weight(r, dtype, &[o1, k]);
                    let w2 = weight(r, dtype, &[o2, k]);
                    vec![x, w1, w2]
                },
            ));
        }
    }
    // norm_linear: one BF16 token normalises inside the GEMV; the rest rms_norm, then linear.
    // The normalised x has rms about that of the norm weight, so the product's bound holds.
    for (kernel, dtype, n) in [
        (GEMV, DType::BF16, 1),
        (GEMV, DType::Q8_0, 3),
        (LinearKernel::Skinny, DType::BF16, 16),
        (LinearKernel::TensorCore, DType::BF16, 100),
    ] {
        let (k, o) = (768, 6144);
        let eps = 1e-6;
        v.push(ParityCase::new(
            format!("norm_linear/q_b {} {dtype} n={n}", label(kernel)),
            NormLinear { eps, kernel },
            0x4e0e + n as u64,
            bound(kernel, dtype, k),
            move |r| {
                let x = uniform(r, &[n, k], -2.0, 2.0);
                let g = r.vec(k, 0.5, 1.5);
                let w = weight(r, dtype, &[o, k]);
                vec![x, HostValue::f32([k], &g), w]
            },
        ));
    }
    v
}
