#!/usr/bin/env bash
# Side by side on the mixed workload, same seed and SLOs: disaggregated 1 prefill + 1 decode
# worker (1 thread each, separate processes) vs one colocated worker (2 threads), and vLLM's
# CPU build when PEER_URL is given (../shared/peers/vllm-cpu.sh serves it).
#
#   bash scripts/bench_compare.sh                    # RATES=0.1,0.2,0.3 N=20 by default
#   PEER_URL=http://127.0.0.1:8011 bash scripts/bench_compare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${BENCH_OUT:-/tmp/pdserve-bench}
RATES=${RATES:-0.1,0.2,0.3}
N=${N:-20}
SLO_TTFT=${SLO_TTFT:-3}
SLO_TPOT=${SLO_TPOT:-0.1}
mkdir -p "$OUT"
export GRPC_VERBOSITY=${GRPC_VERBOSITY:-ERROR}

sweep() {  # name url
  python -m pdserve.bench sweep --url "$2" --workload mixed --rates "$RATES" --num-requests "$N" \
    --slo-ttft "$SLO_TTFT" --slo-tpot "$SLO_TPOT" --temperature 0 --seed 2 --no-progress \
    --json "$OUT/compare_$1.json" | tail -n 6
}

cluster() {  # name, bench_cluster args...
  local name=$1
  shift
  python scripts/bench_cluster.py --model embedded "$@" >"$OUT/$name.out" 2>"$OUT/$name.log" &
  local pid=$!
  for _ in $(seq 600); do grep -q '^URL ' "$OUT/$name.out" && break; sleep 1; done
  echo "== $name"
  sweep "$name" "$(awk '/^URL /{print $2; exit}' "$OUT/$name.out")"
  kill "$pid"
  wait "$pid" 2>/dev/null || true
}

cluster disaggregated --threads 1
cluster colocated --num-prefill 0 --threads 2
if [ -n "${PEER_URL:-}" ]; then
  echo "== vllm-cpu at $PEER_URL"
  sweep vllm "$PEER_URL"
fi
