//! The official `openai` Python package drives `serve` on loopback: chat (whole and streamed,
//! equal under greedy decoding), a completion, the models list, and error classes; and sixteen
//! concurrent streaming chats, batched together, each equal to its whole answer; tool calls
//! and structured outputs (a required call's arguments and 50 random JSON schemas validated
//! with `jsonschema`).
//!
//! The package lives in a virtualenv that .ci/run makes; its python is `$XING4_TEST_PYTHON`.
//! Without it a developer run skips with a message; under CI it is a failure.

mod serve_support;

use std::path::Path;
use std::process::Command;

use serve_support::{MODEL, Server, small_checkpoint, tiny_checkpoint};

/// The python with the `openai` package, or None after saying why (a failure under CI).
fn python() -> Option<std::ffi::OsString> {
    let Some(python) = std::env::var_os("XING4_TEST_PYTHON") else {
        let msg = "XING4_TEST_PYTHON is not set: it names a python with the `openai` package \
                   (.ci/run makes one: python3 -m venv target/ci-venv && target/ci-venv/bin/pip install openai)";
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("{msg}");
        }
        eprintln!("SKIPPED the openai client test: {msg}");
        return None;
    };
    Some(python)
}

/// Runs `tests/openai_client/{script}` against a server on the tiny checkpoint started with
/// `args` (and an API key).
fn run_script(script: &str, args: &[&str]) {
    run_script_on(tiny_checkpoint(), script, args);
}

fn run_script_on(checkpoint: &Path, script: &str, args: &[&str]) {
    let Some(python) = python() else {
        return;
    };
    let mut all = vec!["--api-key", "test-key"];
    all.extend_from_slice(args);
    let server = Server::start_on(checkpoint, &all);
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/openai_client")
        .join(script);
    let out = Command::new(&python)
        .arg(&script)
        .arg(format!("http://{}/v1", server.addr))
        .arg(MODEL)
        .arg("test-key")
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", Path::new(&python).display()));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}");
    assert!(
        out.status.success(),
        "{} failed:\n{stdout}\n{stderr}\nserve stderr:\n{}",
        script.display(),
        server.stderr()
    );
    assert!(stdout.contains("checks passed"), "{stdout}");
}

#[test]
fn the_official_openai_client_works_against_serve_unmodified() {
    run_script("check.py", &["--block-size", "16"]);
}

#[test]
fn sixteen_concurrent_streaming_chats_decode_together_and_each_equals_its_whole_answer() {
    run_script("many_streams.py", &[]);
}

#[test]
fn required_tool_calls_and_fifty_random_json_schemas_hold_through_the_openai_client() {
    // The small checkpoint: a 4,096-token vocabulary, so masks cut real merged pieces.
    run_script_on(small_checkpoint(), "agent.py", &[]);
}
