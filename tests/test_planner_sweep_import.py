"""A profile imported from a rate sweep of an OpenAI server plans that server colocated: here
the server is the simulator on a known profile, so its capacity is known exactly."""

from __future__ import annotations

import json

import pytest

from pdserve.cli import main
from pdserve.metrics import SLO
from pdserve.planner.profile import load_profile
from pdserve.planner.search import Evaluator, synthetic_workload
from pdserve.planner.sim import SimConfig, Split, simulate
from tests.test_planner_sim import toy_profile

SLOS = SLO(3.0, 0.15)
WORKLOAD = synthetic_workload("100-600/20-60", seed=5, duration_s=120, max_requests=300)
COLO = Split(0, 1)


def _sweep(tmp_path, rates=(0.2, 0.5, 0.8, 1.1, 1.4)):
    """``pdserve bench sweep --json``'s shape: one BenchResult dict per rate."""
    truth = toy_profile()
    runs = []
    for rate in rates:
        res = simulate(truth, WORKLOAD(rate), SimConfig(COLO), SLOS).result
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


def test_a_sweep_without_per_request_figures_is_named(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"runs": [{"rate": 1.0}]}))
    assert main(["profile", "--from-sweep", str(path), "--out", str(tmp_path / "p.json")]) == 2
    assert "argument --from-sweep" in capsys.readouterr().err
