"""A live cluster against its plan: the planner's prediction for the traffic served beside
what was measured, as ``pdserve:planner_prediction_error`` and a line in ``pdserve status``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.cluster.ray_launcher import format_status
from pdserve.planner.drift import prediction_error
from pdserve.planner.sim import Split, simulate
from pdserve.planner.workload import synthetic
from router.metrics import PoolCollector
from tests.test_planner_sim import toy_profile


def _observed(slower: float = 1.0):
    """The router's observations of a served trace: (finish, TTFT, TPOT, arrival, prompt,
    output), here from the simulator itself, its latencies times ``slower``."""
    prof = toy_profile()
    trace = synthetic("100-300/20-60", 60, 0.8, seed=2)
    res = simulate(prof, trace, Split(1, 1)).result
    assert res.completed == len(trace)
    obs = []
    for i, ttft, e2el, out in zip(res.sent_indices, res.ttfts, res.e2els, res.output_lens):
        t = trace[i]
        tpot = (e2el - ttft) / (out - 1) if out > 1 else None
        tpot = None if tpot is None else tpot * slower
        obs.append((t.arrival_s + e2el, ttft * slower, tpot, t.arrival_s, t.prompt_tokens, out))
    return prof, obs, max(t.arrival_s for t in trace) + 1


def test_the_prediction_for_the_traffic_served_matches_when_the_profile_is_right():
    prof, obs, now = _observed()
    pred = prediction_error(prof, obs, now, 1e6, Split(1, 1))
    assert pred["requests"] == 60
    for figure, err in pred["error"].items():
        assert err == pytest.approx(0.0, abs=1e-9), figure


def test_a_slower_cluster_than_its_profile_shows_as_a_negative_error():
    prof, obs, now = _observed(slower=2.0)
    pred = prediction_error(prof, obs, now, 1e6, Split(1, 1))
    assert set(pred["error"]) == {"p50_ttft", "p90_ttft", "p50_tpot"}
    for err in pred["error"].values():
        assert err == pytest.approx(-0.5, abs=1e-9)
    assert prediction_error(prof, obs[:5], now, 1e6, Split(1, 1)) is None  # too few


def test_the_router_exports_the_error_and_status_prints_it():
    pred = {
        "requests": 120,
        "rate": 2.0,
        "split": "1P2D",
        "predicted": {"p50_ttft": 0.11, "p90_ttft": 0.3, "p50_tpot": 0.02},
        "measured": {"p50_ttft": 0.1, "p90_ttft": 0.3, "p50_tpot": 0.025},
        "error": {"p50_ttft": 0.1, "p90_ttft": 0.0, "p50_tpot": -0.2},
    }
    pool = SimpleNamespace(workers={}, role="prefill")
    router = SimpleNamespace(prefill=pool, decode=pool, inflight=0, planner_prediction=pred)
    [gauge] = [m for m in PoolCollector(router).collect() if m.name.endswith("prediction_error")]
    assert gauge.name == "pdserve:planner_prediction_error"
    assert {s.labels["metric"]: s.value for s in gauge.samples} == pred["error"]
    st = {"router": {}, "autoscaler": True, "pools": {}, "planner_prediction": pred}
    line = format_status(st).splitlines()[-1]
    assert "last 120 requests on 1P2D" in line
    assert "p50 TTFT 110/100 ms (+10%)" in line and "p50 TPOT 20/25 ms (-20%)" in line
