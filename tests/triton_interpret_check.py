"""Run every Triton kernel on CPU tensors under the Triton interpreter; print JSON errors.

Run as ``TRITON_INTERPRET=1 python -m tests.triton_interpret_check [SHARD NUM_SHARDS]`` from
the repo root.
tests/test_triton_kernels.py runs it in a subprocess because Triton picks interpreter or
compiler when ``@triton.jit`` decorates a kernel (at import of kernels.triton_kernels), and
an earlier test module in the same pytest process may already have imported it.
"""

from __future__ import annotations

import json
import os
import sys

from tests.kernel_cases import KernelCase, check_case, make_cases


def interpreter_cases() -> list[KernelCase]:
    """Small shapes (the interpreter runs each program in numpy) in every mode."""
    cases = make_cases(block_sizes=(1, 16, 32), groups=(1, 3, 4), head_dim=16, max_len=80)
    cases += [  # head_dim not a power of two, block size not a divisor of the key tile
        KernelCase("chunked-bs5-d24", (7, 30, 1), (40, 33, 9), 5, 4, 2, 24, seed=101),
        KernelCase("decode-bs5-d24", (1, 1, 1), (70, 3, 41), 5, 6, 2, 24, seed=102),
        KernelCase("mixed-fp16", (1, 20, 9), (30, 45, 9), 16, 8, 2, 32, dtype="float16", seed=103),
        KernelCase("decode-fp16", (1, 1), (33, 64), 16, 8, 2, 32, dtype="float16", seed=104),
    ]
    # No bfloat16: the interpreter's tl.dot reads bf16 operands as garbage (Triton 3.9, numpy
    # has no bf16); the GPU tests cover it.
    return cases


def main(shard: int = 0, num_shards: int = 1) -> int:
    """Every ``num_shards``-th case from the ``shard``-th: the test runs shards side by side,
    one process a core (the interpreter is single-threaded numpy)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1 before running this script", file=sys.stderr)
        return 2
    cases = interpreter_cases()[shard::num_shards]
    results = {case.name: check_case(case, backend="triton") for case in cases}
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:3])))
