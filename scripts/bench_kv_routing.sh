#!/usr/bin/env bash
# KV-aware routing against today's routing (issue 51), side by side on one workload:
# two local 1P2D clusters of the embedded model, one with the policies that were the defaults
# before it (least_queued, most_free_blocks), one with prefill_policy and decode_policy
# kv_aware (the defaults now); `pdserve bench compare` interleaves them rate by
# rate; each router's pdserve:kv_transfer_bytes_total before and after gives the KV shipped.
#
#   scripts/bench_kv_routing.sh [WORKLOAD] [RATES] [N]      # defaults: multiturn 0.5 60
#   OUT=dir SEED=0 scripts/bench_kv_routing.sh mixed 0.5 30
set -euo pipefail
cd "$(dirname "$0")/.."
WORKLOAD=${1:-multiturn}
RATES=${2:-0.5}
N=${3:-60}
SEED=${SEED:-0}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
PIDS=()

start() { # NAME [bench cluster args...]
  python -m pdserve.bench cluster --num-prefill 1 --num-decode 2 "${@:2}" \
    >"$OUT/$1.out" 2>"$OUT/$1.err" &
  PIDS+=($!)
}
stop() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  sleep 15
  for p in "${PIDS[@]}"; do pkill -KILL -P "$p" 2>/dev/null || true; kill -KILL "$p" 2>/dev/null || true; done
}
trap stop EXIT
url() { # NAME: the URL its cluster prints once ready
  for _ in $(seq 900); do
    grep -q '^URL' "$OUT/$1.out" && { awk '/^URL/{print $2}' "$OUT/$1.out"; return; }
    sleep 1
  done
  echo "cluster $1 never became ready: $OUT/$1.err" >&2
  exit 1
}
kv_bytes() { curl -s "$1/metrics" | awk '/^pdserve:kv_transfer_bytes_total/{s+=$2} END{printf "%.0f\n", s}'; }

start today --prefill-policy least_queued --decode-policy most_free_blocks
start kv_aware --prefill-policy kv_aware --decode-policy kv_aware
A=$(url today)
B=$(url kv_aware)
A0=$(kv_bytes "$A")
B0=$(kv_bytes "$B")
pdserve bench compare --url "$A" --name today --against "kv_aware=$B" --workload "$WORKLOAD" \
  --num-requests "$N" --rates "$RATES" --seed "$SEED" --slo-ttft 3 --slo-tpot 0.1 \
  --cold-start 0 --no-progress --json "$OUT/compare_$WORKLOAD.json"
A1=$(kv_bytes "$A")
B1=$(kv_bytes "$B")
SENT=$((N * $(tr ',' '\n' <<<"$RATES" | wc -l)))  # N requests at each rate
echo "KV bytes shipped (warm-ups included): today $((A1 - A0)), kv_aware $((B1 - B0));" \
  "per request: today $(((A1 - A0) / SENT)), kv_aware $(((B1 - B0) / SENT))"
echo "results: $OUT"
