#!/usr/bin/env bash
# Loopback load test: starts `serve` on a free port, runs concurrent streaming clients against it
# (tools/src/bin/load-test), stops it. Bounded in requests and time; fails on any failed request
# and on cache blocks still held at the end. bench/soak.sh with a request bound instead of a
# duration and no cancellations (CANCEL= sets some; SERVE_ARGS, BIN as there).
#
#   bench/load-test.sh                  # a tiny synthetic checkpoint, release build
#   MODEL=default bench/load-test.sh    # the embedded small checkpoint
#   MODEL=/path/to/release-dir CLIENTS=4 REQUESTS=32 MAX_TOKENS=64 bench/load-test.sh
set -euo pipefail

export CLIENTS=${CLIENTS:-8}
export REQUESTS=${REQUESTS:-64}
export MAX_TOKENS=${MAX_TOKENS:-16}
export TIME_LIMIT=${TIME_LIMIT:-120}
export MODEL=${MODEL:-tiny}
export CANCEL=${CANCEL:-0}
export DURATION=0
exec "$(dirname "$0")/soak.sh"
