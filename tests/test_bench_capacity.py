"""``pdserve bench fidelity --part capacity``'s arithmetic (pdserve/bench/fidelity/capacity.py):
where attainment crosses 90%, how a sweep steps until it brackets it, and the verdict against
the planner. The real clusters it drives are the fidelity runs' (live.py)."""

from __future__ import annotations

import pytest

from pdserve.bench.fidelity import capacity, live
from pdserve.metrics import SLO
from pdserve.planner.sim import Split
from tests.test_planner_sim import toy_profile


def test_capacity_is_where_the_line_between_the_bracketing_rates_crosses_90_percent():
    points = [(2.0, 0.5), (1.0, 1.0), (1.5, 0.8), (0.5, 1.0)]  # any order
    assert capacity.interpolated_capacity(points) == pytest.approx(1.0 + 0.5 * (1.0 - 0.9) / 0.2)
    assert capacity.interpolated_capacity([(1.0, 0.95), (2.0, 0.95)]) is None  # never failed
    assert capacity.interpolated_capacity([(1.0, 0.5), (2.0, 0.2)]) is None  # never held
    # Noise above the first failure does not move it: the first rate that fails decides.
    assert capacity.interpolated_capacity([(1.0, 1.0), (2.0, 0.8), (3.0, 0.95)]) == 1.5
    # A noisy miss below the lowest rate that held does not count either.
    assert capacity.interpolated_capacity([(0.5, 0.85), (1.0, 1.0), (2.0, 0.8)]) == 1.5
    assert capacity.bracketed([(1.0, 0.9), (2.0, 0.1)])
    assert not capacity.bracketed([(1.0, 0.8), (2.0, 0.1)])


def test_the_verdict_allows_10_percent_or_the_measured_spread_where_wider():
    tight = capacity.verdict(1.12, [0.98, 1.0, 1.02])
    assert tight["median"] == 1.0 and not tight["within"]  # +12% > max(10%, 4%)
    wide = capacity.verdict(1.12, [0.85, 1.0, 1.15])
    assert wide["spread"] == pytest.approx(0.30) and wide["within"]
    assert capacity.ranking({"1P1D": 1.2, "colo2": 1.5, "1P2D": 0.7}) == ["colo2", "1P1D", "1P2D"]


@pytest.mark.parametrize("start", [0.5, 1.0, 3.0])
def test_a_sweep_steps_until_it_brackets_the_knee_then_refines_between(monkeypatch, start):
    """A fake cluster whose attainment falls from 100% to 0 between 1.0 and 2.0 req/s (90% at
    1.1): from 2x below, at, or 3x above the knee, it brackets the knee and refines there."""
    served: list[float] = []

    def fake_serve(cluster, workload, rate, n, slo, seed):
        served.append(rate)
        return rate

    def fake_summary(rate):
        att = min(1.0, max(0.0, 2.0 - rate))
        return {"attainment": att, "p90_ttft_ms": 1.0, "p50_tpot_ms": 1.0}

    monkeypatch.setattr(live, "serve_on", fake_serve)
    monkeypatch.setattr("pdserve.bench.fidelity.fidelity_replay.summary", fake_summary)
    rows = capacity.sweep_shape(None, Split.parse("1P1D"), "mixed", SLO(5, 0.1), 1, start)
    assert [r["rate"] for r in rows] == sorted(served)
    cap = capacity.interpolated_capacity([(r["rate"], r["attainment"]) for r in rows])
    assert cap == pytest.approx(1.1, rel=0.01)  # the fake's line is straight: exact
    assert len(rows) <= 2 + capacity.MAX_STEPS
    assert min(r["requests"] for r in rows) >= capacity.MIN_REQUESTS


def test_a_stored_run_is_scored_shape_by_shape_and_ranked_against_the_plan():
    sweeps = {
        "1P1D": [{"capacity": c} for c in (1.0, 0.9, 1.1)],
        "colo2": [{"capacity": c} for c in (0.8, 0.7, None)],  # a sweep that never bracketed
    }
    report = capacity.scored({"sweeps": sweeps}, {"1P1D": [0.95, 2.0, 2.0], "colo2": [0.9, 0, 0]})
    assert report["verdicts"]["1P1D"]["median"] == 1.0
    assert report["verdicts"]["1P1D"]["within"]  # seed 0's plan: -5%
    assert report["verdicts"]["colo2"]["measured"] == [0.8, 0.7]
    assert not report["verdicts"]["colo2"]["within"]  # +20%, spread 13%
    assert report["measured_ranking"] == ["1P1D", "colo2"] == report["planned_ranking"]
    assert report["ranking_matches"]


def test_the_cli_runs_the_capacity_part_and_rescores_its_json(monkeypatch, tmp_path, capsys):
    """``--part capacity`` writes its sweeps and verdicts; ``--resimulate`` of that file scores
    them against a profile's plan (here both stand in: no cluster, no simulation)."""
    import argparse
    import json

    from pdserve.bench.fidelity import cli

    sweeps = {"1P1D": [{"seed": 1, "capacity": 1.0, "rates": []}]}

    def fake_report(profile, shapes, workload, slo, sweeps_n, cores):
        assert (shapes, workload, slo, sweeps_n) == (["1P1D"], "chat", SLO(2.0, 0.15), 1)
        return capacity.scored(
            {"workload": workload, "slo": slo.__dict__, "sweeps": sweeps}, {"1P1D": [1.05]}
        )

    monkeypatch.setattr(capacity, "capacity_report", fake_report)
    monkeypatch.setattr(capacity, "planner_capacities", lambda *a: {"1P1D": [2.0]})
    ap = argparse.ArgumentParser()
    cli.add_parser(ap.add_subparsers())
    out = tmp_path / "cap.json"
    profile = str(tmp_path / "profile.json")
    toy_profile().save(profile)  # loaded, then stood in for by planner_capacities above
    common = ["fidelity", "--profile", profile, "--part", "capacity", "--shapes", "1P1D"]
    args = ap.parse_args(
        common
        + [
            "--workload",
            "chat",
            "--slo-ttft",
            "2",
            "--slo-tpot",
            "0.15",
            "--sweeps",
            "1",
            "--json",
            str(out),
        ]
    )
    assert args.func(args) == 0
    assert json.loads(out.read_text())["capacity"]["verdicts"]["1P1D"]["within"]  # +5%
    args = ap.parse_args(common + ["--resimulate", str(out)])
    assert args.func(args) == 0
    assert "1P1D: planned 2 req/s, measured median 1 " in capsys.readouterr().out  # +100%
