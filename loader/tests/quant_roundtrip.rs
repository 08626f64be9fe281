//! Quantize → dequantize properties of every storage type the checkpoint writer emits.

use half::f16;
use loader::GgmlType;
use loader::quant::{
    IQ4NL_CODEBOOK, dequantize, f32_to_bf16_bits, nearest_iq4nl_index, quantize, quantize_iq4_nl,
};

/// splitmix64 + Box–Muller: deterministic gaussian test data without a rand dependency.
struct Gauss(u64);
impl Gauss {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let (u, v) = (self.uniform(), self.uniform());
                ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
            })
            .collect()
    }
}

fn round_trip(ty: GgmlType, x: &[f32]) -> Vec<f32> {
    let mut bytes = Vec::new();
    quantize(ty, x, &mut bytes).unwrap();
    assert_eq!(bytes.len(), ty.row_bytes(x.len()).unwrap());
    let mut y = vec![0f32; x.len()];
    dequantize(ty, &bytes, &mut y).unwrap();
    y
}

fn rel_rms(x: &[f32], y: &[f32]) -> f64 {
    let err: f64 = x.iter().zip(y).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let sig: f64 = x.iter().map(|a| (*a as f64).powi(2)).sum();
    (err / sig).sqrt()
}

#[test]
fn relative_rms_error_on_gaussian_data_is_within_each_formats_bound() {
    let x = Gauss(7).vec(256 * 256);
    // Bounds: uniform rounding error step/√12 with step = amax/127 (Q8_0, amax ≈ 2.5σ over
    // 32 values) ≈ 0.006; 6-bit codes over ±32 steps per 16 values ≈ 0.02 (Q6_K); a 16-level
    // codebook ≈ 0.08 (IQ4_NL; the reference checkpoint measured 0.077). bf16 keeps 8
    // significand bits: ≤ 2^-9 relative per value; f16 11 bits: ≤ 2^-11.
    let bounds = [
        (GgmlType::F32, 0.0),
        (GgmlType::F16, 2f64.powi(-11)),
        (GgmlType::BF16, 2f64.powi(-9)),
        (GgmlType::Q8_0, 0.01),
        (GgmlType::Q6_K, 0.03),
        (GgmlType::IQ4_NL, 0.1),
    ];
    for (ty, bound) in bounds {
        let e = rel_rms(&x, &round_trip(ty, &x));
        eprintln!("{ty}: relative RMS error {e:.5}");
        assert!(e <= bound, "{ty}: relative RMS {e} > {bound}");
    }
}

#[test]
fn bf16_rounds_to_nearest_even_and_keeps_nan_and_infinity() {
    let one = 1.0f32.to_bits();
    // Exactly halfway between two bf16 values: the even one wins.
    assert_eq!(f32_to_bf16_bits(f32::from_bits(one | 0x8000)), 0x3F80);
    assert_eq!(f32_to_bf16_bits(f32::from_bits(0x3F81_8000)), 0x3F82);
    // Just above halfway rounds up, just below rounds down.
    assert_eq!(f32_to_bf16_bits(f32::from_bits(0x3F80_8001)), 0x3F81);
    assert_eq!(f32_to_bf16_bits(f32::from_bits(0x3F81_7FFF)), 0x3F81);
    assert_eq!(f32_to_bf16_bits(f32::INFINITY), 0x7F80);
    assert_eq!(f32_to_bf16_bits(f32::NEG_INFINITY), 0xFF80);
    // Overflow past the largest bf16 rounds to infinity, as ggml's formula does.
    assert_eq!(f32_to_bf16_bits(f32::MAX), 0x7F80);
    // A signalling NaN whose payload lies only in the low bits must not become infinity.
    let nan = f32_to_bf16_bits(f32::from_bits(0x7F80_0001));
    assert_eq!(nan, 0x7FC0);
    let mut bytes = Vec::new();
    quantize(GgmlType::BF16, &[-2.5, 1.0], &mut bytes).unwrap();
    assert_eq!(bytes, [0x20, 0xC0, 0x80, 0x3F]);
}

#[test]
fn f16_rounds_to_nearest_even() {
    let halfway = 1.0 + 2f32.powi(-11); // between 1.0 and 1 + 2^-10
    let three_halves = 1.0 + 3.0 * 2f32.powi(-11); // between 1 + 2^-10 and 1 + 2^-9
    let y = round_trip(GgmlType::F16, &[halfway, three_halves, 65520.0, -0.0]);
    assert_eq!(y[0], 1.0);
    assert_eq!(y[1], 1.0 + 2f32.powi(-9));
    assert_eq!(y[2], f32::INFINITY);
    assert!(y[3] == 0.0 && y[3].is_sign_negative());
}

#[test]
fn q8_0_recovers_exactly_representable_blocks() {
    // d = amax/127 must itself be exact in f16: amax = 127·2^-6.
    let d = 2f32.powi(-6);
    let mut x: Vec<f32> = (0..64)
        .map(|i| d * ((i * 37 % 255) as f32 - 127.0))
        .collect();
    x[5] = 127.0 * d;
    x[40] = -127.0 * d;
    assert_eq!(round_trip(GgmlType::Q8_0, &x), x);
}

#[test]
fn q8_0_uses_amax_over_127_and_rounds_half_away_from_zero() {
    let mut x = [0f32; 32];
    x[0] = 127.0;
    x[1] = 2.5;
    x[2] = -2.5;
    let mut bytes = Vec::new();
    quantize(GgmlType::Q8_0, &x, &mut bytes).unwrap();
    assert_eq!(f16::from_le_bytes([bytes[0], bytes[1]]).to_f32(), 1.0);
    assert_eq!(bytes[2..5], [127u8, 3, (-3i8) as u8]);
}

#[test]
fn q6_k_recovers_exactly_representable_blocks() {
    // Sub-block scales in i8 with the largest magnitude -128; every sub-block holds the code
    // -32 (its largest magnitude); values d·sc·q are exact in f32 and d is exact in f16.
    let d = 2f32.powi(-10);
    let scales: [i32; 16] = [
        -128, 77, -3, 0, 127, 1, -64, 31, -100, 5, 90, -128, 12, -7, 64, 2,
    ];
    let mut x = Vec::new();
    for (ib, &sc) in scales.iter().enumerate() {
        for j in 0..16 {
            let q = if j == (ib % 16) {
                -32
            } else {
                ((ib * 16 + j) * 29 % 64) as i32 - 32
            };
            x.push(d * sc as f32 * q as f32);
        }
    }
    assert_eq!(round_trip(GgmlType::Q6_K, &x), x);
}

#[test]
fn q6_k_places_each_group_of_16_under_its_own_scale() {
    // Groups of very different magnitude only decode well if scales[o/16] is used for output o.
    let mut x = Gauss(3).vec(512);
    for (i, v) in x.iter_mut().enumerate() {
        *v *= [1e-3f32, 1.0, 4.0, 0.5][(i / 16) % 4];
    }
    let y = round_trip(GgmlType::Q6_K, &x);
    for (g, (xs, ys)) in x.chunks(16).zip(y.chunks(16)).enumerate() {
        let e = rel_rms(xs, ys);
        // Groups share one 8-bit range of scales: a group 4000× below the largest gets a scale
        // of 0, so only the groups within 8× of the largest (i8 scale ≥ 16) are bound tightly.
        assert!(e.is_finite(), "group {g}");
        if (g % 4) != 0 {
            assert!(e < 0.05, "group {g}: relative RMS {e}");
        }
    }
}

#[test]
fn iq4_nl_all_zero_block_is_d_zero_with_every_nibble_8() {
    let mut bytes = Vec::new();
    quantize_iq4_nl(&[0.0; 32], None, &mut bytes).unwrap();
    assert_eq!(bytes[0..2], [0, 0]);
    assert!(bytes[2..].iter().all(|&b| b == 0x88), "{bytes:?}");
}

#[test]
fn iq4_nl_recovers_a_block_of_codebook_multiples_whose_extreme_is_code_0() {
    // With the largest magnitude at K[0] = -127, the candidate t = 0 maps it back exactly, the
    // fit is perfect and no other candidate can beat it.
    let d = 2f32.powi(-4);
    let codes: Vec<usize> = (0..32)
        .map(|j| if j == 9 { 0 } else { (j * 7 + 3) % 16 })
        .collect();
    let x: Vec<f32> = codes
        .iter()
        .map(|&c| d * IQ4NL_CODEBOOK[c] as f32)
        .collect();
    let mut bytes = Vec::new();
    quantize_iq4_nl(&x, None, &mut bytes).unwrap();
    assert_eq!(f16::from_le_bytes([bytes[0], bytes[1]]).to_f32(), d);
    for j in 0..16 {
        assert_eq!(
            bytes[2 + j] as usize,
            codes[j] | (codes[j + 16] << 4),
            "nibble pair {j}"
        );
    }
}

#[test]
fn iq4_nl_constant_block_takes_the_least_squares_scale_not_amax_over_127() {
    // x = c everywhere: the first mapping puts c at 127 → code 15 (113); the refit gives
    // d = c/113; every candidate maps c to code 0 (-127) whose fit is only equal, not better.
    let c = 113.0 / 32.0;
    let mut bytes = Vec::new();
    quantize_iq4_nl(&[c; 32], None, &mut bytes).unwrap();
    assert_eq!(
        f16::from_le_bytes([bytes[0], bytes[1]]).to_f32(),
        1.0 / 32.0
    );
    assert!(bytes[2..].iter().all(|&b| b == 0xFF), "{bytes:?}");
}

#[test]
fn iq4_nl_nearest_breaks_exact_ties_toward_the_upper_code() {
    let k = IQ4NL_CODEBOOK.map(|v| v as f32);
    for m in 1..16 {
        let mid = (k[m - 1] + k[m]) / 2.0;
        assert_eq!(
            nearest_iq4nl_index(mid),
            m,
            "tie between codes {} and {m}",
            m - 1
        );
        assert_eq!(nearest_iq4nl_index(mid - 0.01), m - 1);
        assert_eq!(nearest_iq4nl_index(k[m]), m);
    }
    assert_eq!(nearest_iq4nl_index(-1000.0), 0);
    assert_eq!(nearest_iq4nl_index(-127.0), 0);
    assert_eq!(nearest_iq4nl_index(113.0), 15);
    assert_eq!(nearest_iq4nl_index(1e9), 15);
    assert_eq!(nearest_iq4nl_index(0.0), 8);
}

#[test]
fn iq4_nl_importance_weights_lower_the_error_where_they_are_large() {
    let x = Gauss(11).vec(32 * 512);
    // Heavy weight on 4 columns of every block.
    let w: Vec<f32> = (0..x.len())
        .map(|i| if i % 32 < 4 { 100.0 } else { 1.0 })
        .collect();
    let weighted_err = |imp: Option<&[f32]>| {
        let mut bytes = Vec::new();
        quantize_iq4_nl(&x, imp, &mut bytes).unwrap();
        let mut y = vec![0f32; x.len()];
        dequantize(GgmlType::IQ4_NL, &bytes, &mut y).unwrap();
        x.iter()
            .zip(&y)
            .zip(&w)
            .map(|((a, b), w)| (w * (a - b) * (a - b)) as f64)
            .sum::<f64>()
    };
    let (plain, weighted) = (weighted_err(None), weighted_err(Some(&w)));
    assert!(
        weighted < 0.8 * plain,
        "weighted {weighted} vs plain {plain}"
    );
}

#[test]
fn quantize_without_importance_is_the_iq4_nl_quantizer() {
    let x = Gauss(5).vec(32 * 8);
    let (mut a, mut b) = (Vec::new(), Vec::new());
    quantize(GgmlType::IQ4_NL, &x, &mut a).unwrap();
    quantize_iq4_nl(&x, None, &mut b).unwrap();
    assert_eq!(a, b);
}

#[test]
fn partial_blocks_and_mismatched_importance_are_errors() {
    let mut out = vec![1u8];
    let e = quantize(GgmlType::Q6_K, &[0.0; 300], &mut out).unwrap_err();
    assert_eq!((e.ty, e.n_values), (GgmlType::Q6_K, 300));
    assert_eq!(out, [1u8], "nothing is appended on error");
    assert!(quantize_iq4_nl(&[0.0; 64], Some(&[1.0; 32]), &mut out).is_err());
    // Appending: a second call adds after the first.
    quantize(GgmlType::F32, &[1.0], &mut out).unwrap();
    assert_eq!(out, [1, 0, 0, 0x80, 0x3F]);
}
