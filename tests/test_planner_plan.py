"""The split search: long prompts want prefill workers, long outputs want decode workers."""

from __future__ import annotations

import pytest

from pdserve.metrics import SLO
from pdserve.planner.search import candidate_splits, plan, recommend, synthetic_workload
from pdserve.planner.sim import Split
from pdserve.planner.workload import at_rate, read_trace, repeat_trace, synthetic, write_trace
from tests.test_planner_sim import toy_profile

SLOS = SLO(8.0, 0.2)


def _plan(spec: str, rate: float, max_workers: int = 4):
    workload = synthetic_workload(spec, seed=1, duration_s=80, min_requests=50, max_requests=300)
    return plan(toy_profile(), workload, rate, SLOS, max_workers, curve_points=2)


def test_candidates_are_every_split_up_to_n_and_colocated():
    labels = [s.label for s in candidate_splits(3)]
    assert labels == ["1P1D", "1P2D", "2P1D", "colo1", "colo2", "colo3"]


def test_long_prompts_get_more_prefill_than_decode_workers():
    p = _plan("longprompt", 0.3)
    best = p.recommended.split
    assert p.holds_rate
    assert not best.colocated and best.num_prefill > best.num_decode
    assert p.disaggregation_pays


def test_long_outputs_get_more_decode_than_prefill_workers():
    p = _plan("16-64/150-250", 1.0, max_workers=3)
    disagg = p.best_disaggregated.split
    assert disagg.num_decode > disagg.num_prefill
    best = p.recommended.split
    assert best.colocated or best.num_decode > best.num_prefill


def test_recommend_prefers_capacity_per_worker_among_those_holding_the_rate():
    from pdserve.planner.search import SplitResult

    small = SplitResult(Split(1, 1), 0.95, 1.0, capacity=1.2, curve=[])
    big = SplitResult(Split(2, 2), 0.99, 1.0, capacity=4.0, curve=[])
    weak = SplitResult(Split(0, 1), 0.5, 0.5, capacity=0.8, curve=[])
    assert recommend([small, big, weak], rate=1.0) == (big, True)
    assert recommend([small, weak], rate=2.0) == (small, False)


def test_split_labels_parse_and_bad_ones_are_named():
    assert Split.parse("2P3D") == Split(2, 3)
    assert Split.parse("colo4") == Split(0, 4)
    with pytest.raises(ValueError, match="P0D"):
        Split.parse("P0D")


def test_trace_round_trip_scaling_and_cycling(tmp_path):
    trace = synthetic("chat", 10, 2.0, seed=4)
    write_trace(tmp_path / "t.jsonl", trace)
    assert read_trace(tmp_path / "t.jsonl") == trace
    scaled = at_rate(trace, 4.0)
    assert scaled[-1].arrival_s == pytest.approx(9 / 4.0)
    assert [r.prompt_tokens for r in repeat_trace(trace, 25)][10:20] == [
        r.prompt_tokens for r in trace
    ]


def test_bad_trace_line_is_named(tmp_path):
    (tmp_path / "t.jsonl").write_text(
        '{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 2}\n{"x": 1}\n'
    )
    with pytest.raises(ValueError, match="t.jsonl:2"):
        read_trace(tmp_path / "t.jsonl")
