#!/usr/bin/env bash
# GPU checks: issue 54's figures (attention at Llama-3.1-8B's shapes as fractions of the bf16
# matmul rate and copy bandwidth measured in the same run, beside torch's SDPA;
# pdserve/bench/kernels/gpu_figures.py), the whole engine's decode step (eager and under a
# CUDA graph) and prefill on a random-weight 8B in bf16 (gpu_engine_step.py), the CUDA-only
# tests (kernels, the engine on the GPU, dummy weights), a measured profile of one GPU worker
# serving Llama-3.1-8B's shape (random weights: load_format dummy; GPU_PROFILE=1 only), then
# the weight-only int8/q4 matmuls vs cuBLAS on the dequantized weight and torch's
# _weight_int8pack_mm.
# Budget: under 8 minutes on one GPU without GPU_PROFILE (timeouts: figures 120 s, engine
# 100 s, tests 200 s, quant benchmark 45 s); on an H200 the tests took 160 s (2026-12-04)
# before the split-K, bf16 and CUDA-graph tests were added. They run the prefill kernel in one
# config (PDSERVE_PREFILL_AUTOTUNE=0: autotuning each head dim would compile five); the
# figures autotune it and check it against SDPA. `pdserve bench attention` (the older table at
# 9/3 heads) is no longer run here: the figures supersede it.
# Tensor parallelism (issue 49): the workers at TP=1 on the GPU are what test_engine_cuda and
# test_disagg_cuda check here; TP > 1 needs NCCL between GPUs, which a one-GPU machine cannot
# check (docs/ARCHITECTURE.md, "Tensor parallelism").
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
# The figures first: they are what a short GPU session is for. Limits, prefill (autotune
# compiles its 5 configs on the first call), decode at batch 1/32 x context 4k/32k.
timeout 120 python -m pdserve.bench.kernels.gpu_figures --json "$results/gpu_figures.json" \
  || rc=$?
timeout 100 python -m pdserve.bench.kernels.gpu_engine_step \
  --json "$results/gpu_engine_step.json" || rc=$?
PDSERVE_PREFILL_AUTOTUNE=0 timeout 200 python -m pytest -m gpu $gpu_tests -q --timeout=150 \
  -p no:cacheprovider || rc=$?
# One worker's latency tables on this GPU, for `pdserve plan` (docs/PLANNING.md section 6):
# with GPU_PROFILE=1 only, since on an H200 (2026-12-04) its prefill points took 4-24 s each and
# the whole grid did not finish in 240 s (the engine's GPU prefill needs profiling first).
if [ "${GPU_PROFILE:-0}" = 1 ]; then
  timeout 180 python -m pdserve.cli profile --config cluster_configs/profile_llama8b_gpu.yaml \
    --device cuda --skip-router --out "$results/profile_gpu_llama8b.json" || rc=$?
fi
# Weight-only matmuls (kernels/triton_quant.py), decode rows; each variant compiles on its
# first call. The benchmark runs as its own module (`pdserve bench triton-quant` alone), which
# imports no serving package.
timeout 45 python -m pdserve.bench.kernels.triton_quant --dtypes bfloat16,float32 \
  --rows 1,8,32,64 --reps 30 --json "$results/triton_quant.json" || rc=$?
exit $rc
