#!/usr/bin/env bash
# GPU checks for the kernels: the CUDA-only tests, then the kernel micro-benchmark.
# Budget: under 8 minutes on one GPU (tests ~1-3 min, benchmark < 1 min).
set -euo pipefail
cd "$(dirname "$0")/.."

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

timeout 300 python -m pytest -m gpu tests/ -q -x --timeout=300 -p no:cacheprovider
timeout 60 python scripts/bench_kernels.py --dtype bfloat16 --block-size 16
timeout 45 python scripts/bench_kernels.py --dtype float16 --block-size 32 --reps 10
