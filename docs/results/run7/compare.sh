#!/usr/bin/env bash
# Final code, side by side and interleaved: disaggregated 1+1 over the grpc transport (default)
# and over the flight transport, one colocated worker (2 threads), and vLLM when PEER_URL is set.
#   PEER_URL=http://127.0.0.1:8011 RATES=0.75,1.0,1.25,1.5 N=30 bash docs/results/run7/compare.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${BENCH_OUT:-/tmp/pdserve-bench7}
RATES=${RATES:-0.75,1.0,1.25,1.5}
N=${N:-30}
mkdir -p "$OUT"
export GRPC_VERBOSITY=${GRPC_VERBOSITY:-ERROR}
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
start_cluster() {  # name, bench_cluster args...
  local name=$1
  shift
  python scripts/bench_cluster.py --model embedded "$@" >"$OUT/$name.out" 2>"$OUT/$name.log" &
  PIDS+=($!)
}
url_of() {
  for _ in $(seq 600); do
    grep -q '^URL ' "$OUT/$1.out" && { awk '/^URL /{print $2; exit}' "$OUT/$1.out"; return; }
    sleep 1
  done
  echo "cluster $1 did not start" >&2
  exit 1
}
start_cluster disaggregated --threads 1
start_cluster disaggregated_flight --threads 1 --transport flight
start_cluster colocated --num-prefill 0 --threads 2
AGAINST=(--against "disaggregated_flight=$(url_of disaggregated_flight)")
AGAINST+=(--against "colocated=$(url_of colocated)")
if [ -n "${PEER_URL:-}" ]; then
  AGAINST+=(--against "vllm=$PEER_URL")
fi
python -m pdserve.bench compare --url "$(url_of disaggregated)" --name disaggregated \
  "${AGAINST[@]}" --workload mixed --rates "$RATES" --num-requests "$N" \
  --slo-ttft 3 --slo-tpot 0.1 --temperature 0 --seed 2 --no-progress \
  --json "$OUT/compare.json"
