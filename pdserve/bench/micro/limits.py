"""This machine's limits, measured in the same run as the figures that are divided by them."""

from __future__ import annotations

import torch

from pdserve.measure.timing import best_time


def read_bandwidth(num_bytes: int = 2 * 2**30) -> float:
    """Streaming read bandwidth (bytes/s): a sum over a buffer well beyond the caches (this
    machine reports a large shared L3, so the buffer is 2 GiB)."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    return num_bytes / best_time(lambda: x.sum(), reps=7)


def gemm_peak(n: int = 2048, dtype: torch.dtype = torch.float32) -> float:
    """GEMM FLOP/s in ``dtype`` (fp32, or bf16: AMX where the CPU has it; int8: int8 x int8 ->
    int32 operations/s, oneDNN's VNNI or AMX kernel) at the current thread count (square n x n
    x n, best of several)."""
    if dtype == torch.int8:
        a = torch.randint(-127, 128, (n, n), dtype=torch.int8)
        b = torch.randint(-127, 128, (n, n), dtype=torch.int8)
        return 2 * n**3 / best_time(lambda: torch._int_mm(a, b), reps=7)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    return 2 * n**3 / best_time(lambda: torch.mm(a, b, out=out), reps=7)
