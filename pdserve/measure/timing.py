"""Timing one call: the single helper every benchmark and measured limit times with."""

from __future__ import annotations

import time
from collections.abc import Callable


def timed(
    fn: Callable[[], object], reps: int, *, best: bool = False, warmup: int = 1, device: str = "cpu"
) -> float:
    """Seconds per call of ``fn`` over ``reps`` calls after ``warmup`` untimed ones.

    The median by default: what a call costs in steady state. ``best=True`` gives the fastest,
    for limits: on a shared machine the fastest run is the least disturbed one. On ``cuda``
    each call is bracketed by a device synchronize, since kernel launches return before the
    kernel has run.
    """
    sync = _cuda_sync if device == "cuda" else _no_sync
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times) if best else sorted(times)[len(times) // 2]


def best_time(fn, reps: int = 5, warmup: int = 2) -> float:
    """Fastest of ``reps`` runs: on a shared machine the minimum is the least disturbed."""
    return timed(fn, reps, best=True, warmup=warmup)


def median_time(fn, reps: int = 7, warmup: int = 1) -> float:
    """Median of ``reps`` runs: what a step costs in steady state, where the fastest run is
    the one a neighbour happened not to disturb."""
    return timed(fn, reps, warmup=warmup)


def _no_sync() -> None:
    pass


def _cuda_sync() -> None:
    import torch  # only on CUDA: a CPU benchmark's timing stays torch-free

    torch.cuda.synchronize()
