#!/usr/bin/env bash
# Tests deploy/nginx-two-gpus.conf on loopback: two `serve` processes (on the CPU here, one per
# GPU on a GPU host: DEVICE0/DEVICE1), nginx in front, concurrent requests through it; passes when
# every request succeeds and both servers answered some (read from their /metrics).
set -euo pipefail
cd "$(dirname "$0")/.."
SERVE=${SERVE:-target/release/serve}
MODEL=${MODEL:-$(mktemp -d)/tiny}
[ -f "$MODEL/model.gguf" ] || cargo run -q --release -p tools --bin make-model -- --arch xing4_0 --preset tiny --out "$MODEL" >/dev/null
work=$(mktemp -d)
mkdir -p "$work/nginx"
pids=()
cleanup() {
    nginx -c "$PWD/deploy/nginx-two-gpus.conf" -p "$work/nginx/" -s stop 2>/dev/null || true
    kill "${pids[@]}" 2>/dev/null || true
}
trap cleanup EXIT
"$SERVE" --model "$MODEL" --device "${DEVICE0:-cpu}" --port 8081 --served-model-name xing4 >"$work/s0.log" 2>&1 & pids+=($!)
"$SERVE" --model "$MODEL" --device "${DEVICE1:-cpu}" --port 8082 --served-model-name xing4 >"$work/s1.log" 2>&1 & pids+=($!)
for port in 8081 8082; do
    for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
done
nginx -c "$PWD/deploy/nginx-two-gpus.conf" -p "$work/nginx/"
sleep 0.5
n=${REQUESTS:-16}
for i in $(seq "$n"); do
    curl -sf http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \
        -d "{\"model\":\"xing4\",\"messages\":[{\"role\":\"user\",\"content\":\"request $i\"}],\"max_tokens\":8,\"temperature\":0}" \
        -o "$work/r$i.json" &
done
fail=0
for job in $(jobs -p); do
    case " ${pids[*]} " in *" $job "*) continue ;; esac
    wait "$job" || fail=$((fail + 1))
done
ok=$(grep -l '"chat.completion"' "$work"/r*.json | wc -l)
per_server() { curl -s "http://127.0.0.1:$1/metrics" | awk '/^xing4_request_success_total/ {s += $2} END {print s + 0}'; }
a=$(per_server 8081) b=$(per_server 8082)
echo "through nginx: $ok/$n ok, $fail failed; served by :8081 $a, by :8082 $b"
[ "$ok" -eq "$n" ] && [ "$fail" -eq 0 ] && [ "$a" -gt 0 ] && [ "$b" -gt 0 ]
