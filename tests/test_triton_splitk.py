"""Split-K (flash-decoding) decode attention: the split-count heuristic, the kernels against
the reference under the Triton interpreter (CPU, forced split counts), and on CUDA
(``-m gpu``) the heuristic's choice at serving shapes against the torch path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import ops
from tests.kernel_cases import KernelCase, build_inputs
from tests.triton_splitk_check import split_cases

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 2e-2}

needs_triton = pytest.mark.skipif(not ops.TRITON_AVAILABLE, reason="Triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_triton
def test_batch_one_is_split_to_fill_the_gpu() -> None:
    from kernels.triton_decode_splitk import TARGET_PROGRAMS, choose_num_splits

    # 8B: 8 KV heads; batch 1 at 32k context: 8 programs alone would idle most SMs.
    # 528 / 8 programs wants 66 splits; the cap (64) leaves 512, 97% of the target.
    assert choose_num_splits(1, 8, 32768) == 64
    assert choose_num_splits(1, 8, 32768, max_splits=128) * 8 >= TARGET_PROGRAMS
    # 4k context: bounded by at least 128 keys a split (4096 // 128 = 32 splits).
    assert choose_num_splits(1, 8, 4096) == 32


@needs_triton
def test_full_batches_and_short_contexts_are_not_split() -> None:
    from kernels.triton_decode_splitk import TARGET_PROGRAMS, choose_num_splits

    assert choose_num_splits(TARGET_PROGRAMS // 8, 8, 32768) == 1  # the batch fills the GPU
    assert choose_num_splits(1, 8, 255) == 1  # under two splits' worth of keys
    assert choose_num_splits(1, 1, 10**7) == 64  # capped: the reduction reads every split
    assert choose_num_splits(32, 8, 4096) == 3  # 256 programs: 3 splits reach 528


@pytest.fixture(scope="module")
def interpreted_errors() -> dict[str, float]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.triton_splitk_check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_triton
@pytest.mark.parametrize("split", split_cases(), ids=lambda s: s.name)
def test_split_k_decode_matches_reference_interpreted(split, interpreted_errors) -> None:
    error = interpreted_errors[split.name]
    assert error <= TOLERANCE[split.case.dtype], f"{split.name}: max abs error {error}"


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_split_k_decode_matches_torch_path_on_gpu(batch: int, dtype: str) -> None:
    """8B's heads (32 query, 8 KV, head dim 128) at a long ragged context, where the
    heuristic splits; the torch path (SDPA over gathered KV) is the oracle."""
    from kernels.triton_decode_splitk import choose_num_splits
    from kernels.triton_kernels import decode_attention_triton

    seq_lens = tuple(3000 + 37 * i for i in range(batch))
    case = KernelCase("long-decode", (1,) * batch, seq_lens, 16, 32, 8, 128, dtype=dtype)
    assert choose_num_splits(batch, 8, max(seq_lens)) > 1
    x = build_inputs(case, device="cuda")
    args = (x["query"], x["k_cache"], x["v_cache"], x["meta"], x["scale"])
    expected = ops.decode_attention(*args, backend="torch").float()
    for splits in (None, 1, 7):
        actual = decode_attention_triton(*args, num_splits=splits).float()
        torch.testing.assert_close(actual, expected, atol=TOLERANCE[dtype], rtol=1e-2)
