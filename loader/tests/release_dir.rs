//! `Release::open`: config.json, generation_config.json, tokenizer files and the chat template.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use loader::release::{Release, ReleaseError, TokenIds};

fn temp_dir(name: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("loader-{name}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn reference_config() -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/reference/deepseek2-tiny/config.json");
    std::fs::read_to_string(p).unwrap()
}

fn write(dir: &Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).unwrap();
}

#[test]
fn a_full_release_directory_is_read() {
    let d = temp_dir("release-full");
    write(&d, "config.json", &reference_config());
    write(
        &d,
        "generation_config.json",
        r#"{"temperature": 1.0, "top_p": 0.95, "repetition_penalty": 1.05, "eos_token_id": [2, 4], "bos_token_id": 1, "do_sample": true}"#,
    );
    write(&d, "tokenizer.json", "{}");
    write(
        &d,
        "tokenizer_config.json",
        r#"{"bos_token": {"content": "<_start>"}, "eos_token": "<_end>",
            "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}"#,
    );
    let r = Release::open(&d).unwrap();
    assert_eq!(r.config.as_ref().unwrap().hidden_size, 256);
    let g = r.generation.as_ref().unwrap();
    assert_eq!(
        (g.temperature, g.top_p, g.top_k),
        (Some(1.0), Some(0.95), None)
    );
    assert_eq!(g.repetition_penalty, Some(1.05));
    assert_eq!(g.eos_token_id, Some(TokenIds::Many(vec![2, 4])));
    assert!(g.eos_token_id.as_ref().unwrap().contains(4));
    assert_eq!(
        r.tokenizer_json.as_deref(),
        Some(d.join("tokenizer.json").as_path())
    );
    assert_eq!(r.chat_template.as_deref(), Some("D"));
    assert_eq!(r.bos_token.as_deref(), Some("<_start>"));
    assert_eq!(r.eos_token.as_deref(), Some("<_end>"));
    assert!(r.hc_clamp().defaulted);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn an_empty_directory_is_a_release_with_nothing_in_it() {
    let d = temp_dir("release-empty");
    let r = Release::open(&d).unwrap();
    assert!(r.config.is_none() && r.generation.is_none() && r.tokenizer_json.is_none());
    assert!(r.chat_template.is_none());
    let clamp = r.hc_clamp();
    assert_eq!((clamp.min, clamp.max, clamp.defaulted), (-30.0, 30.0, true));
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_string_template_wins_and_chat_template_jinja_is_the_fallback() {
    let d = temp_dir("release-template");
    write(&d, "chat_template.jinja", "FROM FILE");
    write(
        &d,
        "tokenizer_config.json",
        r#"{"chat_template": "INLINE"}"#,
    );
    assert_eq!(
        Release::open(&d).unwrap().chat_template.as_deref(),
        Some("INLINE")
    );
    write(&d, "tokenizer_config.json", r#"{"eos_token": "<_end>"}"#);
    assert_eq!(
        Release::open(&d).unwrap().chat_template.as_deref(),
        Some("FROM FILE")
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_template_list_without_default_is_an_error_naming_the_file_and_entries() {
    let d = temp_dir("release-nodefault");
    write(
        &d,
        "tokenizer_config.json",
        r#"{"chat_template": [{"name": "tool_use", "template": "T"}]}"#,
    );
    let e = Release::open(&d).unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, ReleaseError::Invalid { .. }), "{text}");
    assert!(
        text.contains("tokenizer_config.json") && text.contains("tool_use"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn malformed_json_and_bad_clamps_are_errors_naming_the_file() {
    let d = temp_dir("release-bad");
    write(&d, "generation_config.json", "{\"temperature\": \"hot\"}");
    let text = Release::open(&d).unwrap_err().to_string();
    assert!(
        text.contains("generation_config.json") && text.contains("\"hot\""),
        "{text}"
    );
    std::fs::remove_file(d.join("generation_config.json")).unwrap();

    let mut cfg: serde_json::Value = serde_json::from_str(&reference_config()).unwrap();
    cfg["mhc_h_res_clamp_min"] = 5.0.into();
    cfg["mhc_h_res_clamp_max"] = (-5.0).into();
    write(&d, "config.json", &cfg.to_string());
    let text = Release::open(&d).unwrap_err().to_string();
    assert!(
        text.contains("config.json") && text.contains("mhc_h_res_clamp_min"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_file_is_not_a_release_directory() {
    let d = temp_dir("release-file");
    write(&d, "x.txt", "");
    let e = Release::open(&d.join("x.txt")).unwrap_err();
    assert!(matches!(e, ReleaseError::NotADirectory { .. }), "{e}");
    let _ = std::fs::remove_dir_all(&d);
}
