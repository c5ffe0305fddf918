"""The autoscaler's planner mode: the pools' target sizes from the recent traffic, simulated on
every split the bounds allow (pdserve/planner/autoscale.py)."""

from __future__ import annotations

import pytest

from pdserve.metrics import SLO
from pdserve.planner.autoscale import recent_trace, target_split
from pdserve.planner.search import Evaluator, trace_workload
from pdserve.planner.sim import SimConfig, Split
from pdserve.planner.workload import synthetic
from tests.test_planner_sim import toy_profile

SLOS = SLO(8.0, 0.2)
BOUNDS = {"prefill": (1, 3), "decode": (1, 3)}
WINDOW_S = 60.0


def _recent(spec: str, rate: float):
    """A minute of traffic as the router saw it finish (arrival times from 0)."""
    return synthetic(spec, int(rate * WINDOW_S), rate, seed=3)


def test_long_prompts_get_more_prefill_workers_and_long_outputs_more_decode_workers():
    profile = toy_profile()
    prompts = target_split(profile, _recent("longprompt", 0.3), WINDOW_S, SLOS, BOUNDS)
    assert prompts.prefill > prompts.decode, prompts
    outputs = target_split(profile, _recent("16-64/150-250", 2.0), WINDOW_S, SLOS, BOUNDS)
    assert outputs.decode > outputs.prefill, outputs
    for t in (prompts, outputs):
        assert t.attainment >= 0.9 and "holds" in t.reason


def test_the_target_is_the_fewest_workers_that_hold_the_rate():
    profile, trace = toy_profile(), _recent("16-64/150-250", 3.0)
    t = target_split(profile, trace, WINDOW_S, SLOS, BOUNDS, headroom=1.0)
    assert t.prefill + t.decode > 2  # 1P1D does not hold this rate
    ev = Evaluator(profile, trace_workload(trace, 120.0, 50, 1000), SLOS, SimConfig(Split(1, 1)))
    smaller = [
        Split(p, n - p) for n in range(2, t.prefill + t.decode) for p in range(1, n) if n - p <= 3
    ]
    assert all(ev.at(s, t.rate)[0] < 0.9 for s in smaller)  # none of the smaller splits holds
    assert ev.at(Split(t.prefill, t.decode), t.rate)[0] == pytest.approx(t.attainment)


def test_bounds_hold_and_past_them_the_closest_split_is_named():
    profile = toy_profile()
    heavy = _recent("16-64/150-250", 6.0)
    t = target_split(profile, heavy, WINDOW_S, SLOS, {"prefill": (1, 1), "decode": (1, 2)})
    assert (t.prefill, t.decode) == (1, 2) and t.attainment < 0.9
    assert "no split holds" in t.reason
    fixed = target_split(profile, heavy, WINDOW_S, SLOS, {"prefill": (2, 2), "decode": (3, 3)})
    assert (fixed.prefill, fixed.decode) == (2, 3)


def test_no_traffic_gives_no_target():
    assert target_split(toy_profile(), [], WINDOW_S, SLOS, BOUNDS) is None


def test_recent_trace_keeps_the_window_and_the_lengths():
    # (finish, TTFT, TPOT, arrival, prompt tokens, output tokens) on the router's clock
    obs = [(10.0, 0.1, 0.02, 5.0, 100, 20), (95.0, 0.2, 0.03, 90.0, 300, 1),
           (99.0, 0.1, None, 97.5, 40, 0)]  # fmt: skip
    trace = recent_trace(obs, now=100.0, window_s=30.0)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in trace] == [
        (0.0, 300, 1),
        (7.5, 40, 1),  # a request cut off before its first token is one output token
    ]
    assert recent_trace(obs, now=500.0, window_s=30.0) == []
