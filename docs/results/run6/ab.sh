#!/usr/bin/env bash
set -euo pipefail
OUT=/tmp/run6/ab
export GRPC_VERBOSITY=ERROR
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
(cd /work/main && exec python scripts/bench_cluster.py --model embedded --threads 1 >$OUT/new.out 2>$OUT/new.log) & PIDS+=($!)
(cd /tmp/old6 && PYTHONPATH=/tmp/old6 TORCH_EXTENSIONS_DIR=/tmp/old6_ext exec python scripts/bench_cluster.py --model embedded --threads 1 >$OUT/old.out 2>$OUT/old.log) & PIDS+=($!)
(cd /work/main && exec python scripts/bench_cluster.py --model embedded --num-prefill 0 --threads 2 >$OUT/colo.out 2>$OUT/colo.log) & PIDS+=($!)
url_of() { for _ in $(seq 900); do grep -q '^URL ' "$OUT/$1.out" && { awk '/^URL /{print $2; exit}' "$OUT/$1.out"; return; }; sleep 1; done; echo "no $1" >&2; exit 1; }
NEW=$(url_of new); OLD=$(url_of old); COLO=$(url_of colo)
cd /work/main && python -m pdserve.bench compare --url "$NEW" --name disagg_new --against "disagg_old=$OLD" --against "colocated_new=$COLO" \
  --workload mixed --rates "$RATES" --num-requests 30 --slo-ttft 3 --slo-tpot 0.1 --temperature 0 --seed 2 --no-progress --json $OUT/compare_$TAG.json
