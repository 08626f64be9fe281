#!/usr/bin/env bash
# Bounded soak: starts `serve` on a free port, runs concurrent streaming clients against it for
# DURATION seconds with a fraction of them cancelled midway and a fraction read slowly
# (tools/src/bin/load-test), samples the server's resident memory every 10 s, stops it.
# Fails on any failed request, on cache blocks still held once the clients are gone, and on
# resident memory at the end more than RSS_GROWTH_MAX (default 1.25) times its sample at 60 s
# (after warm-up). The load test's output (its last line `load-test: summary ...`) and a line
# `soak: rss ...` go to stdout.
#
#   bench/soak.sh                                   # 64 clients, 5 min, the embedded small checkpoint
#   CLIENTS=16 DURATION=20 MODEL=tiny bench/soak.sh # a tiny synthetic checkpoint, a short run
#   BIN=.bin/gpu MODEL=/tmp/xing4-full SERVE_ARGS="--device cuda:0 --max-num-seqs 64" bench/soak.sh
#
# MODEL: default (the embedded small checkpoint), tiny (made here), or a path. BIN: a directory
# of prebuilt serve/load-test/make-model (no cargo; the GPU host has none). DURATION=0 bounds
# the run by REQUESTS and TIME_LIMIT instead (bench/load-test.sh). SERVE_ARGS and
# LOAD_TEST_ARGS are split on spaces and passed on. SERVE_BIN: another `serve` binary to run
# (another build's, for an A/B), BIN's otherwise.
set -euo pipefail
# A relative BIN or SERVE_BIN is the caller's, so resolve it before moving to the repository root.
BIN=${BIN:+$(cd "$BIN" && pwd)}
SERVE_BIN=${SERVE_BIN:+$(cd "$(dirname "$SERVE_BIN")" && pwd)/$(basename "$SERVE_BIN")}
cd "$(dirname "$0")/.."

PROFILE=${PROFILE:-release}
CLIENTS=${CLIENTS:-64}
DURATION=${DURATION:-300}
CANCEL=${CANCEL:-0.1}
SLOW=${SLOW:-0.1}
SLOW_READ_MS=${SLOW_READ_MS:-50}
RSS_GROWTH_MAX=${RSS_GROWTH_MAX:-1.25}
MAX_TOKENS=${MAX_TOKENS:-64}
MODEL=${MODEL:-default}
REQUESTS=${REQUESTS:-64}
TIME_LIMIT=${TIME_LIMIT:-120}
SEED=${SEED:-0}
SERVE_ARGS=${SERVE_ARGS:-}
LOAD_TEST_ARGS=${LOAD_TEST_ARGS:-}
# Prompts of this many token ids through /v1/completions (0: chat prompts of 1 to 20 sentences).
PROMPT_TOKENS=${PROMPT_TOKENS:-0}
# The full checkpoint takes a while to page in and upload.
READY_TIMEOUT=${READY_TIMEOUT:-600}

bin=$BIN
if [ -z "$bin" ]; then
    cargo build --profile "$PROFILE" -p tools --bin serve --bin load-test --bin make-model >&2
    bin=target/$([ "$PROFILE" = dev ] && echo debug || echo "$PROFILE")
fi

work=$(mktemp -d)
pid=
cleanup() {
    if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

model_args=()
case "$MODEL" in
    tiny) "$bin/make-model" --arch xing4_0 --preset tiny --out "$work/tiny" --quiet >/dev/null
        model_args=(--model "$work/tiny") ;;
    default) ;;
    *) model_args=(--model "$MODEL") ;;
esac

# shellcheck disable=SC2086
"${SERVE_BIN:-$bin/serve}" "${model_args[@]}" $SERVE_ARGS --host 127.0.0.1 --port 0 >"$work/serve.out" 2>"$work/serve.err" &
pid=$!
addr=
for _ in $(seq $((READY_TIMEOUT * 10))); do
    addr=$(sed -n 's/.*ready on http:\/\/\([^ ]*\).*/\1/p' "$work/serve.out" | head -n1)
    [ -n "$addr" ] && break
    kill -0 "$pid" 2>/dev/null || { cat "$work/serve.err" >&2; exit 1; }
    sleep 0.1
done
[ -n "$addr" ] || { echo "serve did not become ready in ${READY_TIMEOUT}s" >&2; cat "$work/serve.err" >&2; exit 1; }

# Resident memory every 10 s while the clients run.
( while kill -0 "$pid" 2>/dev/null; do
      awk -v t="$SECONDS" '/^VmRSS:/ {print t, $2}' "/proc/$pid/status" 2>/dev/null || true
      sleep 10
  done ) >"$work/rss.log" &
sampler=$!

bound=(--requests "$REQUESTS" --time-limit "$TIME_LIMIT")
[ "$DURATION" != 0 ] && bound=(--duration "$DURATION")
rc=0
# shellcheck disable=SC2086
"$bin/load-test" --url "http://$addr" --clients "$CLIENTS" --max-tokens "$MAX_TOKENS" \
    --cancel-fraction "$CANCEL" --slow-fraction "$SLOW" --slow-read-ms "$SLOW_READ_MS" \
    --prompt-tokens "$PROMPT_TOKENS" --seed "$SEED" "${bound[@]}" $LOAD_TEST_ARGS || rc=$?
kill "$sampler" 2>/dev/null || true
# The sample nearest 60 s after start (or the first) against the last, in KiB.
rss_line=$(awk -v lim="$RSS_GROWTH_MAX" '
    { t[NR] = $1; k[NR] = $2 }
    END {
        if (NR == 0) { print "soak: rss no samples"; exit }
        w = 1; for (i = 1; i <= NR; i++) if (t[i] - t[1] <= 60) w = i
        min = k[1]; max = k[1]; for (i = 1; i <= NR; i++) { if (k[i] < min) min = k[i]; if (k[i] > max) max = k[i] }
        s = ""; for (i = 1; i <= NR; i++) s = s sprintf("%s%.0f", (i > 1 ? "," : ""), k[i] / 1024)
        g = k[NR] / k[w]
        printf "soak: rss samples=%d warm_mib=%.0f end_mib=%.0f min_mib=%.0f max_mib=%.0f growth=%.3f limit=%s series_mib=%s\n", NR, k[w] / 1024, k[NR] / 1024, min / 1024, max / 1024, g, lim, s
        if (g > lim) exit 3
    }' "$work/rss.log") || { [ "$rc" = 0 ] && rc=3; }
echo "$rss_line"
# The server's own counts, to set beside the client's (cancellations as the server saw them).
curl -s "http://$addr/metrics" 2>/dev/null |
    grep -E '^xing4_(request_success_total|request_errors_total|cancellations_total|time_to_first_token_seconds_(sum|count)|engine_step|host_token_seconds|plan_build)' || true
if [ "$rc" != 0 ]; then
    kill -0 "$pid" 2>/dev/null || echo "serve exited during the run" >&2
    echo "--- serve stderr (last 40 lines)" >&2
    tail -n 40 "$work/serve.err" >&2
fi
exit "$rc"
