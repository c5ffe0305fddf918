"""Run the split-K decode kernels (kernels/triton_decode_splitk.py) on CPU tensors under the
Triton interpreter at forced split counts; print each case's max abs error against the
reference as JSON.

Run as ``TRITON_INTERPRET=1 python -m tests.triton_splitk_check`` from the repo root;
tests/test_triton_splitk.py runs it in a subprocess (see tests/triton_interpret_check.py for
why a subprocess).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

from kernels import kv_fp8
from kernels.reference import paged_attention_ref
from tests.kernel_cases import KernelCase, build_inputs, max_error


@dataclass(frozen=True)
class SplitCase:
    case: KernelCase
    num_splits: int
    fp8: bool = False

    @property
    def name(self) -> str:
        return f"{self.case.name}-s{self.num_splits}" + ("-fp8" if self.fp8 else "")


def split_cases() -> list[SplitCase]:
    """Batch 1 and > 1 (one sequence much shorter than the longest, so some of its splits are
    empty), GQA groups 1, 2 and 4, contexts that no split count divides, block sizes 1, 5
    and 16, head dims 16 and 24 (not a power of two), fp16 queries, fp8 caches."""
    kc = KernelCase
    return [
        SplitCase(kc("b1-gqa1-bs16", (1,), (77,), 16, 2, 2, 16, seed=401), 3),
        SplitCase(kc("b1-gqa4-bs5", (1,), (101,), 5, 8, 2, 24, seed=402), 4),
        SplitCase(kc("b1-gqa2-bs1", (1,), (65,), 1, 4, 2, 16, seed=403), 2),
        SplitCase(kc("b3-gqa2-bs16", (1, 1, 1), (95, 7, 50), 16, 4, 2, 16, seed=404), 5),
        SplitCase(kc("b4-gqa4-bs5", (1,) * 4, (1, 33, 64, 130), 5, 8, 2, 16, seed=405), 8),
        SplitCase(kc("b2-gqa1-bs16", (1, 1), (40, 97), 16, 3, 3, 16, seed=406), 3),
        SplitCase(kc("b2-gqa2-fp16", (1, 1), (70, 33), 16, 4, 2, 32, dtype="float16", seed=407), 3),
        SplitCase(kc("b3-gqa4-fp8", (1, 1, 1), (90, 5, 61), 16, 8, 2, 32, seed=408), 4, True),
        SplitCase(kc("b1-gqa2-s1", (1,), (45,), 16, 4, 2, 16, seed=409), 1),  # single pass
    ]


def check_split(split: SplitCase) -> float:
    from kernels.triton_kernels import decode_attention_triton

    x = build_inputs(split.case)
    k_cache, v_cache = x["k_cache"], x["v_cache"]
    if split.fp8:
        k_cache, v_cache = kv_fp8.quantize(k_cache), kv_fp8.quantize(v_cache)
    args = (x["query"], k_cache, v_cache, x["meta"], x["scale"])
    expected = paged_attention_ref(*args)
    return max_error(decode_attention_triton(*args, num_splits=split.num_splits), expected)


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1 before running this script", file=sys.stderr)
        return 2
    print(json.dumps({split.name: check_split(split) for split in split_cases()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
