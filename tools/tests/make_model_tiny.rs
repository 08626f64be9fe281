//! `make-model` on the tiny preset: the checkpoint passes its schema, reads back as written, is
//! deterministic, its release files agree with its header, and corrupt copies are refused.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use loader::gguf::{GgufFile, GgufWriter, Metadata, TensorSpec};
use loader::hparams::{Arch, HParams};
use loader::schema::{self, Problem};
use models::synth::{Dims, Preset, SynthOptions, encode_rows, plan, write_checkpoint};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("make_model_{name}_{}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    d
}

fn dims(arch: Arch) -> Dims {
    let mut d = Dims::preset(Preset::Tiny);
    if arch == Arch::Deepseek2 {
        d.hc = 0;
    }
    d
}

fn make(arch: Arch, seed: u64, out: &Path) {
    write_checkpoint(&SynthOptions {
        arch,
        dims: dims(arch),
        seed,
        out: out.to_path_buf(),
        force: false,
        progress: false,
    })
    .unwrap_or_else(|e| panic!("{e:#}"));
}

#[test]
fn the_tiny_checkpoint_passes_its_schema_and_is_under_2_mb() {
    for arch in [Arch::Xing4_0, Arch::Deepseek2] {
        let dir = tmp(&format!("schema_{arch}"));
        make(arch, 1, &dir);
        let f = GgufFile::open(&dir.join("model.gguf")).unwrap();
        let h =
            models::check_schema(&f.metadata, &f.tensors).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert_eq!(h, dims(arch).hparams(arch).unwrap());
        assert_eq!(
            h.n_block,
            h.n_layer + 1,
            "the tiny preset carries one NextN block"
        );
        let size = fs::metadata(dir.join("model.gguf")).unwrap().len();
        eprintln!("{arch} tiny: {size} bytes, {} tensors", f.tensors.len());
        assert!(size < 2 << 20, "{arch} tiny is {size} bytes");
        fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn metadata_and_tensors_read_back_as_written() {
    let dir = tmp("roundtrip");
    make(Arch::Xing4_0, 3, &dir);
    let f = GgufFile::open(&dir.join("model.gguf")).unwrap();
    let h = dims(Arch::Xing4_0).hparams(Arch::Xing4_0).unwrap();
    let mut arch_keys = Metadata::new();
    h.to_metadata(&mut arch_keys);
    for (k, v) in arch_keys.iter() {
        assert_eq!(f.metadata.get(k), Some(v), "{k}");
    }
    assert_eq!(HParams::from_metadata(&f.metadata).unwrap(), h);
    let planned = plan(&h);
    assert_eq!(f.tensors.len(), planned.len());
    for (t, p) in f.tensors.iter().zip(&planned) {
        assert_eq!((&t.name, &t.ne, t.ty), (&p.name, &p.ne, p.ty));
        let mut want = Vec::new();
        encode_rows(p, 3, 0..p.n_rows(), &mut want).unwrap();
        assert!(
            f.data(&t.name).unwrap() == want.as_slice(),
            "{} data",
            t.name
        );
    }
    // The stored values are the generated ones up to the storage type's rounding.
    let p = planned
        .iter()
        .find(|p| p.name == "blk.1.ffn_up_exps.weight")
        .unwrap();
    let mut src = vec![0f32; p.n_rows() * p.row_len()];
    p.generate_rows(3, 0..p.n_rows(), &mut src);
    let got = f.dequantize(&p.name).unwrap();
    let err: f32 = src.iter().zip(&got).map(|(a, b)| (a - b) * (a - b)).sum();
    let sig: f32 = src.iter().map(|a| a * a).sum();
    assert!(
        (err / sig).sqrt() < 0.1,
        "IQ4_NL relative error {}",
        (err / sig).sqrt()
    );
    fs::remove_dir_all(&dir).unwrap();
}

fn read_all(dir: &Path) -> Vec<Vec<u8>> {
    models::synth::FILES
        .iter()
        .map(|f| fs::read(dir.join(f)).unwrap())
        .collect()
}

#[test]
fn the_same_seed_gives_identical_files_and_another_seed_other_weights() {
    let (a, b, c) = (tmp("seed_a"), tmp("seed_b"), tmp("seed_c"));
    make(Arch::Xing4_0, 7, &a);
    make(Arch::Xing4_0, 7, &b);
    make(Arch::Xing4_0, 8, &c);
    let (fa, fb, fc) = (read_all(&a), read_all(&b), read_all(&c));
    for (i, name) in models::synth::FILES.iter().enumerate() {
        assert!(
            fa[i] == fb[i],
            "{name} differs between two runs with seed 7"
        );
    }
    assert!(fa[0] != fc[0], "seeds 7 and 8 wrote the same model.gguf");
    for d in [a, b, c] {
        fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn a_truncated_copy_is_an_error_naming_a_tensor() {
    let dir = tmp("truncated");
    make(Arch::Xing4_0, 1, &dir);
    let bytes = fs::read(dir.join("model.gguf")).unwrap();
    let cut = dir.join("cut.gguf");
    fs::write(&cut, &bytes[..bytes.len() - 1000]).unwrap();
    let e = GgufFile::open(&cut).unwrap_err().to_string();
    assert!(e.contains("output.weight"), "{e}");
    assert!(e.contains("cut.gguf"), "{e}");
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_copy_without_one_tensor_fails_the_schema_naming_it() {
    let dir = tmp("missing");
    make(Arch::Xing4_0, 1, &dir);
    let f = GgufFile::open(&dir.join("model.gguf")).unwrap();
    let dropped = "blk.2.attn_kv_a_norm.weight";
    let kept: Vec<_> = f.tensors.iter().filter(|t| t.name != dropped).collect();
    let out = dir.join("missing.gguf");
    let specs = kept
        .iter()
        .map(|t| TensorSpec::new(t.name.clone(), t.ne.clone(), t.ty))
        .collect();
    let mut w = GgufWriter::create(&out, &f.metadata, specs).unwrap();
    for t in &kept {
        w.write_tensor(&t.name, f.data(&t.name).unwrap()).unwrap();
    }
    w.finish().unwrap();
    let g = GgufFile::open(&out).unwrap();
    let e = models::check_schema(&g.metadata, &g.tensors).unwrap_err();
    assert_eq!(
        e.problems,
        vec![Problem::MissingTensor {
            name: dropped.into(),
            ne: vec![32],
            allowed: schema::F32_ONLY,
        }]
    );
    assert!(e.to_string().contains(dropped));
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn config_json_agrees_with_the_header() {
    for arch in [Arch::Xing4_0, Arch::Deepseek2] {
        let dir = tmp(&format!("config_{arch}"));
        make(arch, 1, &dir);
        let f = GgufFile::open(&dir.join("model.gguf")).unwrap();
        let cfg = loader::release::ReleaseConfig::from_file(&dir.join("config.json")).unwrap();
        loader::release::cross_check(&f.metadata, &cfg).unwrap_or_else(|e| panic!("{arch}: {e}"));
        let json: serde_json::Value =
            serde_json::from_slice(&fs::read(dir.join("config.json")).unwrap()).unwrap();
        let want_type = if arch == Arch::Xing4_0 {
            "xing4_0"
        } else {
            "deepseek_v3"
        };
        assert_eq!(json["model_type"], want_type);
        if arch == Arch::Xing4_0 {
            assert_eq!(json["mhc_h_res_clamp_min"], -30.0);
            assert_eq!(json["mhc_h_res_clamp_max"], 30.0);
        }
        assert_eq!(
            json["rms_norm_eps"], 1e-6,
            "written as the decimal, not the f32 widening"
        );
        fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn tokenizer_json_loads_and_agrees_with_the_gguf_vocabulary() {
    let dir = tmp("tokenizer");
    make(Arch::Xing4_0, 1, &dir);
    let hf = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let enc = hf.encode("Hello world", false).unwrap();
    assert!(!enc.get_ids().is_empty());
    assert!(
        !enc.get_ids().contains(&0),
        "<_unk> in {:?}",
        enc.get_tokens()
    );
    assert_eq!(hf.decode(enc.get_ids(), false).unwrap(), "Hello world");
    // Special tokens are single ids; byte fallback covers what the vocabulary lacks.
    let ids = hf
        .encode("<_user>héllo<_bot>", false)
        .unwrap()
        .get_ids()
        .to_vec();
    assert_eq!(ids.first(), Some(&4));
    assert_eq!(ids.last(), Some(&5));
    assert!(!ids.contains(&0));

    let f = GgufFile::open(&dir.join("model.gguf")).unwrap();
    let tokens = f
        .metadata
        .get_string_array("tokenizer.ggml.tokens")
        .unwrap();
    assert_eq!(tokens.len(), hf.get_vocab_size(true));
    for (id, piece) in tokens.iter().enumerate() {
        assert_eq!(hf.token_to_id(piece), Some(id as u32), "{piece}");
    }
    // The GGUF-built (SentencePiece-style) tokenizer encodes exactly as tokenizer.json.
    let spm = loader::tokenizer::Tokenizer::from_gguf(&f.metadata).unwrap();
    for text in [
        "Hello world",
        "the quick brown fox, and the other people...",
        "  two spaces",
        "<_system><_user>What is the capital of France?<_bot><think>\n",
        "numbers 12345 and ünïcödé",
    ] {
        let a = hf.encode(text, false).unwrap().get_ids().to_vec();
        let b = spm.encode(text, true).unwrap();
        assert_eq!(a, b, "{text:?}");
    }
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_cli_writes_a_checkpoint_and_refuses_to_overwrite_without_force() {
    let dir = tmp("cli");
    let exe = env!("CARGO_BIN_EXE_make-model");
    let run = |extra: &[&str]| {
        Command::new(exe)
            .args(["--arch", "xing4_0", "--preset", "tiny", "--quiet", "--out"])
            .arg(&dir)
            .args(extra)
            .output()
            .unwrap()
    };
    let o = run(&[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for f in models::synth::FILES {
        assert!(dir.join(f).is_file(), "{f} missing");
    }
    let o = run(&[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--force"), "{err}");
    assert!(run(&["--force", "--seed", "2"]).status.success());
    let o = run(&["--force", "--n-embd", "300"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--n-embd"), "{err}");
    let o = run(&["--force", "--arch", "llama"]);
    assert!(!o.status.success());
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn expert_type_stores_the_routed_experts_alone_in_that_type_and_bad_names_are_refused() {
    let dir = tmp("expert_type");
    let exe = env!("CARGO_BIN_EXE_make-model");
    let run = |extra: &[&str]| {
        Command::new(exe)
            .args([
                "--arch", "xing4_0", "--preset", "tiny", "--quiet", "--force", "--out",
            ])
            .arg(&dir)
            .args(extra)
            .output()
            .unwrap()
    };
    let o = run(&["--expert-type", "q8_0"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let f = GgufFile::open(&dir.join("model.gguf")).unwrap();
    let ty = |name: &str| f.tensor(name).unwrap_or_else(|| panic!("{name}")).ty;
    for name in [
        "blk.1.ffn_gate_exps.weight",
        "blk.1.ffn_up_exps.weight",
        "blk.1.ffn_down_exps.weight",
    ] {
        assert_eq!(ty(name), loader::GgmlType::Q8_0, "{name}");
    }
    // The shared expert and the dense FFN keep the release's type.
    assert_eq!(ty("blk.1.ffn_up_shexp.weight"), loader::GgmlType::IQ4_NL);
    assert_eq!(ty("blk.0.ffn_up.weight"), loader::GgmlType::IQ4_NL);
    models::check_schema(&f.metadata, &f.tensors).unwrap_or_else(|e| panic!("{e}"));

    let o = run(&["--expert-type", "q4"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("--expert-type \"q4\""),
        "{err}"
    );
    // Q6_K blocks are 256 wide; tiny's experts are 32.
    let o = run(&["--expert-type", "Q6_K"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--n-ff-exp"), "{err}");
    fs::remove_dir_all(&dir).unwrap();
}

fn rms(v: &[f32]) -> f32 {
    (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt()
}

/// `y = W x` for a weight with `ne = [in, out, ...]`, one matrix at a time.
fn matvecs(w: &[f32], ne: &[u64], x: &[f32]) -> Vec<Vec<f32>> {
    let (n_in, n_out) = (ne[0] as usize, ne[1] as usize);
    w.chunks_exact(n_in * n_out)
        .map(|m| {
            m.chunks_exact(n_in)
                .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
                .collect()
        })
        .collect()
}

#[test]
fn weights_keep_unit_rms_activations_unit_and_gates_unsaturated() {
    let dir = tmp("scaling");
    make(Arch::Xing4_0, 1, &dir);
    let f = GgufFile::open(&dir.join("model.gguf")).unwrap();
    let h = HParams::from_metadata(&f.metadata).unwrap();
    let mut rng = models::synth::rng::SplitMix64::new(99);
    let mut unit_input = |n: usize| {
        let mut x = vec![0f32; n];
        rng.fill_normal(&mut x);
        let r = rms(&x);
        x.iter_mut().for_each(|v| *v /= r);
        x
    };
    let mut checked = 0;
    for t in &f.tensors {
        let w = f.dequantize(&t.name).unwrap();
        if t.ne.len() == 1 {
            if t.name.contains("norm") {
                assert!(
                    w.iter().all(|v| (0.7..1.3).contains(v)),
                    "{} not ≈ 1",
                    t.name
                );
            }
            if t.name.contains("exp_probs_b") {
                assert!(w.iter().all(|v| v.abs() < 0.1), "{} not small", t.name);
            }
            continue;
        }
        if t.name.contains("embed") || t.name == "token_embd.weight" {
            continue;
        }
        let x = unit_input(t.ne[0] as usize);
        for (i, y) in matvecs(&w, &t.ne, &x).iter().enumerate() {
            let r = rms(y);
            let (lo, hi) = if t.name.contains("hc_") {
                (0.2, 1.0)
            } else {
                (0.5, 2.0)
            };
            assert!((lo..hi).contains(&r), "{} [{i}]: output RMS {r}", t.name);
        }
        checked += 1;
    }
    assert!(checked > 30, "only {checked} matrices checked");

    // Hyper-connection gates for a unit-RMS state: pre = σ(m·S0 + B) mostly unsaturated.
    let hc = h.hc.unwrap();
    let (mut n, mut saturated) = (0, 0);
    for i in 0..h.n_layer {
        let p = |s: &str| {
            f.dequantize(&format!("blk.{i}.hc_attn_{s}.weight"))
                .unwrap()
        };
        let (fw, base, scale) = (p("fn"), p("base"), p("scale"));
        for _ in 0..20 {
            let x = unit_input(hc.count * h.n_embd);
            let m = &matvecs(&fw, &[x.len() as u64, 24], &x)[0];
            for s in 0..8 {
                let g = 1.0 / (1.0 + (-(m[s] * scale[s / 4] + base[s])).exp());
                n += 1;
                saturated += usize::from(!(0.02..0.98).contains(&g));
            }
        }
    }
    assert!(saturated * 20 < n, "{saturated} of {n} gates saturated");

    // Router: the k-th and (k+1)-th selection scores are usually well apart.
    let k = h.n_expert_used;
    let router = f.dequantize("blk.1.ffn_gate_inp.weight").unwrap();
    let bias = f.dequantize("blk.1.exp_probs_b.bias").unwrap();
    let mut gaps = Vec::new();
    for _ in 0..200 {
        let x = unit_input(h.n_embd);
        let logits = &matvecs(&router, &[h.n_embd as u64, h.n_expert as u64], &x)[0];
        let mut s: Vec<f32> = logits
            .iter()
            .zip(&bias)
            .map(|(l, b)| 1.0 / (1.0 + (-l).exp()) + b)
            .collect();
        s.sort_by(|a, b| b.total_cmp(a));
        gaps.push(s[k - 1] - s[k]);
    }
    gaps.sort_by(f32::total_cmp);
    assert!(
        gaps[gaps.len() / 2] > 0.01,
        "median top-k gap {}",
        gaps[gaps.len() / 2]
    );
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn dimensions_that_break_block_sizes_are_refused_naming_the_flag() {
    let mut d = Dims::preset(Preset::Tiny);
    d.n_ff_exp = 48;
    let e = d.hparams(Arch::Xing4_0).unwrap_err().to_string();
    assert!(e.contains("--n-ff-exp") && e.contains("32"), "{e}");
    let mut d = Dims::preset(Preset::Tiny);
    d.n_embd = 128;
    let e = d.hparams(Arch::Xing4_0).unwrap_err().to_string();
    assert!(e.contains("--n-embd") && e.contains("256"), "{e}");
    // Quantized rows of the planned tensors are whole blocks for every preset.
    for p in [Preset::Tiny, Preset::Small, Preset::Full] {
        let h = Dims::preset(p).hparams(Arch::Xing4_0).unwrap();
        for t in plan(&h) {
            assert!(t.ty.row_bytes(t.row_len()).is_some(), "{:?} {}", p, t.name);
        }
    }
}

/// Writes `tensors` (name, PyTorch shape, F32 values) as safetensors.
fn write_safetensors(path: &Path, tensors: &[(String, Vec<u64>, Vec<f32>)], dtype: &str) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, shape, vals) in tensors {
        let start = data.len();
        for v in vals {
            data.extend_from_slice(&v.to_le_bytes());
        }
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let h = serde_json::to_vec(&header).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&data);
    fs::write(path, out).unwrap();
}

/// The random draws of `seed` for a checkpoint of `d`, as a trainer would hand them over.
fn draws(d: &Dims, seed: u64) -> Vec<(String, Vec<u64>, Vec<f32>)> {
    let h = d.hparams(Arch::Xing4_0).unwrap();
    plan(&h)
        .iter()
        .map(|t| {
            let mut vals = vec![0f32; t.row_len() * t.n_rows()];
            t.generate_rows(seed, 0..t.n_rows(), &mut vals);
            (t.name.clone(), t.ne.iter().rev().copied().collect(), vals)
        })
        .collect()
}

/// A fresh directory, a small corpus in it, and tiny dimensions whose vocabulary it can fill.
fn trained_setup(name: &str) -> (PathBuf, PathBuf, Dims) {
    let dir = tmp(name);
    fs::create_dir_all(&dir).unwrap();
    let corpus = dir.join("corpus.txt");
    let text = "the quick brown fox jumps over the lazy dog ".repeat(50);
    fs::write(&corpus, text).unwrap();
    let mut d = dims(Arch::Xing4_0);
    d.n_vocab = models::synth::tokenizer::MIN_VOCAB + 20;
    (dir, corpus, d)
}

/// `make-model --weights` quantizes the values it is given exactly as it quantizes its own
/// draws: handed the draws of seed 5, it writes the tensor bytes of the seed-5 checkpoint.
#[test]
fn trained_weights_are_quantized_like_the_writers_own_draws() {
    let (dir, corpus, d) = trained_setup("trained");
    let weights = dir.join("w.safetensors");
    write_safetensors(&weights, &draws(&d, 5), "F32");
    let opts = |out: PathBuf| SynthOptions {
        arch: Arch::Xing4_0,
        dims: d.clone(),
        seed: 5,
        out,
        force: true,
        progress: false,
    };
    models::synth::write_trained_checkpoint(&opts(dir.join("a")), &corpus, Some(&weights))
        .unwrap_or_else(|e| panic!("{e:#}"));
    write_checkpoint(&opts(dir.join("b"))).unwrap();
    let a = GgufFile::open(&dir.join("a/model.gguf")).unwrap();
    let b = GgufFile::open(&dir.join("b/model.gguf")).unwrap();
    assert_eq!(a.tensors.len(), b.tensors.len());
    for t in &a.tensors {
        assert_eq!(
            a.tensor_data(t),
            b.data(&t.name).unwrap(),
            "tensor `{}`",
            t.name
        );
    }
    // The vocabulary is the corpus's: `▁the` is a piece of it, not of the built-in one's size.
    let tok = fs::read_to_string(dir.join("a/tokenizer.json")).unwrap();
    assert!(tok.contains("\"\u{2581}the\""), "no ▁the piece");
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn trained_weights_that_do_not_fit_the_checkpoint_are_refused_by_name() {
    let (dir, corpus, d) = trained_setup("trained_bad");
    let opts = SynthOptions {
        arch: Arch::Xing4_0,
        dims: d.clone(),
        seed: 5,
        out: dir.join("out"),
        force: true,
        progress: false,
    };
    let weights = dir.join("w.safetensors");
    let refused = |tensors: Vec<(String, Vec<u64>, Vec<f32>)>, dtype: &str| {
        write_safetensors(&weights, &tensors, dtype);
        let e =
            models::synth::write_trained_checkpoint(&opts, &corpus, Some(&weights)).unwrap_err();
        assert!(!dir.join("out/model.gguf").exists());
        format!("{e:#}")
    };
    let mut missing = draws(&d, 5);
    missing.retain(|t| t.0 != "blk.1.attn_q_a.weight");
    let e = refused(missing, "F32");
    assert!(
        e.contains("missing 1 tensors: blk.1.attn_q_a.weight"),
        "{e}"
    );
    let mut shape = draws(&d, 5);
    shape[0].1.reverse();
    let e = refused(shape, "F32");
    assert!(e.contains("tensor `token_embd.weight` has shape"), "{e}");
    let mut extra = draws(&d, 5);
    extra.push(("blk.0.lora.weight".into(), vec![2], vec![0.0, 1.0]));
    let e = refused(extra, "F32");
    assert!(e.contains("no place for: blk.0.lora.weight"), "{e}");
    let e = refused(draws(&d, 5), "F16");
    assert!(e.contains("expected F32"), "{e}");
    fs::write(&weights, [200u8, 0, 0, 0, 0, 0, 0, 0, b'{']).unwrap();
    let e = models::synth::write_trained_checkpoint(&opts, &corpus, Some(&weights)).unwrap_err();
    assert!(format!("{e:#}").contains("runs past the end"), "{e:#}");
    fs::remove_dir_all(&dir).unwrap();
}
