"""Which precision prefill's many-row matmuls run in (``prefill_gemm: fp32 | bf16 | auto``).

A prefill chunk's projections are compute-bound GEMMs of hundreds of rows. On a CPU with AMX
(Sapphire Rapids on) oneDNN's bf16 GEMM runs about 7x its fp32 one at SmolLM2's prefill shapes
(2 threads: 2,170-2,320 against 324-372 GFLOP/s); where the CPU has no bf16 instructions (AVX2
only) bf16 is emulated and loses. So ``auto`` times both once per process and thread count and
takes bf16 only where it is at least ``AUTO_MIN_SPEEDUP`` faster, and only for weights stored
quantized (bf16 / int8 / q4): they are approximations already, and their decode keeps reading
the quantized codes. fp32 weights stay fp32 under auto: their greedy output must equal
transformers' token for token.

bf16 here means: the weight's (dequantized) values rounded to bf16, activations rounded to
bf16, products summed in fp32 by oneDNN; torch's CPU GEMM then rounds its output to bf16,
which the layer widens back to fp32 (no CPU kernel in torch 2.13 writes fp32 from bf16
inputs: ``mm.dtype`` is CUDA-only). Rows up to ``SKINNY_MAX_ROWS`` (decode) keep the fp32
skinny kernels either way (engine/linear.py).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch

from engine.config import check_prefill_gemm

log = logging.getLogger(__name__)

AUTO_MIN_SPEEDUP = 1.5
# A 512-token prefill chunk through SmolLM2-135M's fused gate/up projection (K 576, N 3072).
PROBE_ROWS, PROBE_K, PROBE_N = 512, 576, 3072
PROBE_REPS = 5


def choose(
    setting: str,
    weights: str,
    device: str,
    speedup: Callable[[], float] | None = None,
) -> str:
    """The precision ``setting`` resolves to for ``weights`` on ``device``: "fp32" or "bf16".
    ``speedup()`` is bf16's measured speed over fp32 (default: ``measured_bf16_speedup``),
    asked only when auto has to decide."""
    check_prefill_gemm(setting)
    if setting != "auto":
        return setting
    if weights == "fp32" or torch.device(device).type != "cpu":
        return "fp32"  # fp32 weights keep transformers' arithmetic; GPUs are not measured here
    ratio = (speedup or measured_bf16_speedup)()
    kind = "bf16" if ratio >= AUTO_MIN_SPEEDUP else "fp32"
    log.info("prefill_gemm auto: %s (bf16 GEMM %.2fx fp32 at a prefill shape)", kind, ratio)
    return kind


def measured_bf16_speedup() -> float:
    """fp32 seconds / bf16 seconds of a prefill-sized projection, as ``engine.linear.Linear``
    runs each, at the current torch thread count (measured once per thread count)."""
    return _speedup_at(torch.get_num_threads())


@functools.cache
def _speedup_at(threads: int) -> float:
    fp32, bf16 = probe_seconds()
    return fp32 / bf16


def probe_seconds(reps: int = PROBE_REPS) -> tuple[float, float]:
    """Best seconds of the probe projection on its fp32 path and on its bf16 path, the two
    timed alternately so a busy spell of a shared machine slows both."""
    from engine.linear import Linear

    torch.manual_seed(0)
    paths = []
    for kind in ("fp32", "bf16"):
        lin = Linear(PROBE_K, PROBE_N, bias=False)
        lin.set_prefill_gemm(kind)
        lin.pack_for_cpu()
        paths.append(lin)
    x = torch.randn(PROBE_ROWS, PROBE_K)
    best = [float("inf"), float("inf")]
    with torch.inference_mode():
        for lin in paths:
            lin(x)  # warm-up: oneDNN builds its kernels on the first call
        for _ in range(reps):
            for i, lin in enumerate(paths):
                start = time.perf_counter()
                lin(x)
                best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]
