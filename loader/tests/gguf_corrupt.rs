//! Corrupt GGUF input: each defect is an error that names the file and what is wrong, and no
//! input makes the reader panic or allocate by a declared length it has not seen bytes for.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use loader::GgmlType;
use loader::gguf::{GgufError, GgufFile, GgufWriter, Metadata, TensorSpec, Value, ValueType};
use proptest::prelude::*;

const LABEL: &str = "corrupt.gguf";

fn reference_model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/reference/deepseek2-tiny/model.gguf")
}

/// Assembles GGUF bytes field by field, so that any field can be made wrong.
#[derive(Clone, Default)]
struct Raw(Vec<u8>);

impl Raw {
    fn header(n_tensors: u64, n_kv: u64) -> Raw {
        let mut r = Raw(b"GGUF".to_vec());
        r.u32(3).u64(n_tensors).u64(n_kv);
        r
    }
    fn u32(&mut self, x: u32) -> &mut Self {
        self.0.extend(x.to_le_bytes());
        self
    }
    fn u64(&mut self, x: u64) -> &mut Self {
        self.0.extend(x.to_le_bytes());
        self
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend(b);
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }
    fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.str(key).u32(4).u32(v)
    }
    fn info(&mut self, name: &str, ne: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(ne.len() as u32);
        for &n in ne {
            self.u64(n);
        }
        self.u32(ty).u64(offset)
    }
    /// Pads to 32 and appends `n` data bytes.
    fn data(&mut self, n: usize) -> &mut Self {
        let start = self.0.len().next_multiple_of(32);
        self.0.resize(start + n, 0x5A);
        self
    }
    fn open(&self) -> Result<GgufFile, GgufError> {
        GgufFile::from_bytes(LABEL, self.0.clone())
    }
}

/// The error's message, checked to name the file.
fn err_of(r: &Raw) -> (GgufError, String) {
    let e = r.open().expect_err("corrupt input must be refused");
    let msg = e.to_string();
    assert!(
        msg.starts_with(LABEL),
        "error does not name the file: {msg}"
    );
    (e, msg)
}

/// One F32 tensor of 4 values, valid.
fn valid_one_tensor() -> Raw {
    let mut r = Raw::header(1, 1);
    r.kv_u32("a.k", 7).info("w", &[4], 0, 0).data(16);
    r
}

#[test]
fn the_valid_fixture_opens() {
    let f = valid_one_tensor().open().unwrap();
    assert_eq!(f.data("w").unwrap(), &[0x5A; 16]);
}

#[test]
fn a_bad_magic_is_an_error_showing_the_bytes_found() {
    let mut r = valid_one_tensor();
    r.0[0..4].copy_from_slice(b"GGML");
    let (e, msg) = err_of(&r);
    assert!(matches!(e, GgufError::BadMagic { .. }), "{e:?}");
    assert!(msg.contains("47, 47, 4d, 4c"), "{msg}");
}

#[test]
fn an_unsupported_version_is_an_error_naming_it() {
    let mut r = valid_one_tensor();
    r.0[4..8].copy_from_slice(&2u32.to_le_bytes());
    let (e, msg) = err_of(&r);
    assert!(
        matches!(e, GgufError::UnsupportedVersion { version: 2, .. }),
        "{e:?}"
    );
    assert!(msg.contains("version 2"), "{msg}");
}

#[test]
fn a_file_cut_inside_a_metadata_value_is_truncated_naming_the_key() {
    let mut r = Raw::header(0, 1);
    r.str("general.name").u32(8).u64(10).bytes(b"abc");
    let (e, msg) = err_of(&r);
    let GgufError::Truncated {
        expected,
        available,
        ..
    } = e
    else {
        panic!("{e:?}")
    };
    assert_eq!((expected, available), (10, 3));
    assert!(
        msg.contains("`general.name`") && msg.contains("truncated"),
        "{msg}"
    );
}

#[test]
fn a_file_cut_inside_the_tensor_infos_is_truncated_naming_the_tensor() {
    let mut r = Raw::header(2, 0);
    r.info("first", &[4], 0, 0)
        .str("blk.0.attn_q.weight")
        .u32(2)
        .u64(64);
    let (e, msg) = err_of(&r);
    assert!(
        matches!(
            e,
            GgufError::Truncated {
                expected: 8,
                available: 0,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(msg.contains("`blk.0.attn_q.weight`"), "{msg}");
}

#[test]
fn a_file_cut_inside_the_tensor_data_is_an_error_naming_the_tensor_and_file() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let path = dir.join("gguf_corrupt_cut_data.gguf");
    let specs = vec![
        TensorSpec::new("a", vec![8], GgmlType::F32),
        TensorSpec::new("token_embd.weight", vec![64, 2], GgmlType::BF16),
    ];
    let mut w = GgufWriter::create(&path, &Metadata::new(), specs).unwrap();
    w.write_tensor("a", &[1; 32]).unwrap();
    w.write_tensor("token_embd.weight", &[2; 256]).unwrap();
    w.finish().unwrap();
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();

    let e = GgufFile::open(&path).unwrap_err();
    assert!(
        matches!(e, GgufError::DataPastEnd { ref tensor, .. } if tensor == "token_embd.weight")
    );
    let msg = e.to_string();
    assert!(
        msg.contains(&path.display().to_string()) && msg.contains("truncated"),
        "{msg}"
    );
}

#[test]
fn an_empty_file_is_truncated_in_the_header() {
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("gguf_corrupt_empty.gguf");
    std::fs::write(&path, b"").unwrap();
    let e = GgufFile::open(&path).unwrap_err();
    assert!(
        matches!(e, GgufError::Truncated { ref section, .. } if section == "the header"),
        "{e:?}"
    );
}

#[test]
fn a_file_that_does_not_exist_is_an_io_error_naming_it() {
    let e = GgufFile::open(Path::new("/nonexistent/dir/x.gguf"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("/nonexistent/dir/x.gguf") && e.contains("cannot open"),
        "{e}"
    );
}

#[test]
fn an_unknown_value_type_is_an_error_naming_the_key_and_id() {
    let mut r = Raw::header(0, 1);
    r.str("odd.key").u32(13).u32(0);
    let (e, msg) = err_of(&r);
    assert!(
        matches!(e, GgufError::UnknownValueType { id: 13, .. }),
        "{e:?}"
    );
    assert!(msg.contains("`odd.key`") && msg.contains("13"), "{msg}");

    let mut r = Raw::header(0, 1);
    r.str("odd.array").u32(9).u32(99).u64(1).u32(0);
    let (e, msg) = err_of(&r);
    assert!(
        matches!(e, GgufError::UnknownValueType { id: 99, .. }),
        "{e:?}"
    );
    assert!(msg.contains("`odd.array`"), "{msg}");
}

#[test]
fn an_unknown_ggml_type_is_an_error_naming_the_tensor_and_id() {
    let mut r = Raw::header(1, 0);
    r.info("blk.3.ffn_up.weight", &[32], 2, 0).data(20); // 2 = Q4_1, not read by this runtime
    let (e, msg) = err_of(&r);
    assert!(
        matches!(e, GgufError::UnknownGgmlType { id: 2, .. }),
        "{e:?}"
    );
    assert!(
        msg.contains("`blk.3.ffn_up.weight`") && msg.contains("id 2"),
        "{msg}"
    );
}

#[test]
fn a_misaligned_tensor_offset_is_an_error_naming_the_tensor() {
    let mut r = Raw::header(1, 0);
    r.info("w", &[4], 0, 16).data(64);
    let (e, msg) = err_of(&r);
    assert!(
        matches!(
            e,
            GgufError::MisalignedOffset {
                offset: 16,
                alignment: 32,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(msg.contains("`w`"), "{msg}");

    // With general.alignment = 16 the same offset is fine.
    let mut r = Raw::header(1, 1);
    r.kv_u32("general.alignment", 16).info("w", &[4], 0, 16);
    let start = r.0.len().next_multiple_of(16);
    r.0.resize(start + 32, 0);
    assert_eq!(r.open().unwrap().alignment, 16);
}

#[test]
fn ne0_that_is_not_whole_blocks_is_an_error_naming_the_tensor() {
    let mut r = Raw::header(1, 0);
    r.info("q", &[48, 2], GgmlType::IQ4_NL.id(), 0).data(200);
    let (e, msg) = err_of(&r);
    assert!(
        matches!(
            e,
            GgufError::NotWholeBlocks {
                ne0: 48,
                block_size: 32,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(msg.contains("`q`") && msg.contains("IQ4_NL"), "{msg}");
}

#[test]
fn overlapping_tensors_are_an_error_naming_both() {
    let mut r = Raw::header(2, 0);
    r.info("a", &[16], 0, 0).info("b", &[8], 0, 32).data(128); // a spans 0..64
    let (e, msg) = err_of(&r);
    assert!(matches!(e, GgufError::OverlappingTensors { .. }), "{e:?}");
    assert!(msg.contains("`a`") && msg.contains("`b`"), "{msg}");
}

#[test]
fn tensor_data_past_the_end_of_the_file_names_the_tensor() {
    for offset in [64, 1 << 62, u64::MAX - 31] {
        let mut r = Raw::header(1, 0);
        r.info("far", &[4], 0, offset).data(16);
        let (e, msg) = err_of(&r);
        assert!(matches!(e, GgufError::DataPastEnd { .. }), "{e:?}");
        assert!(msg.contains("`far`"), "{msg}");
    }
}

#[test]
fn invalid_utf8_is_an_error_naming_where_it_is() {
    let mut r = Raw::header(0, 1);
    r.u64(2).bytes(&[0xC3, 0x28]).u32(4).u32(0);
    let (e, msg) = err_of(&r);
    assert!(matches!(e, GgufError::InvalidUtf8 { .. }), "{e:?}");
    assert!(msg.contains("metadata key #0"), "{msg}");

    let mut r = Raw::header(0, 1);
    r.str("tokenizer.ggml.tokens")
        .u32(9)
        .u32(8)
        .u64(1)
        .u64(1)
        .bytes(&[0xFF]);
    let (_, msg) = err_of(&r);
    assert!(
        msg.contains("`tokenizer.ggml.tokens`") && msg.contains("UTF-8"),
        "{msg}"
    );
}

#[test]
fn absurd_lengths_are_refused_before_anything_is_allocated() {
    // A string "longer than the file".
    for len in [u64::MAX, 1 << 50] {
        let mut r = Raw::header(0, 1);
        r.str("k").u32(8).u64(len).bytes(b"xyz");
        let (e, _) = err_of(&r);
        assert!(
            matches!(e, GgufError::LengthTooLarge { length, .. } if length == len),
            "{e:?}"
        );
    }
    // An array count whose byte size overflows, and one that is merely too large.
    for count in [1u64 << 62, 1 << 40] {
        let mut r = Raw::header(0, 1);
        r.str("arr").u32(9).u32(10).u64(count).u64(1);
        let (e, msg) = err_of(&r);
        assert!(matches!(e, GgufError::LengthTooLarge { .. }), "{e:?}");
        assert!(msg.contains("`arr`"), "{msg}");
    }
    // Huge key and tensor counts end in a truncation, not an allocation.
    let (e, _) = err_of(&Raw::header(u64::MAX, u64::MAX));
    assert!(matches!(e, GgufError::Truncated { .. }), "{e:?}");
    let (e, _) = err_of(&Raw::header(u64::MAX, 0));
    assert!(matches!(e, GgufError::Truncated { .. }), "{e:?}");
}

#[test]
fn deeply_nested_arrays_are_refused_without_recursing_off_the_stack() {
    let mut r = Raw::header(0, 1);
    r.str("deep").u32(9);
    for _ in 0..100_000 {
        r.u32(9).u64(1);
    }
    let (e, msg) = err_of(&r);
    assert!(matches!(e, GgufError::Malformed { .. }), "{e:?}");
    assert!(msg.contains("`deep`") && msg.contains("nested"), "{msg}");
}

#[test]
fn a_missing_tensor_is_an_error_naming_it() {
    let f = valid_one_tensor().open().unwrap();
    for e in [
        f.data("blk.7.ffn_gate.weight").unwrap_err(),
        f.dequantize("blk.7.ffn_gate.weight").unwrap_err(),
    ] {
        assert!(matches!(e, GgufError::MissingTensor { .. }), "{e:?}");
        let msg = e.to_string();
        assert!(
            msg.contains("`blk.7.ffn_gate.weight`") && msg.starts_with(LABEL),
            "{msg}"
        );
    }
    assert!(f.tensor("nope").is_none());
}

#[test]
fn structural_oddities_are_refused_naming_what_is_wrong() {
    let cases: Vec<(Raw, &str)> = vec![
        (
            {
                let mut r = Raw::header(0, 1);
                r.kv_u32("general.alignment", 24);
                r
            },
            "general.alignment",
        ),
        (
            {
                let mut r = Raw::header(0, 1);
                r.kv_u32("general.alignment", 0);
                r
            },
            "general.alignment",
        ),
        (
            {
                let mut r = Raw::header(0, 1);
                r.str("general.alignment").u32(10).u64(32);
                r
            },
            "u64",
        ),
        (
            {
                let mut r = Raw::header(0, 2);
                r.kv_u32("k", 1).kv_u32("k", 2);
                r
            },
            "more than once",
        ),
        (
            {
                let mut r = Raw::header(2, 0);
                r.info("t", &[1], 0, 0).info("t", &[1], 0, 32).data(64);
                r
            },
            "more than once",
        ),
        (
            {
                let mut r = Raw::header(0, 1);
                r.str("b").u32(7).bytes(&[2]);
                r
            },
            "bool byte is 2",
        ),
        (
            {
                let mut r = Raw::header(1, 0);
                r.info("t5", &[1, 1, 1, 1, 1], 0, 0).data(4);
                r
            },
            "5 dimensions",
        ),
        (
            {
                let mut r = Raw::header(1, 0);
                r.info("huge", &[1 << 40, 1 << 40], 0, 0).data(4);
                r
            },
            "overflow",
        ),
    ];
    for (r, needle) in cases {
        let (_, msg) = err_of(&r);
        assert!(msg.contains(needle), "expected `{needle}` in: {msg}");
    }
}

/// A valid file and the length of its part before the data section.
struct Fixture {
    bytes: Vec<u8>,
    header_len: usize,
}

impl Fixture {
    fn new(bytes: Vec<u8>) -> Fixture {
        let header_len = GgufFile::from_bytes(LABEL, bytes.clone())
            .unwrap()
            .data_offset as usize;
        Fixture { bytes, header_len }
    }
}

fn reference() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| Fixture::new(std::fs::read(reference_model()).unwrap()))
}

/// A small writer-made file with every kind of metadata value and several tensor types.
fn small() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("gguf_corrupt_small.gguf");
        let mut md = Metadata::new();
        md.insert("general.architecture", Value::String("tiny".into()));
        md.insert("a.u8", Value::U8(1));
        md.insert("a.f64", Value::F64(2.5));
        md.insert("a.bool", Value::Bool(true));
        md.insert(
            "a.tokens",
            Value::Array(
                ValueType::String,
                vec![Value::String("<s>".into()), Value::String("ab".into())],
            ),
        );
        md.insert(
            "a.nested",
            Value::Array(
                ValueType::Array,
                vec![Value::Array(ValueType::I32, vec![Value::I32(-1)])],
            ),
        );
        let specs = vec![
            TensorSpec::new("f", vec![3], GgmlType::F32),
            TensorSpec::new("q", vec![32, 2], GgmlType::IQ4_NL),
            TensorSpec::new("k", vec![256], GgmlType::Q6_K),
        ];
        let mut w = GgufWriter::create(&path, &md, specs).unwrap();
        w.write_tensor("f", &[7; 12]).unwrap();
        w.write_tensor("q", &[9; 36]).unwrap();
        w.write_tensor("k", &[3; 210]).unwrap();
        w.finish().unwrap();
        Fixture::new(std::fs::read(&path).unwrap())
    })
}

/// Whatever `open` returns for these bytes must be self-consistent; a panic fails the test.
fn open_is_total(bytes: Vec<u8>) -> Result<(), GgufError> {
    let f = GgufFile::from_bytes(LABEL, bytes)?;
    for t in &f.tensors {
        assert_eq!(f.tensor_data(t).len() as u64, t.n_bytes, "{}", t.name);
    }
    Ok(())
}

#[test]
fn every_truncation_of_a_valid_file_is_an_error_never_a_panic() {
    // The reference file's last tensor ends exactly at end of file, so every cut loses data.
    let full = &reference().bytes;
    let data_offset = reference().header_len;
    let cuts = (0..data_offset + 64)
        .chain((data_offset + 64..full.len()).step_by(997))
        .chain([full.len() - 1]);
    for cut in cuts {
        let r = open_is_total(full[..cut].to_vec());
        assert!(
            r.is_err(),
            "a file cut at byte {cut} of {} opened",
            full.len()
        );
    }
    // The writer pads after the last tensor; cuts before its data ends must fail.
    let small = &small().bytes;
    let f = GgufFile::from_bytes(LABEL, small.to_vec()).unwrap();
    let last = f.tensors.last().unwrap();
    let data_end = (f.data_offset + last.offset + last.n_bytes) as usize;
    for cut in 0..data_end {
        assert!(
            open_is_total(small[..cut].to_vec()).is_err(),
            "cut at {cut}"
        );
    }
    assert!(
        open_is_total(small[..data_end].to_vec()).is_ok(),
        "trailing padding is optional"
    );
}

fn flipped(base: &[u8], header_len: usize, flips: &[(prop::sample::Index, u8)]) -> Vec<u8> {
    let mut bytes = base.to_vec();
    for (i, x) in flips {
        bytes[i.index(header_len)] ^= x | 1;
    }
    bytes
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1500, ..ProptestConfig::default() })]

    #[test]
    fn random_byte_flips_in_the_header_region_never_panic(
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        use_reference in any::<bool>(),
    ) {
        let base = if use_reference { reference() } else { small() };
        let _ = open_is_total(flipped(&base.bytes, base.header_len, &flips));
    }

    #[test]
    fn random_cut_points_with_flips_never_panic(
        cut in any::<prop::sample::Index>(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..3),
    ) {
        let base = &small().bytes;
        let mut bytes = flipped(base, base.len(), &flips);
        bytes.truncate(cut.index(base.len()));
        let _ = open_is_total(bytes);
    }
}
