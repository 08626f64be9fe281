//! Seed §7 path resolution: the `.gguf` from wherever it is, the rest from a release directory
//! picked by its marker, never by alphabetical order.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use loader::release::{ResolveError, ResolvedPaths, gguf_architecture, is_release_dir, resolve};

fn temp_dir(name: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("loader-{name}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn gguf_string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// A GGUF v3 header with no tensors: a u32 array and a string key before `general.architecture`,
/// so the reader has to skip values to find it.
fn write_gguf(path: &Path, arch: &str) {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.extend(3u64.to_le_bytes());
    gguf_string(&mut b, "test.numbers");
    b.extend(9u32.to_le_bytes());
    b.extend(4u32.to_le_bytes());
    b.extend(3u64.to_le_bytes());
    for v in [1u32, 2, 3] {
        b.extend(v.to_le_bytes());
    }
    gguf_string(&mut b, "general.name");
    b.extend(8u32.to_le_bytes());
    gguf_string(&mut b, "tiny");
    gguf_string(&mut b, "general.architecture");
    b.extend(8u32.to_le_bytes());
    gguf_string(&mut b, arch);
    std::fs::write(path, b).unwrap();
}

fn make_release(dir: &Path, model_type: &str, marker: bool) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        format!(r#"{{"model_type": "{model_type}"}}"#),
    )
    .unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
    if marker {
        std::fs::write(dir.join("tokenization_xing4_0.py"), "").unwrap();
    }
}

#[test]
fn the_architecture_is_read_from_the_reference_gguf_header() {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/reference/deepseek2-tiny/model.gguf");
    assert_eq!(gguf_architecture(&p).unwrap(), "deepseek2");
}

#[test]
fn the_marked_release_wins_over_an_alphabetically_earlier_sibling() {
    let root = temp_dir("resolve-decoy");
    let gguf = root.join("xing4_0-29b-IQ4_NL.gguf");
    write_gguf(&gguf, "xing4_0");
    let models = root.join("models");
    // Both decoys sort before the release and look like checkpoints.
    make_release(&models.join("Aaa-Qwen"), "qwen2", false);
    make_release(&models.join("DeepSeek-V3"), "deepseek_v3", false);
    let release = models.join("Xing4.0-29B-A4B");
    std::fs::create_dir_all(&release).unwrap();
    std::fs::write(release.join("tokenization_xing4_0.py"), "").unwrap();

    let r = resolve(Some(&gguf), Some(&models)).unwrap();
    assert_eq!(
        r,
        ResolvedPaths {
            gguf: gguf.clone(),
            release_dir: release.clone()
        }
    );

    // model_type alone also marks it.
    std::fs::remove_file(release.join("tokenization_xing4_0.py")).unwrap();
    make_release(&release, "xing4_0", false);
    assert_eq!(
        resolve(Some(&gguf), Some(&models)).unwrap().release_dir,
        release
    );

    // The same directory resolves a deepseek2 GGUF to the deepseek release.
    let ds = root.join("ds.gguf");
    write_gguf(&ds, "deepseek2");
    assert_eq!(
        resolve(Some(&ds), Some(&models)).unwrap().release_dir,
        models.join("DeepSeek-V3")
    );
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_gguf_alone_uses_its_directory_only_when_it_is_a_release() {
    let root = temp_dir("resolve-alone");
    let gguf = root.join("model.gguf");
    write_gguf(&gguf, "xing4_0");
    let e = resolve(Some(&gguf), None).unwrap_err();
    let text = e.to_string();
    let ResolveError::NoRelease { looked_at, .. } = e else {
        panic!("{text}")
    };
    assert_eq!(
        looked_at,
        [
            root.join("tokenization_xing4_0.py"),
            root.join("config.json")
        ]
    );
    assert!(
        text.contains("tokenization_xing4_0.py") && text.contains("config.json"),
        "{text}"
    );

    std::fs::write(root.join("tokenization_xing4_0.py"), "").unwrap();
    let r = resolve(Some(&gguf), None).unwrap();
    assert_eq!(
        r,
        ResolvedPaths {
            gguf,
            release_dir: root.clone()
        }
    );
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_directory_model_needs_exactly_one_gguf() {
    let root = temp_dir("resolve-dir");
    assert!(matches!(
        resolve(Some(&root), None),
        Err(ResolveError::NoGguf { .. })
    ));
    write_gguf(&root.join("b.gguf"), "xing4_0");
    let r = resolve(Some(&root), None).unwrap();
    assert_eq!(
        r,
        ResolvedPaths {
            gguf: root.join("b.gguf"),
            release_dir: root.clone()
        }
    );

    write_gguf(&root.join("a.gguf"), "xing4_0");
    let e = resolve(Some(&root), None).unwrap_err();
    let text = e.to_string();
    assert!(text.contains("a.gguf") && text.contains("b.gguf"), "{text}");
    assert!(matches!(e, ResolveError::SeveralGguf { ref found, .. } if found.len() == 2));
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_directory_model_with_a_separate_tokenizer_path_uses_that() {
    let root = temp_dir("resolve-dir-tok");
    let weights = root.join("weights");
    std::fs::create_dir_all(&weights).unwrap();
    write_gguf(&weights.join("m.gguf"), "xing4_0");
    let release = root.join("release");
    make_release(&release, "xing4_0", false);
    let r = resolve(Some(&weights), Some(&release)).unwrap();
    assert_eq!(r.release_dir, release);
    // A tokenizer file names its directory.
    let r = resolve(Some(&weights), Some(&release.join("tokenizer.json"))).unwrap();
    assert_eq!(r.release_dir, release);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn ambiguous_or_missing_releases_are_errors_listing_the_paths() {
    let root = temp_dir("resolve-ambiguous");
    let gguf = root.join("m.gguf");
    write_gguf(&gguf, "xing4_0");
    let models = root.join("models");
    make_release(&models.join("one"), "xing4_0", false);
    make_release(&models.join("two"), "other", true);
    let text = resolve(Some(&gguf), Some(&models)).unwrap_err().to_string();
    assert!(
        text.contains("one") && text.contains("two") && text.contains("several"),
        "{text}"
    );

    let empty = root.join("empty");
    std::fs::create_dir_all(empty.join("sub")).unwrap();
    let e = resolve(Some(&gguf), Some(&empty)).unwrap_err();
    assert!(
        matches!(e, ResolveError::NoRelease { ref looked_at, .. } if looked_at.contains(&empty.join("sub").join("config.json"))),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_non_gguf_or_missing_model_is_an_error_naming_it() {
    let root = temp_dir("resolve-bad");
    let fake = root.join("fake.gguf");
    std::fs::write(&fake, b"NOPE").unwrap();
    let text = resolve(Some(&fake), Some(&root)).unwrap_err().to_string();
    assert!(
        text.contains("fake.gguf") && text.contains("magic"),
        "{text}"
    );
    let missing = root.join("missing.gguf");
    assert!(matches!(
        resolve(Some(&missing), None),
        Err(ResolveError::NotFound { .. })
    ));
    assert!(matches!(resolve(None, None), Err(ResolveError::NoModel)));
    // Truncated right after the header counts.
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.extend(5u64.to_le_bytes());
    std::fs::write(&fake, b).unwrap();
    let text = gguf_architecture(&fake).unwrap_err().to_string();
    assert!(text.contains("truncated"), "{text}");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn release_markers_depend_on_the_architecture() {
    let root = temp_dir("resolve-markers");
    make_release(&root.join("x"), "xing4_0", false);
    make_release(&root.join("d2"), "deepseek_v2", false);
    make_release(&root.join("m"), "other", true);
    assert!(is_release_dir(&root.join("x"), "xing4_0"));
    assert!(!is_release_dir(&root.join("x"), "deepseek2"));
    assert!(is_release_dir(&root.join("d2"), "deepseek2"));
    assert!(is_release_dir(&root.join("m"), "xing4_0"));
    assert!(!is_release_dir(&root.join("m"), "deepseek2"));
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_model_path_that_exists_but_is_a_device_is_named_as_such_not_missing() {
    let dev = Path::new("/dev/null");
    if !dev.exists() {
        eprintln!("skipped: no /dev/null on this system");
        return;
    }
    let e = resolve(Some(dev), None).unwrap_err();
    assert!(matches!(e, ResolveError::NotRegular { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("/dev/null is a character device"), "{msg}");
    let gone = temp_dir("gone").join("no-such.gguf");
    let e = resolve(Some(&gone), None).unwrap_err();
    assert!(e.to_string().contains("does not exist"), "{e}");
}
