"""The prefill kernel's autotune configs: one under the interpreter (CPU tests stay fast),
several FlashAttention-2-shaped tiles on a GPU, keyed on the head dim (Triton adds dtypes)."""

from __future__ import annotations

import pytest

from kernels import ops

pytestmark = pytest.mark.skipif(not ops.TRITON_AVAILABLE, reason="Triton is not installed")


def test_interpreter_gets_a_single_config(monkeypatch) -> None:
    from kernels.triton_kernels import _prefill_configs

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert len(_prefill_configs()) == 1


def test_gpu_configs_are_tiles_tl_dot_takes(monkeypatch) -> None:
    from kernels.triton_kernels import _prefill_configs

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("PDSERVE_PREFILL_AUTOTUNE", raising=False)
    configs = _prefill_configs()
    assert len(configs) > 1
    shapes = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps) for c in configs}
    assert (128, 64, 8) in shapes  # FA2's tile for head dim 128 on H100
    for m, n, _ in shapes:
        assert m >= 16 and n >= 16 and m & (m - 1) == 0 and n & (n - 1) == 0


def test_autotune_can_be_turned_off_for_test_runs(monkeypatch) -> None:
    from kernels.triton_kernels import _prefill_configs

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("PDSERVE_PREFILL_AUTOTUNE", "0")
    (config,) = _prefill_configs()
    assert (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]) == (64, 32)


def test_prefill_kernel_is_autotuned_on_head_dim() -> None:
    from kernels.triton_kernels import _prefill_attention_kernel

    assert list(_prefill_attention_kernel.keys) == ["HEAD_DIM"]
