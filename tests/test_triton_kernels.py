"""The Triton kernels against the reference ops.

On CPU they run under the Triton interpreter in a subprocess (see
tests/triton_interpret_check.py for why); on CUDA (``-m gpu``) they run compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import ops
from tests.kernel_cases import KernelCase, build_inputs, check_case, make_cases
from tests.triton_interpret_check import interpreter_cases

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 5e-2}
INTERPRETER_CASES = interpreter_cases()
INTERPRETER_SHARDS = 2  # processes: the interpreter runs on one core each

needs_triton = pytest.mark.skipif(not ops.TRITON_AVAILABLE, reason="Triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def interpreter_errors() -> dict[str, dict[str, float]]:
    """Every interpreter case's errors, from INTERPRETER_SHARDS processes side by side."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.triton_interpret_check", str(i), str(INTERPRETER_SHARDS)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(INTERPRETER_SHARDS)
    ]
    errors: dict[str, dict[str, float]] = {}
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, f"interpreter run failed:\n{err[-4000:]}"
            errors.update(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert sorted(errors) == sorted(case.name for case in INTERPRETER_CASES)  # every case ran
    return errors


def _assert_within(case: KernelCase, errors: dict[str, float]) -> None:
    tolerance = TOLERANCE[case.dtype]
    bad = {op: err for op, err in errors.items() if not err <= tolerance}
    assert not bad, f"{case} exceeds {tolerance}: {bad}"


@needs_triton
@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=lambda c: c.name)
def test_triton_kernels_match_reference_interpreted(case, interpreter_errors) -> None:
    _assert_within(case, interpreter_errors[case.name])


GPU_CASES = make_cases(head_dim=128, max_len=300, num_kv_heads=2) + [
    KernelCase(
        "mixed-fp16-d64",
        (1, 200, 37, 1),
        (500, 260, 37, 3),
        16,
        9,
        3,
        64,
        dtype="float16",
        seed=301,
    ),
    KernelCase(
        "chunked-bf16-d64", (128, 1, 64), (700, 90, 64), 32, 9, 3, 64, dtype="bfloat16", seed=302
    ),
    KernelCase(
        "decode-bf16-d80",
        (1,) * 8,
        (1, 17, 64, 65, 300, 513, 900, 1024),
        16,
        8,
        8,
        80,
        dtype="bfloat16",
        seed=303,
    ),
]


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_triton_kernels_match_reference_on_gpu(case: KernelCase) -> None:
    _assert_within(case, check_case(case, backend="triton", device="cuda"))


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_triton_matches_torch_path_at_long_context(block_size: int) -> None:
    """Long sequences, where the slow reference is too slow: the torch path is the oracle."""
    case = KernelCase(
        "long", (1, 1500, 1, 700), (4000, 3000, 2048, 700), block_size, 12, 4, 128, seed=block_size
    )
    x = build_inputs(case, device="cuda")
    args = (x["query"], x["k_cache"], x["v_cache"], x["meta"], x["scale"])
    expected = ops.prefill_attention(*args, backend="torch")
    actual = ops.prefill_attention(*args, backend="triton")
    torch.testing.assert_close(actual, expected, atol=1e-3, rtol=1e-3)
