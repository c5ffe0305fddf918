"""Stored fidelity runs (scripts/planner_fidelity.py's JSON) with the step traces their
workers recorded: the live costs a planner takes from earlier runs, with no cluster running.

A run's traces sit in one folder per run, named by ``fidelity_replay.run_name``, as
``--step-trace`` wrote them; each run was probed for the machine's speed around it, and its
steps are priced at that speed (``step_residuals.pooled_costs``).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from pdserve.planner.fidelity_replay import METRICS, run_name
from pdserve.planner.profile import Profile
from pdserve.planner.step_residuals import leave_one_out_costs, pooled_costs


def traced_runs(stored: dict, traces: str | Path) -> dict[str, tuple]:
    """Each stored run's name -> (its step-trace folder under ``traces``, its probed decode,
    prefill and small-prompt prefill speed; 1.0, and None for the small prompt, where the run
    had no such probe)."""
    runs = {}
    for row in stored["fidelity"]:
        speed = (row.get("speed") or {}).get("used") or {}
        folder = Path(traces) / run_name(row)
        if not any(folder.glob("*.jsonl")):
            raise FileNotFoundError(f"no step traces in {folder}")
        runs[run_name(row)] = (
            folder,
            speed.get("decode", 1.0),
            speed.get("prefill", 1.0),
            speed.get("prefill_small"),
        )
    return runs


def leave_one_out(
    stored: dict, profile: Profile, traces, cores: int | None, more=()
) -> dict[str, dict]:
    """Each stored run's name -> the costs fitted on every other run's step traces: the other
    runs of ``stored``, and every run of each (stored fidelity JSON path, its traces folder)
    in ``more`` (earlier sets of runs on the same machine)."""
    scored = traced_runs(stored, traces)
    return leave_one_out_costs(profile, {**scored, **_runs_of(more)}, cores, scored)


def _runs_of(sources) -> dict[str, tuple]:
    runs = {}
    for stored_path, traces in sources:  # names kept apart per stored file
        stored = json.loads(Path(stored_path).read_text())
        runs.update({f"{stored_path}:{k}": v for k, v in traced_runs(stored, traces).items()})
    return runs


def pooled_profile(profile: Profile, sources, cores: int | None) -> tuple[Profile, dict]:
    """``profile`` with the live costs fitted on every run of each (stored fidelity JSON path,
    its traces folder) in ``sources``, pooled; and those costs."""
    runs = _runs_of(sources)
    costs = pooled_costs(profile, list(runs.values()), cores)
    meta = {
        **profile.meta,
        "co_run": {
            "source": "step traces of the stored runs, pooled",
            "runs": sorted(runs),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
    }
    return dataclasses.replace(profile, **costs, meta=meta), costs


def format_row(r: dict) -> str:
    """One run's simulated / measured figures and errors on a line."""
    cells = [f"{r['split']:<6}{r['workload']:<8}{r['rate']:>5}"]
    for m in METRICS:
        cells.append(f"{m} {r['sim'][m]:.3g}/{r['real'][m]:.3g} ({r['error'][m]:.0%})")
    return "  ".join(cells)
