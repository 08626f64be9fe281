#!/usr/bin/env bash
# Loopback load test: starts `serve` on a free port, runs concurrent streaming clients against it
# (tools/src/bin/load-test), stops it. Bounded in requests and time; fails on any failed request.
#
#   bench/load-test.sh                  # a tiny synthetic checkpoint, release build
#   MODEL=default bench/load-test.sh    # the embedded small checkpoint
#   MODEL=/path/to/release-dir CLIENTS=4 REQUESTS=32 MAX_TOKENS=64 bench/load-test.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PROFILE=${PROFILE:-release}
CLIENTS=${CLIENTS:-8}
REQUESTS=${REQUESTS:-64}
MAX_TOKENS=${MAX_TOKENS:-16}
TIME_LIMIT=${TIME_LIMIT:-120}
MODEL=${MODEL:-}

cargo build --profile "$PROFILE" -p tools --bin serve --bin load-test --bin make-model
bin=target/$([ "$PROFILE" = dev ] && echo debug || echo "$PROFILE")

work=$(mktemp -d)
pid=
cleanup() {
    if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

model_args=()
case "$MODEL" in
    "") "$bin/make-model" --arch xing4_0 --preset tiny --out "$work/tiny" --quiet >/dev/null
        model_args=(--model "$work/tiny") ;;
    default) ;;
    *) model_args=(--model "$MODEL") ;;
esac

"$bin/serve" "${model_args[@]}" --host 127.0.0.1 --port 0 >"$work/serve.out" 2>"$work/serve.err" &
pid=$!
addr=
for _ in $(seq 1200); do
    addr=$(sed -n 's/.*ready on http:\/\/\([^ ]*\).*/\1/p' "$work/serve.out" | head -n1)
    [ -n "$addr" ] && break
    kill -0 "$pid" 2>/dev/null || { cat "$work/serve.err" >&2; exit 1; }
    sleep 0.1
done
[ -n "$addr" ] || { echo "serve did not become ready" >&2; cat "$work/serve.err" >&2; exit 1; }

"$bin/load-test" --url "http://$addr" --clients "$CLIENTS" --requests "$REQUESTS" \
    --max-tokens "$MAX_TOKENS" --time-limit "$TIME_LIMIT"
curl -s "http://$addr/metrics" 2>/dev/null | grep -E '^xing4_(request_success_total|cancellations_total|time_to_first_token_seconds_(sum|count))' || true
