//! Write -> read identity of the GGUF container, its exact byte layout, and byte compatibility
//! with llama.cpp's Python writer (the reference checkpoint).

use std::path::{Path, PathBuf};

use loader::GgmlType;
use loader::gguf::{
    GgufError, GgufFile, GgufWriter, Metadata, TensorInfo, TensorSpec, Value, ValueType,
};

fn tmp(name: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("gguf_roundtrip_{name}.gguf"))
}

fn reference_model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/reference/deepseek2-tiny/model.gguf")
}

/// Deterministic filler bytes (xorshift), so data identity is not trivially satisfied by zeros.
fn noise(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect()
}

fn write_file(path: &Path, md: &Metadata, tensors: &[(TensorSpec, Vec<u8>)]) {
    let specs = tensors.iter().map(|(s, _)| s.clone()).collect();
    let mut w = GgufWriter::create(path, md, specs).unwrap();
    for (s, data) in tensors {
        w.write_tensor(&s.name, data).unwrap();
    }
    w.finish().unwrap();
}

fn with_data(name: &str, ne: Vec<u64>, ty: GgmlType, seed: u64) -> (TensorSpec, Vec<u8>) {
    let spec = TensorSpec::new(name, ne, ty);
    let data = noise(spec.n_bytes().unwrap() as usize, seed);
    (spec, data)
}

fn le32(x: u32) -> [u8; 4] {
    x.to_le_bytes()
}
fn le64(x: u64) -> [u8; 8] {
    x.to_le_bytes()
}
fn gguf_str(s: &str) -> Vec<u8> {
    let mut v = le64(s.len() as u64).to_vec();
    v.extend_from_slice(s.as_bytes());
    v
}

#[test]
fn every_metadata_value_type_survives_write_then_read() {
    let mut md = Metadata::new();
    md.insert("t.u8", Value::U8(200));
    md.insert("t.i8", Value::I8(-128));
    md.insert("t.u16", Value::U16(65535));
    md.insert("t.i16", Value::I16(-12345));
    md.insert("t.u32", Value::U32(0xDEAD_BEEF));
    md.insert("t.i32", Value::I32(i32::MIN));
    md.insert("t.f32", Value::F32(-1.5e-7));
    md.insert("t.bool_true", Value::Bool(true));
    md.insert("t.bool_false", Value::Bool(false));
    md.insert("t.string", Value::String("héllo ✓ \"quoted\"\n".into()));
    md.insert("t.empty_string", Value::String(String::new()));
    md.insert("t.u64", Value::U64(u64::MAX));
    md.insert("t.i64", Value::I64(i64::MIN));
    md.insert("t.f64", Value::F64(std::f64::consts::PI));
    md.insert(
        "t.array_u32",
        Value::Array(ValueType::U32, vec![Value::U32(1), Value::U32(2)]),
    );
    md.insert("t.array_empty", Value::Array(ValueType::F32, vec![]));
    md.insert(
        "t.array_strings",
        Value::Array(
            ValueType::String,
            vec![Value::String("a".into()), Value::String(String::new())],
        ),
    );
    md.insert(
        "t.array_nested",
        Value::Array(
            ValueType::Array,
            vec![
                Value::Array(ValueType::I64, vec![Value::I64(-1), Value::I64(2)]),
                Value::Array(ValueType::Bool, vec![Value::Bool(true)]),
                Value::Array(ValueType::U8, vec![]),
            ],
        ),
    );
    // Every value type id appears at least once.
    let mut seen: Vec<ValueType> = md.iter().map(|(_, v)| v.value_type()).collect();
    seen.sort_by_key(|t| *t as u32);
    seen.dedup();
    assert_eq!(seen.len(), 13);

    let path = tmp("every_value_type");
    write_file(&path, &md, &[]);
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.version, 3);
    assert_eq!(f.alignment, 32);
    assert!(f.tensors.is_empty());
    let read: Vec<(&str, &Value)> = f.metadata.iter().collect();
    let written: Vec<(&str, &Value)> = md.iter().collect();
    assert_eq!(read, written, "values and key order survive");
    // Floats compare bit for bit, not just by ==.
    let Some(Value::F32(x)) = f.metadata.get("t.f32") else {
        panic!()
    };
    assert_eq!(x.to_bits(), (-1.5e-7f32).to_bits());
}

#[test]
fn tensor_infos_and_data_of_every_ggml_type_survive_write_then_read() {
    let mut tensors = Vec::new();
    for (i, ty) in GgmlType::ALL.into_iter().enumerate() {
        let b = ty.block_size() as u64;
        tensors.push(with_data(&format!("{ty}.2d"), vec![2 * b, 3], ty, i as u64));
        tensors.push(with_data(
            &format!("{ty}.3d"),
            vec![b, 1, 5],
            ty,
            100 + i as u64,
        ));
        tensors.push(with_data(&format!("{ty}.1d"), vec![b], ty, 200 + i as u64));
    }
    let mut md = Metadata::new();
    md.insert("general.architecture", Value::String("test".into()));
    let path = tmp("every_ggml_type");
    write_file(&path, &md, &tensors);

    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.tensors.len(), tensors.len());
    assert_eq!(f.data_offset % 32, 0);
    for ((spec, data), info) in tensors.iter().zip(&f.tensors) {
        assert_eq!(info.name, spec.name);
        assert_eq!(info.ne, spec.ne);
        assert_eq!(info.ty, spec.ty);
        assert_eq!(info.n_bytes, data.len() as u64);
        assert_eq!(info.offset % 32, 0, "{}", info.name);
        assert_eq!(f.tensor_data(info), &data[..], "{}", info.name);
        assert_eq!(f.data(&spec.name).unwrap(), &data[..]);
        assert_eq!(f.tensor(&spec.name), Some(info));
        assert_eq!(
            f.dequantize(&spec.name).unwrap().len() as u64,
            info.n_elements()
        );
    }
}

#[test]
fn tensor_info_shape_is_ne_reversed_and_elements_are_its_product() {
    let t = TensorInfo {
        name: "x".into(),
        ne: vec![64, 3, 2],
        ty: GgmlType::IQ4_NL,
        offset: 0,
        n_bytes: 2 * 18 * 3 * 2,
    };
    assert_eq!(t.shape(), vec![2, 3, 64]);
    assert_eq!(t.n_elements(), 384);
    // Spec §6.1: Π_{k≥1} ne_k · (ne0 / block) · type_size.
    assert_eq!(
        TensorSpec::new("x", vec![3584, 10], GgmlType::Q6_K).n_bytes(),
        Some(10 * 14 * 210)
    );
    assert_eq!(
        TensorSpec::new("x", vec![48, 10], GgmlType::Q8_0).n_bytes(),
        None
    );
}

#[test]
fn a_non_default_alignment_of_64_is_honoured() {
    let mut md = Metadata::new();
    md.insert("general.alignment", Value::U32(64));
    // Sizes 12, 18 and 68 bytes: none a multiple of 64.
    let tensors = vec![
        with_data("a", vec![3], GgmlType::F32, 1),
        with_data("b", vec![32], GgmlType::IQ4_NL, 2),
        with_data("c", vec![17, 2], GgmlType::F16, 3),
    ];
    let path = tmp("alignment_64");
    write_file(&path, &md, &tensors);
    let bytes = std::fs::read(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.alignment, 64);
    assert_eq!(f.data_offset % 64, 0);
    let offsets: Vec<u64> = f.tensors.iter().map(|t| t.offset).collect();
    assert_eq!(offsets, vec![0, 64, 128]);
    assert_eq!(
        bytes.len() as u64,
        f.data_offset + 128 + 128,
        "last tensor is padded too"
    );
    for (t, (_, data)) in f.tensors.iter().zip(&tensors) {
        let start = (f.data_offset + t.offset) as usize;
        let end = start + data.len();
        assert_eq!(&bytes[start..end], &data[..]);
        let pad_end = start + data.len().next_multiple_of(64);
        assert!(
            bytes[end..pad_end].iter().all(|&b| b == 0),
            "padding after {} is zeros",
            t.name
        );
    }
}

#[test]
fn writer_output_matches_a_hand_assembled_gguf_byte_for_byte() {
    let mut md = Metadata::new();
    md.insert("general.architecture", Value::String("x".into()));
    md.insert(
        "a.list",
        Value::Array(ValueType::I16, vec![Value::I16(-2), Value::I16(3)]),
    );
    md.insert("a.flag", Value::Bool(true));
    let w_data: Vec<u8> = [1.0f32, -2.0]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let e_data = noise(18 * 2, 7);
    let tensors = vec![
        (TensorSpec::new("w", vec![2], GgmlType::F32), w_data.clone()),
        (
            TensorSpec::new("e", vec![32, 2], GgmlType::IQ4_NL),
            e_data.clone(),
        ),
    ];
    let path = tmp("hand_assembled");
    write_file(&path, &md, &tensors);

    // Spec §6.1 layout, assembled independently of the writer.
    let mut want = b"GGUF".to_vec();
    want.extend(le32(3));
    want.extend(le64(2)); // tensors
    want.extend(le64(3)); // keys
    want.extend(gguf_str("general.architecture"));
    want.extend(le32(8));
    want.extend(gguf_str("x"));
    want.extend(gguf_str("a.list"));
    want.extend(le32(9));
    want.extend(le32(3));
    want.extend(le64(2));
    want.extend((-2i16).to_le_bytes());
    want.extend(3i16.to_le_bytes());
    want.extend(gguf_str("a.flag"));
    want.extend(le32(7));
    want.push(1);
    want.extend(gguf_str("w"));
    want.extend(le32(1));
    want.extend(le64(2));
    want.extend(le32(0));
    want.extend(le64(0));
    want.extend(gguf_str("e"));
    want.extend(le32(2));
    want.extend(le64(32));
    want.extend(le64(2));
    want.extend(le32(20));
    want.extend(le64(32)); // 8 bytes of `w` padded to 32
    let data_start = want.len().next_multiple_of(32);
    want.resize(data_start, 0);
    want.extend(&w_data);
    want.resize(data_start + 32, 0);
    want.extend(&e_data); // 36 bytes, padded to 64
    want.resize(data_start + 32 + 64, 0);

    let got = std::fs::read(&path).unwrap();
    assert_eq!(first_difference(&got, &want), None);
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.data_offset, data_start as u64);
}

/// Position and neighbourhood of the first difference, for a readable failure.
fn first_difference(a: &[u8], b: &[u8]) -> Option<String> {
    let i = a.iter().zip(b).position(|(x, y)| x != y);
    match i {
        Some(i) => Some(format!(
            "first difference at byte {i}: {:02x?} vs {:02x?}",
            &a[i..a.len().min(i + 16)],
            &b[i..b.len().min(i + 16)]
        )),
        None if a.len() != b.len() => Some(format!("lengths {} vs {}", a.len(), b.len())),
        None => None,
    }
}

#[test]
fn the_reference_checkpoint_has_the_llama_cpp_layout_and_rewrites_byte_identically() {
    let path = reference_model();
    let original = std::fs::read(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.file_size(), 1_186_976);
    assert_eq!((f.version, f.alignment), (3, 32));
    assert_eq!(f.metadata.len(), 47);
    assert_eq!(f.tensors.len(), 70);
    assert_eq!(
        f.metadata.get_str("general.architecture").unwrap(),
        "deepseek2"
    );
    assert_eq!(
        f.tensor("output.weight").map(|t| t.ty),
        Some(GgmlType::Q6_K)
    );

    // gguf-py packs tensors in info order, each padded to the alignment, and the data section
    // begins at the first aligned offset after the infos.
    let mut expected_offset = 0;
    for t in &f.tensors {
        assert_eq!(t.offset, expected_offset, "{}", t.name);
        expected_offset = (t.offset + t.n_bytes).next_multiple_of(32);
    }
    assert_eq!(f.file_size(), f.data_offset + expected_offset);
    assert!(
        original[..f.data_offset as usize].ends_with(&[0u8; 26]),
        "zero padding before data"
    );

    let out = tmp("reference_rewrite");
    let specs = f
        .tensors
        .iter()
        .map(|t| TensorSpec::new(&t.name, t.ne.clone(), t.ty))
        .collect();
    let mut w = GgufWriter::create(&out, &f.metadata, specs).unwrap();
    for t in &f.tensors {
        w.write_tensor(&t.name, f.tensor_data(t)).unwrap();
    }
    w.finish().unwrap();
    let rewritten = std::fs::read(&out).unwrap();
    assert_eq!(first_difference(&rewritten, &original), None);
}

#[test]
fn streaming_a_tensor_in_chunks_gives_the_same_file_as_whole_writes() {
    let tensors = vec![
        with_data("big", vec![256, 7], GgmlType::Q6_K, 11),
        with_data("empty", vec![0, 4], GgmlType::F32, 12),
        with_data("small", vec![5], GgmlType::BF16, 13),
    ];
    let md = Metadata::new();
    let whole = tmp("stream_whole");
    write_file(&whole, &md, &tensors);

    let chunked = tmp("stream_chunked");
    let specs = tensors.iter().map(|(s, _)| s.clone()).collect();
    let mut w = GgufWriter::create(&chunked, &md, specs).unwrap();
    for (s, data) in &tensors {
        if data.is_empty() {
            w.write_tensor_chunk(&s.name, &[]).unwrap();
        }
        for chunk in data.chunks(333) {
            w.write_tensor_chunk(&s.name, chunk).unwrap();
        }
    }
    w.finish().unwrap();
    assert_eq!(
        std::fs::read(&chunked).unwrap(),
        std::fs::read(&whole).unwrap()
    );
    let f = GgufFile::open(&chunked).unwrap();
    assert_eq!(f.data("empty").unwrap(), &[] as &[u8]);
}

fn two_tensor_writer(name: &str) -> GgufWriter {
    let specs = vec![
        TensorSpec::new("first", vec![4], GgmlType::F32),
        TensorSpec::new("second", vec![2], GgmlType::F16),
    ];
    GgufWriter::create(&tmp(name), &Metadata::new(), specs).unwrap()
}

#[test]
fn writing_a_tensor_out_of_declared_order_is_an_error_naming_both() {
    let mut w = two_tensor_writer("out_of_order");
    let e = w.write_tensor("second", &[0; 4]).unwrap_err();
    assert!(matches!(e, GgufError::OutOfOrder { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("`first`") && msg.contains("`second`"), "{msg}");
}

#[test]
fn tensor_data_of_the_wrong_size_is_an_error_naming_tensor_and_sizes() {
    let mut w = two_tensor_writer("wrong_size");
    let e = w.write_tensor("first", &[0; 15]).unwrap_err().to_string();
    assert!(
        e.contains("`first`") && e.contains("16") && e.contains("15"),
        "{e}"
    );
    // Chunks past the declared size are refused too, and the writer stays usable.
    w.write_tensor_chunk("first", &[0; 10]).unwrap();
    let e = w
        .write_tensor_chunk("first", &[0; 7])
        .unwrap_err()
        .to_string();
    assert!(e.contains("17"), "{e}");
    // Starting the next tensor before this one is complete names the incomplete one.
    let e = w.write_tensor("second", &[0; 4]).unwrap_err().to_string();
    assert!(e.contains("`first`") && e.contains("10"), "{e}");
    w.write_tensor_chunk("first", &[0; 6]).unwrap();
    w.write_tensor("second", &[0; 4]).unwrap();
    w.finish().unwrap();
}

#[test]
fn finishing_with_unwritten_tensors_is_an_error_naming_them() {
    let mut w = two_tensor_writer("missing_at_finish");
    w.write_tensor("first", &[0; 16]).unwrap();
    let e = w.finish().unwrap_err();
    let GgufError::MissingTensorData { missing, .. } = &e else {
        panic!("{e:?}")
    };
    assert_eq!(missing, &["second".to_string()]);
    assert!(e.to_string().contains("`second`"));
}

#[test]
fn the_writer_refuses_bad_declarations_naming_what_is_wrong() {
    let path = tmp("bad_declarations");
    let mut md = Metadata::new();
    md.insert(
        "k.mixed",
        Value::Array(ValueType::U32, vec![Value::U32(1), Value::I32(2)]),
    );
    let e = GgufWriter::create(&path, &md, vec![])
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("k.mixed") && e.contains("index 1"), "{e}");

    let specs = vec![TensorSpec::new("q", vec![48], GgmlType::Q8_0)];
    let e = GgufWriter::create(&path, &Metadata::new(), specs)
        .err()
        .unwrap();
    assert!(
        matches!(e, GgufError::NotWholeBlocks { ref tensor, ne0: 48, .. } if tensor == "q"),
        "{e:?}"
    );

    let specs = vec![TensorSpec::new("d", vec![1], GgmlType::F32); 2];
    let e = GgufWriter::create(&path, &Metadata::new(), specs)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("`d`") && e.contains("more than once"), "{e}");

    let mut md = Metadata::new();
    md.insert("general.alignment", Value::U32(48));
    let e = GgufWriter::create(&path, &md, vec![])
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("general.alignment") && e.contains("48"), "{e}");
}
