#!/usr/bin/env bash
# GPU checks: the CUDA-only tests (kernels, the engine on the GPU, dummy weights), a measured
# profile of one GPU worker serving Llama-3.1-8B's shape (random weights: load_format dummy;
# GPU_PROFILE=1),
# then the kernel micro-benchmarks (the weight-only int8/q4 matmuls vs cuBLAS on the dequantized
# weight and torch's _weight_int8pack_mm; attention).
# Budget: under 10 minutes on one GPU (timeouts: tests 270 s, profile 180 s, benchmarks 105 s);
# on an H200 the tests took 160 s (2026-12-04), the benchmarks about 50 s.
# The disaggregated GPU tests need the project's serving deps (grpcio/protobuf as pinned,
# crc32c, pydantic): `pip install -e .` first, or on an offline box install their wheels with
# `pip install --target DIR` and put DIR on PYTHONPATH (the local cluster passes it on).
set -uo pipefail
cd "$(dirname "$0")/.."
results=${OUT:-docs/results/gpu}  # $OUT: where the device runner collects files
mkdir -p "$results"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

# Only the modules that hold GPU tests: the others import serving packages (ray, fastapi, gguf)
# that a bare GPU image may lack, and one collection error stops the run.
gpu_tests=$(grep -l "mark.gpu" tests/test_*.py)
# Every step runs (a failing test does not hide the benchmark); the exit status is the worst.
rc=0
timeout 270 python -m pytest -m gpu $gpu_tests -q --timeout=200 -p no:cacheprovider || rc=$?
# One worker's latency tables on this GPU, for `pdserve plan` (docs/PLANNING.md section 6):
# with GPU_PROFILE=1 only, since on an H200 (2026-12-04) its prefill points took 4-24 s each and
# the whole grid did not finish in 240 s (the engine's GPU prefill needs profiling first).
if [ "${GPU_PROFILE:-0}" = 1 ]; then
  timeout 180 python -m pdserve.cli profile --config cluster_configs/profile_llama8b_gpu.yaml \
    --device cuda --skip-router --out "$results/profile_gpu_llama8b.json" || rc=$?
fi
# Weight-only matmuls (kernels/triton_quant.py), decode rows; each variant compiles on its
# first call. Each benchmark runs as its own module (`pdserve bench triton-quant` / `attention`
# alone), which imports no serving package.
timeout 60 python -m pdserve.bench.kernels.triton_quant --dtypes bfloat16,float32 \
  --rows 1,8,32,64 --reps 30 --json "$results/triton_quant.json" || rc=$?
timeout 45 python -m pdserve.bench.kernels.attention --dtype bfloat16 --block-size 16 || rc=$?
exit $rc
