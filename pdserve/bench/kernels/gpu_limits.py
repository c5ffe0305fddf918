"""The GPU's limits measured in the run that reports against them, and the arithmetic of the
figures (FLOPs, bytes, ratios). Imports torch only (no serving package, no kernels), so the
arithmetic is tested on CPU (tests/test_gpu_limits.py) and the GPU run needs no serving deps.

Limits, as issue 54 asks for them:
- bf16 matmul rate: ``torch.matmul`` of large square bf16 matrices (cuBLAS), 2 n^3 FLOPs.
- copy bandwidth: a device-to-device copy of a large tensor, counted as bytes read + written
  (what a kernel that streams its inputs once can reach; below the data sheet's HBM figure).

Timing: CUDA events around ``reps`` calls after warm-up calls, best of ``rounds``. A kernel whose
inputs fit in L2 (50 MB on H100) would be timed from cache on repeated calls, so bandwidth
figures cycle through enough copies of their inputs to exceed ``L2_FLUSH_BYTES`` (``copies_to_
exceed``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

# A working set this large cannot stay in any current GPU's L2 (H100 50 MB, H200 60 MB).
L2_FLUSH_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Figure:
    """One measured figure beside its limit and, where there is one, torch's own path."""

    name: str
    seconds: float
    work: float  # FLOPs (compute-bound figures) or bytes (bandwidth-bound ones)
    limit: float  # the measured limit, FLOP/s or bytes/s
    unit: str  # "FLOP" or "B"
    target: float  # the fraction of ``limit`` the issue asks for
    torch_seconds: float | None = None  # torch's path on the same inputs
    torch_target: float | None = None  # the fraction of torch's rate the issue asks for

    @property
    def rate(self) -> float:
        return self.work / self.seconds

    @property
    def fraction_of_limit(self) -> float:
        return fraction(self.rate, self.limit)

    @property
    def vs_torch(self) -> float | None:
        """Our rate over torch's (> 1: faster), None without a torch path."""
        return None if self.torch_seconds is None else self.torch_seconds / self.seconds

    @property
    def passes(self) -> bool:
        ok = self.fraction_of_limit >= self.target
        if self.torch_target is not None and self.vs_torch is not None:
            ok = ok and self.vs_torch >= self.torch_target
        return ok

    def line(self) -> str:
        scale, prefix = (1e12, "TFLOP/s") if self.unit == "FLOP" else (1e9, "GB/s")
        text = (
            f"{self.name:34s} {self.seconds * 1e3:9.3f} ms {self.rate / scale:8.1f} {prefix}"
            f"  {self.fraction_of_limit:6.1%} of limit (target {self.target:.0%})"
        )
        if self.vs_torch is not None:
            text += f"  {self.vs_torch:5.2f}x torch"
            if self.torch_target is not None:
                text += f" (target {self.torch_target:.2f}x)"
        return text + ("  PASS" if self.passes else "  BELOW")

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "seconds": self.seconds,
            "rate": self.rate,
            "unit": self.unit + "/s",
            "fraction_of_limit": self.fraction_of_limit,
            "target": self.target,
            "vs_torch": self.vs_torch,
            "torch_target": self.torch_target,
            "passes": self.passes,
        }


def fraction(rate: float, limit: float) -> float:
    if limit <= 0:
        raise ValueError(f"limit {limit}: a measured limit is positive")
    return rate / limit


def matmul_flops(n: int) -> float:
    """FLOPs of an [n, n] x [n, n] matmul: a multiply and an add per term."""
    return 2.0 * n**3


def copy_bytes(num_bytes: int) -> int:
    """Bytes a device-to-device copy moves: each byte read once and written once."""
    return 2 * num_bytes


def causal_pairs(q_len: int, kv_len: int) -> int:
    """(query, key) pairs a causal attention computes when the q_len queries are the last ones
    of kv_len positions: query j (0-based) sees kv_len - q_len + j + 1 keys."""
    if not 0 < q_len <= kv_len:
        raise ValueError(f"q_len {q_len}, kv_len {kv_len}: need 0 < q_len <= kv_len")
    context = kv_len - q_len
    return q_len * context + q_len * (q_len + 1) // 2


def attention_flops(num_heads: int, head_dim: int, q_len: int, kv_len: int) -> float:
    """FLOPs of causal attention: per pair and head, QK^T and PV are a head_dim multiply-add
    each (4 * head_dim); the softmax's exponentials are not counted (FlashAttention's rule)."""
    return 4.0 * causal_pairs(q_len, kv_len) * num_heads * head_dim


def decode_attention_bytes(
    batch: int,
    context: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    elem_bytes: int,
    block_size: int = 16,
) -> int:
    """Bytes a decode attention step must move at the least: K and V of every context token
    once (GQA: once per KV head, not per query head), the queries read, the outputs written,
    and the block tables (int32) read."""
    kv = 2 * batch * context * num_kv_heads * head_dim * elem_bytes
    queries_and_outputs = 2 * batch * num_heads * head_dim * elem_bytes
    tables = batch * math.ceil(context / block_size) * 4
    return kv + queries_and_outputs + tables


def copies_to_exceed(bytes_per_copy: int, flush_bytes: int | None = None) -> int:
    """How many copies of a kernel's inputs to cycle through so that consecutive calls never
    find their inputs in L2: their total is at least ``flush_bytes`` (default
    ``L2_FLUSH_BYTES``), and at least 1."""
    if bytes_per_copy <= 0:
        raise ValueError("bytes_per_copy must be positive")
    flush = L2_FLUSH_BYTES if flush_bytes is None else flush_bytes
    return max(1, math.ceil(flush / bytes_per_copy))


def time_cuda(
    calls: list[Callable[[], object]], reps: int = 20, warmup: int = 3, rounds: int = 3
) -> float:
    """Seconds per call, best round of ``reps`` calls cycling through ``calls`` (one per input
    copy), timed by CUDA events after ``warmup`` calls of each."""
    import torch

    for fn in calls:
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(reps):
            calls[i % len(calls)]()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / reps)
    return best


def measure_matmul_rate(n: int = 8192, reps: int = 20) -> float:
    """bf16 FLOP/s of torch.matmul on [n, n] matrices (cuBLAS, tensor cores)."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    return matmul_flops(n) / time_cuda([lambda: torch.matmul(a, b, out=out)], reps)


def measure_copy_bandwidth(num_bytes: int = 2**31, reps: int = 20) -> float:
    """Bytes/s of a device-to-device copy (read + write) of ``num_bytes``."""
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return copy_bytes(num_bytes) / time_cuda([lambda: dst.copy_(src)], reps)
