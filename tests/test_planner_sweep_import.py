"""A profile imported from a rate sweep of an OpenAI server plans that server colocated: here
the server is the simulator on a known profile, so its capacity is known exactly."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pdserve.cli import main
from pdserve.metrics import SLO
from pdserve.planner.profile import Table2D, load_profile
from pdserve.planner.search import Evaluator, synthetic_workload
from pdserve.planner.sim import SimConfig, Split, simulate
from tests.test_planner_sim import toy_profile

SLOS = SLO(3.0, 0.15)
WORKLOAD = synthetic_workload("100-600/20-60", seed=5, duration_s=120, max_requests=300)
COLO = Split(0, 1)


def _sweep(tmp_path, rates=(0.2, 0.5, 0.8, 1.1, 1.4), truth=None, workload=WORKLOAD, slos=SLOS):
    """``pdserve bench sweep --json``'s shape: one BenchResult dict per rate."""
    truth = truth or toy_profile()
    runs = []
    for rate in rates:
        res = simulate(truth, workload(rate), SimConfig(COLO), slos).result
        runs.append({**res.to_dict(), "rate": rate})
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"goodput": 0, "points": [], "runs": runs}))
    return truth, path


def test_an_imported_profile_predicts_the_servers_capacity_within_15_percent(tmp_path):
    truth, sweep = _sweep(tmp_path)
    out = tmp_path / "imported.json"
    assert main(["profile", "--from-sweep", str(sweep), "--out", str(out),
                 "--num-blocks", str(truth.engine.num_blocks)]) == 0  # fmt: skip
    imported = load_profile(out)
    assert "imported from a rate sweep" in imported.meta["source"]
    measured = Evaluator(truth, WORKLOAD, SLOS, SimConfig(COLO)).capacity(COLO, 0.5)
    predicted = Evaluator(imported, WORKLOAD, SLOS, SimConfig(COLO)).capacity(COLO, 0.5)
    print(f"colocated capacity: predicted {predicted:.3f} vs served {measured:.3f} req/s")
    assert predicted == pytest.approx(measured, rel=0.15)


def test_a_decode_bound_server_swept_past_its_knee_is_not_read_at_the_offered_rate(tmp_path):
    """vLLM-cpu on chat traffic: each decode row costs 4 ms, so past the knee the server
    serves far under the offered rate; Little's law on the offered rate doubled the batch
    there, halved the fitted cost of a row and predicted 21% over the served capacity."""
    base = toy_profile()
    rows, cols = base.decode.rows, base.decode.cols
    per_row = tuple(tuple(0.03 + 0.004 * b + 1e-6 * b * c for c in cols) for b in rows)
    truth = replace(base, decode=Table2D(rows, cols, per_row))
    chat = synthetic_workload("40-60/64-200", seed=5, duration_s=120, max_requests=300)
    slos = SLO(3.0, 0.1)
    _, sweep = _sweep(tmp_path, (0.5, 1.0, 1.5, 2.0, 3.0), truth, chat, slos)
    assert main(["profile", "--from-sweep", str(sweep), "--out", str(tmp_path / "p.json")]) == 0
    imported = load_profile(tmp_path / "p.json")
    assert imported.meta["sweep_fit"]["decode_a_b_c"][1] == pytest.approx(0.004, rel=0.25)
    measured = Evaluator(truth, chat, slos, SimConfig(COLO)).capacity(COLO, 1.0)
    predicted = Evaluator(imported, chat, slos, SimConfig(COLO)).capacity(COLO, 1.0)
    print(f"decode-bound capacity: predicted {predicted:.3f} vs served {measured:.3f} req/s")
    assert predicted == pytest.approx(measured, rel=0.15)


def test_a_sweep_without_per_request_figures_is_named(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"runs": [{"rate": 1.0}]}))
    assert main(["profile", "--from-sweep", str(path), "--out", str(tmp_path / "p.json")]) == 2
    assert "argument --from-sweep" in capsys.readouterr().err
