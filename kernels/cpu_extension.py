"""The CPU extension (C++), built on first use with torch's extension loader.

What lives in it: the paged decode-attention kernel (decode on CPU is bound by memory traffic;
reading K/V straight from the cache blocks avoids the gather copy and its second read), the
causal prefill-attention kernel, the few-row matmul of a decode step's projections
(engine/linear.py), and the decoder layers as one call (engine/cpu_stack.py; no interpreter
between the small ops of a decode step). If no compiler is available the build fails once, a
warning is logged, and callers keep the torch / Python paths.
"""

from __future__ import annotations

import logging
import os
import platform
import threading
from pathlib import Path

log = logging.getLogger("pdserve.kernels")

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [
    "paged_decode_cpu.cpp",
    "prefill_attention_cpu.cpp",
    "skinny_gemm_cpu.cpp",
    "decoder_stack_cpu.cpp",
    "kv_blocks_cpu.cpp",
    "bindings.cpp",
]
_lock = threading.Lock()
_module = None
_failed = False


def load():
    """The compiled module, or None when it cannot be built here (or PDSERVE_NO_CPU_EXT=1)."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is None and not _failed:
            _module = _build()
            _failed = _module is None
    return _module


def _vector_math_flags() -> list[str]:
    """glibc's vector math library on x86-64 (vectorised expf in the softmax); the source falls
    back to scalar expf where it is absent."""
    is_glibc = platform.libc_ver()[0] == "glibc"
    return ["-lmvec"] if is_glibc and platform.machine() in ("x86_64", "AMD64") else []


def _build():
    if os.environ.get("PDSERVE_NO_CPU_EXT") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        return load_extension(
            name="pdserve_cpu_kernels",
            sources=[str(_CSRC / name) for name in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp", *_vector_math_flags()],
            verbose=False,
        )
    except Exception as e:  # no compiler, no headers: the torch path still works
        log.warning("CPU paged-attention extension unavailable (%s); using the torch path", e)
        return None
