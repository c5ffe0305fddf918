"""Which precision prefill's many-row matmuls run in (``prefill_gemm: fp32 | bf16 | int8 |
auto``), and whether a prefill's attention multiplies in bf16.

A prefill chunk's projections are compute-bound GEMMs of hundreds of rows. On a CPU with AMX
(Sapphire Rapids on) oneDNN's bf16 GEMM runs about 7x its fp32 one at SmolLM2's prefill shapes
(2 threads: 2,170-2,320 against 324-372 GFLOP/s); where the CPU has no bf16 instructions (AVX2
only) bf16 is emulated and loses. Without AMX, byte dot products beat bf16: on an AMD EPYC Zen 4
(AVX-512 VNNI and BF16, 1 thread) decode's int8-activation kernel (quant_dot_cpu.cpp, rows
quantized per block of 32 as llama.cpp's prefill does) multiplies a 1,024-row chunk of q4 weights
at 255-275 GOP/s against oneDNN bf16's 190-208. So ``auto`` times each path once per process,
thread count and weight format, and takes the fastest that is at least ``AUTO_MIN_SPEEDUP``
faster than fp32, only for weights stored quantized (bf16 / int8 / q4): they are
approximations already, and their decode keeps reading the quantized codes. fp32 weights stay
fp32 under auto: their greedy output must equal transformers' token for token.

bf16 here means: the weight's (dequantized) values rounded to bf16, activations rounded to
bf16, products summed in fp32 by oneDNN; torch's CPU GEMM then rounds its output to bf16,
which the layer widens back to fp32 (no CPU kernel in torch 2.13 writes fp32 from bf16
inputs: ``mm.dtype`` is CUDA-only). int8 means: the rows quantized per block of 32 and
multiplied as bytes against the stored codes, exactly as a decode step's rows
(engine/linear.py). Rows up to ``SKINNY_MAX_ROWS`` (decode) keep the skinny kernels either way.

A prefill's attention takes bf16 GEMMs with bf16 projections, and with int8 ones where this CPU
multiplies bf16 at least ``AUTO_MIN_SPEEDUP`` faster than fp32 (native bf16: AVX-512 BF16 or
AMX; elsewhere it stays fp32).
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
Timings = dict[str, float]  # seconds of the probe per path: fp32, bf16 and (where it runs) int8


def choose(
    setting: str,
    weights: str,
    device: str,
    timings: Callable[[str], Timings] | None = None,
) -> str:
    """The precision ``setting`` resolves to for ``weights`` on ``device``: "fp32", "bf16" or
    "int8". ``timings(weights)`` is each path's probe seconds (default: ``measured_seconds``),
    asked only when auto has to decide."""
    check_prefill_gemm(setting)
    if setting != "auto":
        return setting
    if weights == "fp32" or torch.device(device).type != "cpu":
        return "fp32"  # fp32 weights keep transformers' arithmetic; GPUs are not measured here
    seconds = (timings or measured_seconds)(weights)
    fast = {k: t for k, t in seconds.items() if seconds["fp32"] / t >= AUTO_MIN_SPEEDUP}
    kind = min(fast, key=fast.get) if fast else "fp32"
    speeds = ", ".join(f"{k} {seconds['fp32'] / t:.2f}x" for k, t in seconds.items() if k != "fp32")
    log.info("prefill_gemm auto: %s (at a prefill shape against fp32: %s)", kind, speeds)
    return kind


def attention_bf16(kind: str, weights: str, timings: Callable[[str], Timings] | None = None):
    """Whether a prefill whose projections run in ``kind`` attends with bf16 GEMMs."""
    if kind != "int8":
        return kind == "bf16"
    seconds = (timings or measured_seconds)(weights)
    return seconds["fp32"] / seconds["bf16"] >= AUTO_MIN_SPEEDUP


def measured_seconds(weights: str) -> Timings:
    """Probe seconds of a prefill-sized projection on each path ``engine.linear.Linear`` runs
    for ``weights`` (int8 only where its kernel takes them), at the current torch thread count
    (measured once per thread count and format)."""
    return _timings_at(torch.get_num_threads(), weights)


@functools.cache
def _timings_at(threads: int, weights: str) -> Timings:
    return probe_seconds(weights)


def probe_seconds(weights: str = "q4", reps: int = PROBE_REPS) -> Timings:
    """Best seconds of the probe projection on its fp32 and bf16 paths, and on the int8 one
    where ``weights`` (int8 | q4) take it, the paths timed in turn so a busy spell of a shared
    machine slows all of them."""
    from engine.linear import Linear

    torch.manual_seed(0)
    paths = {}
    for kind in ("fp32", "bf16", "int8"):
        lin = Linear(PROBE_K, PROBE_N, bias=False)
        if kind == "int8":
            if weights not in ("int8", "q4"):
                continue
            lin.quantize(weights)
        lin.set_prefill_gemm(kind)
        lin.pack_for_cpu()
        if kind != "int8" or (lin.prefill_int8 and lin.skinny is not None):
            paths[kind] = lin
    x = torch.randn(PROBE_ROWS, PROBE_K)
    best = dict.fromkeys(paths, float("inf"))
    with torch.inference_mode():
        for lin in paths.values():
            lin(x)  # warm-up: oneDNN builds its kernels on the first call
        for _ in range(reps):
            for kind, lin in paths.items():
                start = time.perf_counter()
                lin(x)
                best[kind] = min(best[kind], time.perf_counter() - start)
    return best
