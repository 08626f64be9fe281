//! Starting the real `serve` binary on a free loopback port over a tiny synthetic checkpoint,
//! and talking to it over plain HTTP.

#![allow(dead_code)]

#[path = "../../src/bin/load-test/client.rs"]
pub mod client;

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock, mpsc};
use std::time::{Duration, Instant};

use loader::hparams::Arch;
use models::synth::{Dims, Preset, SynthOptions, write_checkpoint};
use serde_json::Value;

/// The served name the tests use.
pub const MODEL: &str = "tiny";

/// One tiny xing4_0 checkpoint per test process (deterministic: seed 1).
pub fn tiny_checkpoint() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| checkpoint("tiny", Preset::Tiny))
}

/// One small xing4_0 checkpoint (tens of MB, a 4,096-token vocabulary) per test process.
pub fn small_checkpoint() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| checkpoint("small", Preset::Small))
}

fn checkpoint(name: &str, preset: Preset) -> PathBuf {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    // Checkpoints of earlier test processes that have exited.
    let prefix = format!("serve-{name}-");
    for e in std::fs::read_dir(tmp).into_iter().flatten().flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        if let Some(pid) = file.strip_prefix(&prefix)
            && !Path::new("/proc").join(pid).exists()
        {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
    let dir = tmp.join(format!("{prefix}{}", std::process::id()));
    write_checkpoint(&SynthOptions {
        arch: Arch::Xing4_0,
        dims: Dims::preset(preset),
        seed: 1,
        out: dir.clone(),
        force: true,
        progress: false,
    })
    .unwrap_or_else(|e| panic!("making the {name} checkpoint: {e:#}"));
    dir
}

pub struct Server {
    child: Child,
    /// `127.0.0.1:port`
    pub addr: String,
    stderr: Arc<Mutex<String>>,
}

impl Server {
    pub fn start(extra: &[&str]) -> Server {
        Server::start_on(tiny_checkpoint(), extra)
    }

    pub fn start_on(dir: &Path, extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_serve"))
            .arg("--model")
            .arg(dir)
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--served-model-name",
                MODEL,
            ])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting serve");
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut err_pipe = child.stderr.take().expect("stderr");
        let sink = stderr.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err_pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                if let Ok(mut s) = sink.lock() {
                    s.push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            }
        });
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("ready on http://").nth(1) {
                    let addr = rest.split_whitespace().next().unwrap_or("").to_string();
                    let _ = tx.send(addr);
                }
            }
        });
        let mut server = Server {
            child,
            addr: String::new(),
            stderr,
        };
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(addr) => server.addr = addr,
            Err(_) => panic!("serve did not become ready; stderr:\n{}", server.stderr()),
        }
        server
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().map(|s| s.clone()).unwrap_or_default()
    }

    pub fn post(&self, path: &str, body: &str) -> client::Response {
        client::request(&self.addr, "POST", path, &[], body.as_bytes())
            .unwrap_or_else(|e| panic!("POST {path}: {e}; serve stderr:\n{}", self.stderr()))
    }

    /// POST returning (status, JSON body).
    pub fn post_json(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = self.post(path, &body.to_string());
        let v = serde_json::from_slice(&r.body)
            .unwrap_or_else(|e| panic!("POST {path} answered non-JSON ({e}): {}", r.text()));
        (r.status, v)
    }

    pub fn get(&self, path: &str) -> client::Response {
        client::request(&self.addr, "GET", path, &[], b"")
            .unwrap_or_else(|e| panic!("GET {path}: {e}; serve stderr:\n{}", self.stderr()))
    }

    /// One sample of the /metrics exposition, e.g. `xing4_cancellations_total`.
    pub fn metric(&self, name: &str) -> f64 {
        let text = self.get("/metrics").text();
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no metric {name} in:\n{text}"))
    }

    /// Waits until `name` reaches `value` (the worker updates metrics after the response ends).
    pub fn wait_metric(&self, name: &str, value: f64) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let v = self.metric(name);
            if v == value {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{name} stayed {v}, expected {value}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Server {
    /// Sends the server SIGTERM.
    pub fn terminate(&self) {
        let ok = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -TERM {}", self.child.id());
    }

    /// The exit status once the process has ended, or None after `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A streaming request's `data:` payloads (without the `data: ` prefix), through `[DONE]`.
pub fn stream_data(server: &Server, path: &str, body: &Value) -> Vec<String> {
    let conn = client::send(&server.addr, "POST", path, &[], body.to_string().as_bytes())
        .unwrap_or_else(|e| panic!("POST {path}: {e}"));
    assert_eq!(conn.status, 200, "streaming {path}");
    let ct = conn
        .headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-type"))
        .map(|(_, v)| v.clone());
    assert_eq!(ct.as_deref(), Some("text/event-stream"));
    let mut events = conn.events();
    let mut out = Vec::new();
    while let Some(ev) = events.next_event().expect("reading the stream") {
        for line in ev.lines() {
            if let Some(d) = line.strip_prefix("data: ") {
                out.push(d.to_string());
            }
        }
    }
    out
}

/// Reassembles a chat stream: (reasoning, content, finish_reason).
pub fn reassemble_chat(data: &[String]) -> (String, String, String) {
    let (mut reasoning, mut content, mut finish) = (String::new(), String::new(), String::new());
    for d in data.iter().filter(|d| d.as_str() != "[DONE]") {
        let v: Value = serde_json::from_str(d).expect("a JSON chunk");
        for c in v["choices"].as_array().into_iter().flatten() {
            reasoning.push_str(c["delta"]["reasoning_content"].as_str().unwrap_or(""));
            content.push_str(c["delta"]["content"].as_str().unwrap_or(""));
            if let Some(f) = c["finish_reason"].as_str() {
                finish = f.to_string();
            }
        }
    }
    (reasoning, content, finish)
}
