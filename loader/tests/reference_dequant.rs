//! Our dequantization of the reference checkpoint against llama.cpp's Python package
//! (`dequant_reference.json`, see the README beside it).

use std::path::{Path, PathBuf};

use loader::GgmlType;
use loader::gguf::GgufFile;

fn reference_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/reference/deepseek2-tiny")
}

/// The reference sums are float64 sums of the float32 values, in numpy's (pairwise) order. Ours
/// are float64 sums in sequential order. Each of the two sums of n terms is within
/// (n-1)·u·Σ|t| of the exact sum (u = 2^-53), so they may differ by twice that and no more.
/// Squares of f32 values are exact in f64, so the same bound holds for the sum of squares.
fn f64_summation_bound(n: usize, sum_abs: f64) -> f64 {
    // 2 · (n-1) · u · Σ|t|, with u = f64::EPSILON / 2.
    n.saturating_sub(1) as f64 * f64::EPSILON * sum_abs
}

#[test]
fn dequantization_matches_llama_cpp_for_every_reference_tensor() {
    let dir = reference_dir();
    let text = std::fs::read_to_string(dir.join("dequant_reference.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(json["format"], "dequant-reference/1");
    let tensors = json["tensors"].as_object().unwrap();
    assert!(
        tensors.len() >= 10,
        "three tensors of each of four types, at least"
    );
    let f = GgufFile::open(&dir.join("model.gguf")).unwrap();

    let mut types_seen = Vec::new();
    for (name, want) in tensors {
        let info = f
            .tensor(name)
            .unwrap_or_else(|| panic!("`{name}` not in the GGUF"));
        let ty = GgmlType::from_name(want["type"].as_str().unwrap()).unwrap();
        assert_eq!(info.ty, ty, "{name}");
        types_seen.push(ty);
        let ne: Vec<u64> = want["ne"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        assert_eq!(info.ne, ne, "{name}");

        let got = f.dequantize(name).unwrap();
        assert_eq!(got.len() as u64, want["n"].as_u64().unwrap(), "{name}");

        let first: Vec<f64> = want["first_64"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(first.len(), 64.min(got.len()));
        // The file holds f32 values printed exactly, but serde_json (without its
        // `float_roundtrip` feature) may parse them one f64 ulp off; rounding to f32 undoes that.
        for (i, (&g, &w)) in got.iter().zip(&first).enumerate() {
            assert_eq!(
                g.to_bits(),
                (w as f32).to_bits(),
                "{name}[{i}]: {g} vs {w} must be bit-exact"
            );
        }

        let sum: f64 = got.iter().map(|&x| x as f64).sum();
        let sum_abs: f64 = got.iter().map(|&x| (x as f64).abs()).sum();
        let sum_sq: f64 = got.iter().map(|&x| x as f64 * x as f64).sum();
        let max_abs = got.iter().fold(0f32, |m, &x| m.max(x.abs()));

        let (want_sum, want_sq) = (
            want["sum"].as_f64().unwrap(),
            want["sum_sq"].as_f64().unwrap(),
        );
        let tol = f64_summation_bound(got.len(), sum_abs);
        assert!(
            (sum - want_sum).abs() <= tol,
            "{name}: sum {sum} vs {want_sum} (tolerance {tol:e})"
        );
        let tol_sq = f64_summation_bound(got.len(), sum_sq);
        assert!(
            (sum_sq - want_sq).abs() <= tol_sq,
            "{name}: sum of squares {sum_sq} vs {want_sq} (tolerance {tol_sq:e})"
        );
        assert_eq!(
            max_abs,
            want["max_abs"].as_f64().unwrap() as f32,
            "{name}: max |x|"
        );
    }
    types_seen.sort();
    types_seen.dedup();
    assert_eq!(
        types_seen,
        vec![
            GgmlType::F32,
            GgmlType::Q6_K,
            GgmlType::IQ4_NL,
            GgmlType::BF16
        ]
    );
}
