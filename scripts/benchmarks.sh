#!/usr/bin/env bash
# Run the benchmarks and regenerate the results section of docs/BENCHMARKS.md.
#
#   bash scripts/benchmarks.sh              # ~10 min on 2 CPU cores with the embedded model
#   QUICK=1 bash scripts/benchmarks.sh      # small runs, to check the script end to end
#
# Environment (all optional):
#   BENCH_OUT     where the JSON/PNG results go (default /tmp/pdserve-bench)
#   BENCH_MODEL   model for the cluster and the TTFT share (default embedded)
#   BENCH_URL     bench this OpenAI-compatible server instead of starting a local cluster
#   SERVE_RATE SERVE_N SLO_TTFT SLO_TPOT SWEEP_RATES SWEEP_N   load and SLOs (seconds)
#   ENGINE_ARGS   extra arguments for `bench engine`, e.g. "--threads 1" (the targets are quoted
#                 at 1 thread; without it, torch's default thread count)
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${BENCH_OUT:-/tmp/pdserve-bench}
MODEL=${BENCH_MODEL:-embedded}
URL=${BENCH_URL:-}
if [ "${QUICK:-0}" = 1 ]; then
  REPEATS=2; TTFT_RUNS=1; ROUTER_N=60; SERVE_N=${SERVE_N:-8}; SWEEP_N=${SWEEP_N:-6}
  SWEEP_RATES=${SWEEP_RATES:-0.1,0.2}
else
  REPEATS=5; TTFT_RUNS=3; ROUTER_N=300
fi
# Defaults for the 135M model on 2 shared CPU cores (~0.1-0.2 req/s of mixed load); on a GPU
# raise the rates and tighten the SLOs.
SERVE_RATE=${SERVE_RATE:-0.1}
SERVE_N=${SERVE_N:-20}
SLO_TTFT=${SLO_TTFT:-10}
SLO_TPOT=${SLO_TPOT:-0.5}
SWEEP_RATES=${SWEEP_RATES:-0.05,0.1,0.2}
SWEEP_N=${SWEEP_N:-12}

export GRPC_VERBOSITY=${GRPC_VERBOSITY:-ERROR}  # grpc core logs every GOAWAY at shutdown
mkdir -p "$OUT"
rm -f "$OUT"/{transfer,engine,router,serve,sweep}.json
bench() { python -m pdserve.bench "$@"; }

echo "== bench transfer"
bench transfer --model "$MODEL" --repeats "$REPEATS" --ttft-runs "$TTFT_RUNS" \
  --ttft-transports grpc,flight,torch_dist,local --json "$OUT/transfer.json"

echo "== bench engine"
if bench engine --help >/dev/null 2>&1; then
  # shellcheck disable=SC2086  # ENGINE_ARGS is a list of words
  bench engine ${ENGINE_ARGS:-} --json "$OUT/engine.json"
else
  echo "skipped: no 'bench engine' in this checkout"
fi

echo "== bench router"
bench router --requests "$ROUTER_N" --json "$OUT/router.json"

CLUSTER_PID=""
stop_cluster() {
  if [ -n "$CLUSTER_PID" ]; then
    kill "$CLUSTER_PID" 2>/dev/null || true
    wait "$CLUSTER_PID" 2>/dev/null || true
    CLUSTER_PID=""
  fi
}
trap stop_cluster EXIT

if [ -z "$URL" ]; then
  echo "== starting a local cluster (1 prefill + 1 decode, $MODEL) with the HTTP API"
  bench cluster --model "$MODEL" >"$OUT/cluster.out" 2>"$OUT/cluster.log" &
  CLUSTER_PID=$!
  for _ in $(seq 900); do  # the first use of the embedded model converts it (minutes)
    if grep -q '^URL ' "$OUT/cluster.out"; then
      URL=$(awk '/^URL /{print $2; exit}' "$OUT/cluster.out")
      break
    fi
    if ! kill -0 "$CLUSTER_PID" 2>/dev/null; then
      echo "skipped serve and sweep: the cluster exited ($(tail -n 1 "$OUT/cluster.log"))"
      CLUSTER_PID=""
      break
    fi
    sleep 1
  done
fi

if [ -n "$URL" ]; then
  echo "== bench serve against $URL"
  bench serve --url "$URL" --workload mixed --rate "$SERVE_RATE" --num-requests "$SERVE_N" \
    --slo-ttft "$SLO_TTFT" --slo-tpot "$SLO_TPOT" --json "$OUT/serve.json" \
    --plot "$OUT/serve_cdf.png"
  echo "== bench sweep against $URL"
  bench sweep --url "$URL" --workload mixed --rates "$SWEEP_RATES" --num-requests "$SWEEP_N" \
    --slo-ttft "$SLO_TTFT" --slo-tpot "$SLO_TPOT" --json "$OUT/sweep.json"
fi
stop_cluster

bench report "$OUT" docs/BENCHMARKS.md
echo "results: $OUT (latency CDFs: $OUT/serve_cdf.png)"
