//! `bench -b B --join N` on the CPU and the tiny checkpoint: a prompt longer than a step's token
//! budget is admitted over several mixed steps while the running sequences keep decoding, and
//! the table reports their inter-token latency before and during the admission.

use std::path::PathBuf;
use std::process::Command;

fn tiny_checkpoint(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bench_join_{name}_{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_make-model"))
        .args([
            "--arch", "xing4_0", "--preset", "tiny", "--force", "--quiet", "--out",
        ])
        .arg(&dir)
        .output()
        .expect("make-model runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    dir
}

fn bench(model: &PathBuf, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_bench"))
        .arg("--model")
        .arg(model)
        .args(["--device", "cpu"])
        .args(extra)
        .output()
        .expect("bench runs")
}

/// The join table's row for B=2 sequences of 8 tokens (4 generated) and a 200-token prompt
/// over steps of 16 tokens within `attention` query-key pairs, as numbers:
/// B, prompt, budget, attention budget, p50 before, p99 before, steps, p50 during, p99 during,
/// max, TTFT.
fn join_row(model: &PathBuf, attention: usize) -> (String, Vec<f64>) {
    let attention = attention.to_string();
    let out = bench(
        model,
        &[
            "-b",
            "2",
            "-p",
            "8",
            "-n",
            "4",
            "--join",
            "200",
            "--max-num-batched-tokens",
            "16",
            "--mixed-attention-budget",
            &attention,
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let row = stdout
        .lines()
        .find(|l| l.starts_with(&format!("| 2 | 200 | 16 | {attention} |")))
        .unwrap_or_else(|| panic!("no row for B=2 in\n{stdout}"))
        .to_string();
    let cells: Vec<f64> = row
        .trim_matches('|')
        .split('|')
        .map(|c| c.trim().parse::<f64>().unwrap_or(f64::NAN))
        .collect();
    assert_eq!(cells.len(), 11, "{row}");
    (row, cells)
}

#[test]
fn a_long_prompt_joins_running_sequences_over_several_mixed_steps() {
    let model = tiny_checkpoint("admit");
    // 200 tokens against a budget of 16 a step: the scheduler takes at least one 64-position
    // block a step, so the prompt needs 4 chunks, each a mixed step with the 2 decode rows.
    let (row, cells) = join_row(&model, 0);
    assert_eq!(
        cells[6], 4.0,
        "steps to admit 200 tokens in 64-token chunks: {row}"
    );
    let (p50b, p99b, p50d, p99d, max, ttft) =
        (cells[4], cells[5], cells[7], cells[8], cells[9], cells[10]);
    assert!(p50b > 0.0 && p99b >= p50b, "{row}");
    assert!(p50d > 0.0 && p99d >= p50d && max >= p99d, "{row}");
    // The prompt's first token comes after all four of its steps.
    assert!(ttft >= 4.0 * p50d * 0.5, "{row}");
    let _ = std::fs::remove_dir_all(&model);
}

#[test]
fn an_attention_budget_cuts_the_joining_prompt_into_shorter_chunks_as_it_goes_deeper() {
    let model = tiny_checkpoint("attention");
    // Within 3,000 query-key pairs a step: 48, 32, then 16-token chunks, and the last 8.
    let (row, cells) = join_row(&model, 3000);
    assert_eq!(cells[6], 10.0, "48 + 32 + 7·16 + 8 tokens: {row}");
    let _ = std::fs::remove_dir_all(&model);
}

#[test]
fn a_join_of_no_tokens_or_without_batches_is_refused_by_name() {
    let model = tiny_checkpoint("refused");
    let out = bench(&model, &["-b", "2", "-p", "8", "--join", "0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--join must be at least 1 token"));
    let out = bench(&model, &["--join", "5"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--batch"));
    let _ = std::fs::remove_dir_all(&model);
}

/// With a token or two generated a sequence finishes at once: no step has all B decoding, so
/// the row says `-` and why, rather than printing a rate of zero.
#[test]
fn a_batch_with_no_step_where_all_decode_reports_no_rate() {
    let model = tiny_checkpoint("no_window");
    let out = bench(&model, &["-b", "2", "-p", "8", "-n", "1", "-r", "1"]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let row = stdout
        .lines()
        .find(|l| l.starts_with("| 2 | 8 |"))
        .unwrap_or_else(|| panic!("no row for B=2 in\n{stdout}"));
    assert!(row.contains("| - | - | - |"), "{row}");
    assert!(
        stderr.contains("no step had all 2 sequences decoding"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&model);
}
