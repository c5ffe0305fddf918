"""What the profiler measures (pdserve/planner/measure.py), without timing anything."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.settings import EngineSettings


@pytest.mark.parametrize("kv_dtype,row_bytes", [("fp32", 64 * 4), ("int8", 64 + 4), ("fp8", 68)])
def test_the_transfer_is_timed_on_the_cache_format_the_engine_stores(
    monkeypatch, kv_dtype, row_bytes
):
    """An int8 or fp8 cache ships a quarter of fp32's bytes: the profile's transfer times must
    be of those bytes, not of an fp32 cache of the same shape."""
    from pdserve.bench.micro import transfer
    from pdserve.planner import measure
    from pdserve.planner.profile import EngineSettings as ProfileSettings

    assert ProfileSettings is EngineSettings
    pushed = []

    def fake_measure(name, shape, repeats, loopback_best):
        pushed.append(shape.bytes_per_push)
        return SimpleNamespace(seconds=[0.01])

    monkeypatch.setattr(transfer, "measure_transport", fake_measure)

    class Model:
        num_layers, num_kv_heads, head_dim = 2, 3, 64

    settings = EngineSettings(block_size=16, kv_dtype=kv_dtype)
    assert measure.measure_transfer(Model, settings, "grpc", (32,)) == [0.01]
    assert pushed == [2 * 2 * 32 * 3 * row_bytes]  # K and V, 2 layers, 32 tokens, 3 heads
