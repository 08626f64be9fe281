//! A `make-model` checkpoint is read by llama.cpp's own Python reader (`gguf` from PyPI, the
//! package llama.cpp's converters write with) exactly as our reader reads it: the same keys and
//! value types, tensor names, types, shapes and byte sizes, and dequantized values.
//!
//! The package lives in the virtualenv .ci/run makes (`$XING4_TEST_PYTHON`); without it a
//! developer run skips with a message, and under CI it is a failure.

use std::path::{Path, PathBuf};
use std::process::Command;

use loader::gguf::GgufFile;
use loader::hparams::Arch;
use models::synth::{Dims, Preset, SynthOptions, write_checkpoint};
use serde_json::Value;

fn python() -> Option<std::ffi::OsString> {
    let p = std::env::var_os("XING4_TEST_PYTHON");
    if p.is_none() {
        let msg = "XING4_TEST_PYTHON is not set: it names a python with the `gguf` package (.ci/run makes one)";
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("{msg}");
        }
        eprintln!("SKIPPED the gguf-py reader test: {msg}");
    }
    p
}

fn make(arch: Arch) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gguf_py_{arch}_{}", std::process::id()));
    let mut dims = Dims::preset(Preset::Tiny);
    if arch == Arch::Deepseek2 {
        dims.hc = 0;
    }
    write_checkpoint(&SynthOptions {
        arch,
        dims,
        seed: 5,
        out: dir.clone(),
        force: true,
        progress: false,
    })
    .unwrap_or_else(|e| panic!("{e:#}"));
    dir
}

fn read_with_gguf_py(python: &std::ffi::OsStr, file: &Path) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/gguf_py/read.py");
    let out = Command::new(python)
        .arg(&script)
        .arg(file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "gguf-py could not read {}: {}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn llama_cpp_python_reader_sees_our_checkpoints_as_we_do() {
    let Some(python) = python() else { return };
    for arch in [Arch::Xing4_0, Arch::Deepseek2] {
        let dir = make(arch);
        let file = dir.join("model.gguf");
        let theirs = read_with_gguf_py(&python, &file);
        let ours = GgufFile::open(&file).unwrap();

        assert_eq!(theirs["alignment"].as_u64(), Some(ours.alignment));
        let keys = theirs["keys"].as_object().unwrap();
        assert_eq!(keys.len(), ours.metadata.len(), "{arch}: key count");
        for (k, v) in ours.metadata.iter() {
            let types = keys
                .get(k)
                .unwrap_or_else(|| panic!("{arch}: gguf-py lacks key {k}"));
            assert_eq!(
                types[0].as_u64(),
                Some(v.value_type() as u64),
                "{arch}: type of {k}"
            );
        }
        let tensors = theirs["tensors"].as_array().unwrap();
        assert_eq!(tensors.len(), ours.tensors.len());
        for (t, info) in tensors.iter().zip(&ours.tensors) {
            assert_eq!(t["name"].as_str(), Some(info.name.as_str()));
            assert_eq!(t["type"].as_str(), Some(info.ty.name()), "{}", info.name);
            let ne: Vec<u64> = t["ne"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect();
            assert_eq!(ne, info.ne, "{}", info.name);
            assert_eq!(t["n_bytes"].as_u64(), Some(info.n_bytes), "{}", info.name);
            let values = ours.dequantize(&info.name).unwrap();
            for (i, f) in t["first"].as_array().unwrap().iter().enumerate() {
                // JSON carries the f32 value as a decimal; serde_json may land one
                // float64 step off, so compare at f32, where the values live.
                assert_eq!(
                    values[i],
                    f.as_f64().unwrap() as f32,
                    "{} value {i}",
                    info.name
                );
            }
            let sum: f64 = values.iter().map(|&v| v as f64).sum();
            let sumsq: f64 = values.iter().map(|&v| v as f64 * v as f64).sum();
            let abs: f64 = values.iter().map(|&v| (v as f64).abs()).sum();
            // Two float64 summation orders of the same f32 values.
            let tol = 1e-12 * (abs + 1.0) * values.len() as f64;
            assert!(
                (sum - t["sum"].as_f64().unwrap()).abs() <= tol,
                "{} sum",
                info.name
            );
            assert!(
                (sumsq - t["sumsq"].as_f64().unwrap()).abs() <= tol * (abs + 1.0),
                "{} sumsq",
                info.name
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
