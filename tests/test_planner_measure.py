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
    from pdserve.measure import kv_push as transfer
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


def test_each_pair_of_kinds_is_timed_beside_its_own_neighbour_and_sets_its_profile_field(
    monkeypatch,
):
    """A decode step beside a prefilling and beside a decoding neighbour, a prefill step beside
    each: four figures, each over its own step alone, each keyed by the CpuCorrections field it sets
    (never below 1: a neighbour does not make a step faster)."""
    import dataclasses

    from pdserve.planner import measure
    from pdserve.planner.cpu_corrections import CpuCorrections

    # Alone: decode 1 s, prefill 2 s. Beside a neighbour: the seconds in this table.
    seconds = {
        ("decode", None): 1.0, ("prefill", None): 2.0,
        ("decode", "prefill"): 1.5, ("decode", "decode"): 1.25,
        ("prefill", "decode"): 1.0, ("prefill", "prefill"): 3.0,
    }  # fmt: skip
    neighbour = [None]

    class FakeTimer:
        grid = measure.QUICK
        engine = None

        def __init__(self, engine=None, grid=None):
            pass

        def decode(self, batch, ctx):
            return seconds["decode", neighbour[0]]

        def prefill(self, n, offset):
            return seconds["prefill", neighbour[0]]

    def fake_beside(model_dir, kind, measure_fn):
        neighbour[0] = kind
        try:
            return measure_fn()
        finally:
            neighbour[0] = None

    monkeypatch.setattr(measure, "WorkerTimer", FakeTimer)
    monkeypatch.setattr(measure, "_beside", fake_beside)
    got = measure.measure_co_run_slowdown(FakeTimer(), "model")
    assert got == {
        "co_run_slowdown": 1.5,
        "co_run_slowdown_prefill": 1.0,  # 1.0 / 2.0 beside a decode step: held at 1
        "co_run_slowdown_decode_pair": 1.25,
        "co_run_slowdown_prefill_pair": 1.5,
    }
    assert set(got) <= {f.name for f in dataclasses.fields(CpuCorrections)}


def test_a_live_prefill_worker_reports_its_prefill_of_each_length(tmp_path):
    """A real 1P1D pair (worker processes, the gRPC KV transport) on a tiny model: the prefill
    worker's own prefill seconds for each prompt length, what prefill_worker_slowdown is the
    ratio of."""
    from pdserve.bench.fidelity.measure_live import live_prefill_seconds
    from pdserve.config import ClusterConfig
    from tests.conftest import tiny_llama_dir

    model, _ = tiny_llama_dir(tmp_path)
    cfg = ClusterConfig(model=str(model), max_model_len=256, num_blocks=128)
    live = live_prefill_seconds(cfg, threads=1, sizes=(8, 64), runs=2)
    assert set(live) == {8, 64}
    assert all(0 < s < 30 for s in live.values())
