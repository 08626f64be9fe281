//! Prometheus text exposition: vLLM's metric names under the `xing4_` prefix, the engine's
//! gauges, and the prefix store's family (seed §7).

use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use engine::prefix::PrefixStats;
use engine::scheduler::StepTime;

const PREFIX: &str = "xing4_";

/// vLLM's buckets, with two finer ones in front for the small CPU checkpoints.
const TTFT_BUCKETS: [f64; 24] = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// Sequences in a decode step: the batch buckets.
const BATCH_BUCKETS: [f64; 9] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

const ITL_BUCKETS: [f64; 21] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
];

struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {PREFIX}{name} {help}");
        let _ = writeln!(out, "# TYPE {PREFIX}{name} histogram");
        let mut acc = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            acc += c;
            let _ = writeln!(out, "{PREFIX}{name}_bucket{{le=\"{b}\"}} {acc}");
        }
        let _ = writeln!(out, "{PREFIX}{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{PREFIX}{name}_sum {}", self.sum);
        let _ = writeln!(out, "{PREFIX}{name}_count {}", self.count);
    }
}

pub struct Metrics {
    pub running: AtomicU64,
    pub waiting: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub success_stop: AtomicU64,
    pub success_length: AtomicU64,
    pub errors: AtomicU64,
    pub cancellations: AtomicU64,
    pub weight_bytes: AtomicU64,
    pub kv_cache_bytes: AtomicU64,
    pub context_positions: AtomicU64,
    pub loaded: AtomicU64,
    /// Requests the scheduler holds but has not admitted (beside `waiting`, those not yet
    /// handed to it).
    pub queued: AtomicU64,
    pub preemptions: AtomicU64,
    pub kv_cache_blocks: AtomicU64,
    /// Referenced cache blocks over all, in millionths.
    pub cache_usage_ppm: AtomicU64,
    ttft: Mutex<Histogram>,
    itl: Mutex<Histogram>,
    batch: Mutex<Histogram>,
    prefix: Mutex<PrefixStats>,
    step_time: Mutex<StepTime>,
}

impl Metrics {
    /// The store's budget is known before anything is served, so it is published from the start.
    pub fn new(prefix_budget: usize, context_positions: usize) -> Metrics {
        Metrics {
            running: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            success_stop: AtomicU64::new(0),
            success_length: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            cancellations: AtomicU64::new(0),
            weight_bytes: AtomicU64::new(0),
            kv_cache_bytes: AtomicU64::new(0),
            context_positions: AtomicU64::new(context_positions as u64),
            loaded: AtomicU64::new(0),
            queued: AtomicU64::new(0),
            preemptions: AtomicU64::new(0),
            kv_cache_blocks: AtomicU64::new(0),
            cache_usage_ppm: AtomicU64::new(0),
            ttft: Mutex::new(Histogram::new(&TTFT_BUCKETS)),
            itl: Mutex::new(Histogram::new(&ITL_BUCKETS)),
            batch: Mutex::new(Histogram::new(&BATCH_BUCKETS)),
            prefix: Mutex::new(PrefixStats {
                budget: prefix_budget,
                ..PrefixStats::default()
            }),
            step_time: Mutex::new(StepTime::default()),
        }
    }

    pub fn observe_ttft(&self, d: Duration) {
        if let Ok(mut h) = self.ttft.lock() {
            h.observe(d.as_secs_f64());
        }
    }

    pub fn observe_itl(&self, d: Duration) {
        if let Ok(mut h) = self.itl.lock() {
            h.observe(d.as_secs_f64());
        }
    }

    /// `--prefix-cache-bytes` as published.
    pub fn prefix_budget(&self) -> usize {
        self.prefix.lock().map(|p| p.budget).unwrap_or(0)
    }

    /// Sequences of one decode step.
    pub fn observe_batch(&self, n: usize) {
        if let Ok(mut h) = self.batch.lock() {
            h.observe(n as f64);
        }
    }

    pub fn set_step_time(&self, t: StepTime) {
        if let Ok(mut s) = self.step_time.lock() {
            *s = t;
        }
    }

    pub fn set_prefix(&self, s: PrefixStats) {
        if let Ok(mut p) = self.prefix.lock() {
            *p = s;
        }
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let gauge = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {PREFIX}{name} {help}");
            let _ = writeln!(out, "# TYPE {PREFIX}{name} gauge");
            let _ = writeln!(out, "{PREFIX}{name} {v}");
        };
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {PREFIX}{name} {help}");
            let _ = writeln!(out, "# TYPE {PREFIX}{name} counter");
            let _ = writeln!(out, "{PREFIX}{name} {v}");
        };
        gauge(
            &mut out,
            "model_loaded",
            "1 once the model is loaded and requests are served.",
            self.loaded.load(Relaxed),
        );
        gauge(
            &mut out,
            "resident_bytes",
            "Resident memory of the process (VmRSS).",
            resident_bytes(),
        );
        gauge(
            &mut out,
            "weight_bytes",
            "Bytes of the checkpoint's tensors.",
            self.weight_bytes.load(Relaxed),
        );
        gauge(
            &mut out,
            "kv_cache_bytes",
            "Bytes of the allocated KV cache.",
            self.kv_cache_bytes.load(Relaxed),
        );
        gauge(
            &mut out,
            "context_positions",
            "Positions a sequence may use (--max-model-len).",
            self.context_positions.load(Relaxed),
        );
        gauge(
            &mut out,
            "num_requests_running",
            "Requests being decoded.",
            self.running.load(Relaxed),
        );
        gauge(
            &mut out,
            "num_requests_waiting",
            "Requests waiting to be admitted to the running batch.",
            self.waiting.load(Relaxed) + self.queued.load(Relaxed),
        );
        let _ = writeln!(
            out,
            "# HELP {PREFIX}gpu_cache_usage_perc Fraction of the KV cache pool's blocks held by running sequences (1 = full)."
        );
        let _ = writeln!(out, "# TYPE {PREFIX}gpu_cache_usage_perc gauge");
        let _ = writeln!(
            out,
            "{PREFIX}gpu_cache_usage_perc {}",
            self.cache_usage_ppm.load(Relaxed) as f64 / 1e6
        );
        gauge(
            &mut out,
            "kv_cache_blocks",
            "Blocks of the KV cache pool.",
            self.kv_cache_blocks.load(Relaxed),
        );
        counter(
            &mut out,
            "num_preemptions_total",
            "Sequences preempted (blocks freed, recomputed later) because the pool was full.",
            self.preemptions.load(Relaxed),
        );
        counter(
            &mut out,
            "prompt_tokens_total",
            "Prompt tokens of finished requests (cached ones included).",
            self.prompt_tokens.load(Relaxed),
        );
        counter(
            &mut out,
            "generation_tokens_total",
            "Tokens generated.",
            self.generation_tokens.load(Relaxed),
        );
        let _ = writeln!(
            out,
            "# HELP {PREFIX}request_success_total Requests that finished, by finish reason."
        );
        let _ = writeln!(out, "# TYPE {PREFIX}request_success_total counter");
        let _ = writeln!(
            out,
            "{PREFIX}request_success_total{{finished_reason=\"stop\"}} {}",
            self.success_stop.load(Relaxed)
        );
        let _ = writeln!(
            out,
            "{PREFIX}request_success_total{{finished_reason=\"length\"}} {}",
            self.success_length.load(Relaxed)
        );
        counter(
            &mut out,
            "request_errors_total",
            "Requests that failed inside the engine.",
            self.errors.load(Relaxed),
        );
        counter(
            &mut out,
            "cancellations_total",
            "Requests whose client went away before they finished.",
            self.cancellations.load(Relaxed),
        );
        if let Ok(h) = self.ttft.lock() {
            h.render(
                &mut out,
                "time_to_first_token_seconds",
                "Time from arrival to the first token, queueing included.",
            );
        }
        if let Ok(h) = self.itl.lock() {
            h.render(
                &mut out,
                "inter_token_latency_seconds",
                "Time between consecutive tokens of a request.",
            );
        }
        if let Ok(h) = self.batch.lock() {
            h.render(
                &mut out,
                "batch_size",
                "Sequences decoded together in one step.",
            );
        }
        let t = self.step_time.lock().map(|t| *t).unwrap_or_default();
        let _ = writeln!(
            out,
            "# HELP {PREFIX}engine_steps_total Engine steps, by kind (decode rows alone, a prefill chunk beside decode rows, a chunk alone)."
        );
        let _ = writeln!(out, "# TYPE {PREFIX}engine_steps_total counter");
        let _ = writeln!(
            out,
            "# HELP {PREFIX}engine_step_seconds_total Wall time of the engine's steps with their outputs' read-back, by kind."
        );
        let _ = writeln!(out, "# TYPE {PREFIX}engine_step_seconds_total counter");
        for (kind, k) in [
            ("decode", t.decode),
            ("mixed", t.mixed),
            ("prefill", t.prefill),
        ] {
            let _ = writeln!(
                out,
                "{PREFIX}engine_steps_total{{kind=\"{kind}\"}} {}",
                k.steps
            );
            let _ = writeln!(
                out,
                "{PREFIX}engine_step_seconds_total{{kind=\"{kind}\"}} {}",
                k.seconds
            );
        }
        let _ = writeln!(
            out,
            "# HELP {PREFIX}host_token_seconds_total Host time choosing tokens from logits rows and turning them into text, after the steps."
        );
        let _ = writeln!(out, "# TYPE {PREFIX}host_token_seconds_total counter");
        let _ = writeln!(
            out,
            "{PREFIX}host_token_seconds_total {}",
            t.host_token_seconds
        );
        counter(
            &mut out,
            "plan_builds_total",
            "Step plans lowered for a step shape seen for the first time.",
            t.plan_builds.count,
        );
        let _ = writeln!(
            out,
            "# HELP {PREFIX}plan_build_seconds_total Host time lowering those plans (inside the steps' time)."
        );
        let _ = writeln!(out, "# TYPE {PREFIX}plan_build_seconds_total counter");
        let _ = writeln!(
            out,
            "{PREFIX}plan_build_seconds_total {}",
            t.plan_builds.seconds
        );
        let p = self.prefix.lock().map(|p| *p).unwrap_or_default();
        counter(
            &mut out,
            "prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache (vLLM semantics: tokens).",
            p.queried_tokens,
        );
        counter(
            &mut out,
            "prefix_cache_hits_total",
            "Prompt tokens served from shared cache blocks (vLLM semantics: tokens).",
            p.reused_tokens,
        );
        counter(
            &mut out,
            "prefix_store_hits_total",
            "Requests that reused cached prefix blocks.",
            p.hits,
        );
        counter(
            &mut out,
            "prefix_store_misses_total",
            "Requests that found no cached prefix block.",
            p.misses,
        );
        counter(
            &mut out,
            "prefix_store_reused_tokens_total",
            "Positions reused instead of forwarded.",
            p.reused_tokens,
        );
        gauge(
            &mut out,
            "prefix_store_entries",
            "Full cache blocks registered under their token prefix.",
            p.entries as u64,
        );
        gauge(
            &mut out,
            "prefix_store_bytes",
            "Bytes of the registered prefix blocks.",
            p.bytes as u64,
        );
        gauge(
            &mut out,
            "prefix_store_budget_bytes",
            "--prefix-cache-bytes (0: prefix caching off).",
            p.budget as u64,
        );
        out
    }
}

/// VmRSS from /proc/self/status; 0 where there is no procfs.
fn resident_bytes() -> u64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else {
        return 0;
    };
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// One sample of `name` in an exposition (tests and the load test read metrics this way).
#[cfg(test)]
pub fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_count_everything() {
        let m = Metrics::new(1024, 64);
        m.observe_ttft(Duration::from_millis(3));
        m.observe_ttft(Duration::from_millis(30));
        m.observe_ttft(Duration::from_secs(10_000));
        let text = m.render();
        let b = |le: &str| {
            sample(
                &text,
                &format!("xing4_time_to_first_token_seconds_bucket{{le=\"{le}\"}}"),
            )
        };
        assert_eq!(b("0.002"), Some(0.0));
        assert_eq!(b("0.005"), Some(1.0));
        assert_eq!(b("0.04"), Some(2.0));
        assert_eq!(b("2560"), Some(2.0));
        assert_eq!(b("+Inf"), Some(3.0));
        assert_eq!(
            sample(&text, "xing4_time_to_first_token_seconds_count"),
            Some(3.0)
        );
    }

    #[test]
    fn the_prefix_budget_is_published_before_anything_is_served() {
        let text = Metrics::new(12345, 64).render();
        assert_eq!(
            sample(&text, "xing4_prefix_store_budget_bytes"),
            Some(12345.0)
        );
        assert_eq!(sample(&text, "xing4_prefix_store_hits_total"), Some(0.0));
        assert_eq!(sample(&text, "xing4_context_positions"), Some(64.0));
    }
}
