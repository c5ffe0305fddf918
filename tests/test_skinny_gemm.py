"""The skinny matmul kernel (kernels/csrc/skinny_gemm_cpu.cpp) and engine.linear's use of it."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from engine import linear as linear_mod
from engine.linear import SKINNY_MAX_ROWS, Linear
from tests import cpu_variants

ext = cpu_variants.ext  # fixture: each build in turn (AVX-512, AVX2)


def close(actual, expected, k):
    # fp32 sums of k products in another order: error grows like sqrt(k) * eps * |terms|
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=2e-6 * k**0.5 * 4)


@pytest.mark.parametrize("threads", [1, 2])
# 1-2 rows: two tiles a pass on both builds; 3, 7, 13, 25, 32: passes split evenly (AVX2 6
# rows a pass, AVX-512 12), the next group prefetched behind them.
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 7, 11, 12, 13, 24, 25, 32, 48, 70])
@pytest.mark.parametrize("n_out,k", [(16, 64), (17, 5), (100, 37), (960, 576), (48, 1536)])
def test_equals_f_linear(ext, threads, rows, n_out, k):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(rows * 1000 + n_out + k)
        w = torch.randn(n_out, k, generator=g)
        x = torch.randn(rows, k, generator=g)
        bias = torch.randn(n_out, generator=g)
        residual = torch.randn(rows, n_out, generator=g)
        packed = ext.pack_skinny_weight(w)
        close(ext.skinny_linear(x, packed, n_out), F.linear(x, w), k)
        close(ext.skinny_linear(x, packed, n_out, bias), F.linear(x, w, bias), k)
        close(
            ext.skinny_linear(x, packed, n_out, bias, residual), F.linear(x, w, bias) + residual, k
        )
        # A non-contiguous x (a row slice of a wider tensor) reads the same values.
        wide = torch.randn(rows, k + 3, generator=g)
        close(ext.skinny_linear(wide[:, :k], packed, n_out), F.linear(wide[:, :k], w), k)
    finally:
        torch.set_num_threads(before)


def test_packed_layout_is_tiles_of_16_outputs_zero_padded(ext):
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    packed = ext.pack_skinny_weight(w)
    assert packed.shape == (2, 3, 16)
    assert torch.equal(packed[0], w[:16].t())
    assert torch.equal(packed[1, :, :4], w[16:].t())
    assert not packed[1, :, 4:].any()


def test_no_rows_gives_an_empty_result(ext):
    packed = ext.pack_skinny_weight(torch.randn(32, 8))
    assert ext.skinny_linear(torch.empty(0, 8), packed, 32).shape == (0, 32)


@pytest.mark.parametrize(
    "x,n_out,kwargs",
    [
        (torch.randn(2, 7), 32, {}),  # K differs from the weight's
        (torch.randn(2, 8), 48, {}),  # more outputs than the tiles hold
        (torch.randn(2, 8), 16, {}),  # fewer: a whole tile would be dropped
        (torch.randn(2, 8), 32, {"bias": torch.randn(31)}),
        (torch.randn(2, 8), 32, {"residual": torch.randn(3, 32)}),
    ],
)
def test_mismatched_inputs_are_refused(ext, x, n_out, kwargs):
    packed = ext.pack_skinny_weight(torch.randn(32, 8))
    with pytest.raises(RuntimeError):
        ext.skinny_linear(x, packed, n_out, **kwargs)


@pytest.mark.parametrize("rows", [1, 4, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 130])
def test_linear_takes_the_skinny_kernel_up_to_its_row_limit(ext, rows, monkeypatch):
    layer = Linear(96, 80, bias=True)
    assert layer.pack_for_cpu() and layer.skinny is not None
    calls = []
    skinny = ext.skinny_linear
    monkeypatch.setattr(
        linear_mod.cpu_extension,
        "load",
        lambda: type("Ext", (), {"skinny_linear": lambda *a: calls.append(1) or skinny(*a)}),
    )
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        close(layer(x), F.linear(x, layer.weight, layer.bias), 96)
    assert bool(calls) == (rows <= SKINNY_MAX_ROWS)
