"""Transparent huge pages for torch's large CPU tensors.

A decode step streams every weight (~540 MB fp32 for SmolLM2-135M). With 4 KiB pages that is
~130,000 page translations a step, and in a virtual machine each TLB miss walks two page tables
(guest and host). PyTorch's CPU allocator backs allocations of 2 MiB and more with huge pages
when ``THP_MEM_ALLOC_ENABLE=1`` is in the environment before it first allocates
(``c10/core/alloc_cpu.cpp``: it ``madvise(MADV_HUGEPAGE)``s them), which works where the
kernel's THP mode is ``madvise`` as well as ``always``. Measured on the 2-core CI machine,
runs interleaved: ``bench engine`` decode at batch 1 112/158 -> 76/83 ms a step, batch 8
169/225 -> 124/136 ms; the engine's own loop, 8 requests x 64 tokens, 6.0-8.1 -> 5.7-6.3 s.

The variable must be set before torch is imported, so the process entry points (``pdserve``,
``python -m prefill_worker`` / ``decode_worker``) call :func:`request` first, and Ray worker
actors get it through their ``runtime_env``. ``PDSERVE_HUGE_PAGES=0`` turns it off.

This module must not import torch at import time.
"""

from __future__ import annotations

import os
import sys

TORCH_ENV = "THP_MEM_ALLOC_ENABLE"
OPT_OUT_ENV = "PDSERVE_HUGE_PAGES"
_SMAPS = "/proc/self/smaps_rollup"
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def kernel_mode() -> str:
    """The kernel's THP mode: "always", "madvise", "never", or "" where there is none."""
    try:
        with open(_THP_MODE) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else ""


def wanted() -> bool:
    return os.environ.get(OPT_OUT_ENV, "1") != "0"


def env_vars() -> dict[str, str]:
    """What a child process (a Ray actor's runtime_env) needs in its environment."""
    return {TORCH_ENV: "1"} if wanted() else {}


def request() -> bool:
    """Ask torch's allocator for huge pages. False when this call set the variable after torch
    was already imported (the allocator reads it once); child processes still inherit it."""
    if not wanted():
        return True
    already = os.environ.get(TORCH_ENV) == "1"
    os.environ.setdefault(TORCH_ENV, "1")
    return already or "torch" not in sys.modules


def _anon_huge_kb() -> int | None:
    try:
        with open(_SMAPS) as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def active() -> bool:
    """Whether this process has memory on huge pages once a large torch tensor was touched.

    (Not "did this tensor get them": in a warm process a new tensor may reuse heap memory that
    was first touched with small pages, which khugepaged only collapses later.)"""
    import torch

    probe = torch.zeros(16 * 2**20 // 4)  # 16 MiB, touched
    found = (_anon_huge_kb() or 0) > 0
    del probe
    return found
