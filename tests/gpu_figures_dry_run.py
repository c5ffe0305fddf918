"""Run pdserve/bench/kernels/gpu_figures.py's figure code on CPU at tiny shapes under the
Triton interpreter (fp32, wall-clock "timing", made-up limits): catches a broken figure
script before a GPU session spends its minutes on it. Prints the figures as JSON.

    TRITON_INTERPRET=1 python -m tests.gpu_figures_dry_run
"""

from __future__ import annotations

import json
import sys
import time

import torch

from pdserve.bench.kernels import gpu_figures as gf
from pdserve.bench.kernels import gpu_limits as gl


def cpu_time(calls, reps=1, warmup=0, rounds=1) -> float:
    start = time.perf_counter()
    for fn in calls:
        fn()
    return (time.perf_counter() - start) / len(calls)


def main() -> int:
    gf.DEVICE, gf.DTYPE = "cpu", torch.float32
    gf.HEADS, gf.KV_HEADS, gf.HEAD_DIM, gf.PREFILL_TOKENS = 4, 2, 16, 40
    gl.time_cuda = cpu_time
    gl.L2_FLUSH_BYTES = 1  # one input copy
    torch.manual_seed(0)
    # ctx 300 at batch 1: the dispatcher splits (2 splits of >= 128 keys); batch 2: no split.
    figures, diff = gf.collect_figures(1e12, 1e11, 1, [(1, 300), (2, 50)])
    print(json.dumps({"diff": diff, "figures": [f.as_dict() for f in figures]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
