#!/usr/bin/env bash
# GPU checks: the CUDA-only tests (kernels, and the engine on the GPU), then the kernel
# micro-benchmark.
# Budget: under 8 minutes on one GPU (tests ~1-3 min, benchmark < 1 min); 90 s on an H200.
# The disaggregated GPU tests need the project's serving deps (grpcio/protobuf as pinned,
# crc32c): `pip install -e .` first, or on an offline box install their wheels with
# `pip install --target DIR` and put DIR on PYTHONPATH (the local cluster passes it on).
set -euo pipefail
cd "$(dirname "$0")/.."

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

# Only the modules that hold GPU tests: the others import serving packages (ray, fastapi,
# crc32c, gguf) that a bare GPU image may lack, and one collection error stops the run.
gpu_tests=$(grep -l "mark.gpu" tests/test_*.py)
# Every step runs (a failing test does not hide the benchmark); the exit status is the worst.
rc=0
timeout 300 python -m pytest -m gpu $gpu_tests -q --timeout=240 -p no:cacheprovider || rc=$?
timeout 60 python scripts/bench_kernels.py --dtype bfloat16 --block-size 16 || rc=$?
timeout 45 python scripts/bench_kernels.py --dtype float16 --block-size 32 --reps 10 || rc=$?
exit $rc
