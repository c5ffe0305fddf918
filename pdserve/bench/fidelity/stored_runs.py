"""Stored fidelity runs (``pdserve bench fidelity --json``) with the step traces their
workers recorded: the live costs a planner takes from earlier runs, with no cluster running.

A run's traces sit in one folder per run, named by ``fidelity_replay.run_name``, as
``--step-trace`` wrote them; each run was probed for the machine's speed around it, and its
steps are priced at that speed (``pooled_costs``).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from pdserve.bench.fidelity.fidelity_replay import METRICS, resimulate, run_name, stored_requests
from pdserve.bench.fidelity.first_token_hop import hop_beyond_router, request_hops
from pdserve.bench.fidelity.step_residuals import (
    calibrated_costs,
    decode_row_factors,
    load_steps,
    priced_steps,
    with_row_factors,
)
from pdserve.planner.profile import Profile
from pdserve.planner.sim import Split


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


def pooled_costs(profile: Profile, runs: list[tuple], cores: int | None = None) -> dict:
    """``calibrated_costs`` fitted on the steps of several live runs together. Each run is
    (its trace folder, its probed decode speed, prefill speed[, small-prompt prefill speed]):
    its steps are priced at its own speed (``Profile.at_speed``), and the fixed work comes back
    at the profile's speed (weighted by each run's priced seconds), as ``at_speed`` scales it."""
    rows, weights = [], {"decode": [], "prefill": []}
    profile = profile.with_cpu(decode_row_factors=())  # fitted anew below
    for folder, decode, prefill, *small in runs:
        priced = priced_steps(profile.at_speed(decode, prefill, *small), load_steps(folder))
        rows += priced
        seconds = sum(r["priced_s"] for r in priced)
        weights["decode"].append((seconds, decode))
        weights["prefill"].append((seconds, prefill))
    factors = decode_row_factors(rows, profile.decode.rows)
    rows = with_row_factors(rows, profile.with_cpu(decode_row_factors=factors))
    costs = {**calibrated_costs(rows, cores), "decode_row_factors": factors}
    fields = (
        ("co_run_fixed_s", "decode"),
        ("co_run_fixed_s_decode_pair", "decode"),
        ("co_run_fixed_s_prefill", "prefill"),
        ("co_run_fixed_s_local_prefill", "prefill"),
    )
    for field, kind in fields:
        if field not in costs:
            continue
        total = sum(w for w, _ in weights[kind])
        mean = sum(w * s for w, s in weights[kind]) / total if total > 0 else 1.0
        costs[field] /= mean
    return costs


def leave_one_out_costs(
    profile: Profile, runs: dict, cores: int | None = None, scored=None
) -> dict[str, dict]:
    """For each live run (name -> (trace folder, speeds), as ``pooled_costs``) of ``scored``
    (default: all), the costs calibrated on every *other* run's steps: a run is then simulated
    on costs it did not contribute to, as a planner calibrated on yesterday's traffic predicts
    today's."""
    return {
        name: pooled_costs(profile, [r for other, r in runs.items() if other != name], cores)
        for name in (runs if scored is None else scored)
    }


def run_hops(row: dict, seed: int, tokenizer, folder: Path) -> list[float]:
    """A disaggregated run's first-token paths (``first_token_hop.request_hops``): each clean
    request's TTFT less its prompt step. Empty for colocated runs and for several prefill
    workers (whose steps interleave)."""
    split = Split.parse(row["split"])
    real = (row.get("per_request") or {}).get("real")
    if split.colocated or split.num_prefill != 1 or not real:
        return []
    trace, _ = stored_requests(row, seed, tokenizer)
    steps = [
        (s["t"], s["s"], s["prompt_tokens"])
        for worker, worker_steps in load_steps(folder).items()
        if worker.startswith("prefill")
        for s in worker_steps
        if s["prompt_tokens"]
    ]
    sends, prompts = [r.arrival_s for r in trace], [r.prompt_tokens for r in trace]
    return request_hops(sends, real["ttft_s"], prompts, sorted(steps))


def traced_hops(stored: dict, traces, tokenizer) -> dict[str, list[float]]:
    """Each stored run's name -> ``run_hops`` (empty without a tokenizer)."""
    if tokenizer is None:
        return {run_name(row): [] for row in stored["fidelity"]}
    seed = int(stored.get("seed") or 0)
    return {
        run_name(row): run_hops(row, seed, tokenizer, Path(traces) / run_name(row))
        for row in stored["fidelity"]
    }


def leave_one_out(
    stored: dict, profile: Profile, traces, cores: int | None, more=(), tokenizer=None
) -> dict[str, dict]:
    """Each stored run's name -> the costs fitted on every other run's step traces: the other
    runs of ``stored``, and every run of each (stored fidelity JSON path, its traces folder)
    in ``more`` (earlier sets of runs on the same machine). With ``tokenizer`` (the router's,
    to rebuild the requests), the disaggregated first token's path too, from the others."""
    scored = traced_runs(stored, traces)
    runs, hops = _runs_of(more, tokenizer)
    costs = leave_one_out_costs(profile, {**scored, **runs}, cores, scored)
    if tokenizer is not None:
        hops.update(traced_hops(stored, traces, tokenizer))
        for name, c in costs.items():
            others = [h for other, hs in hops.items() if other != name for h in hs]
            c["disaggregated_hop_s"] = hop_beyond_router(others, profile.router_overhead_s)
    return costs


def rescored(
    stored: dict, profile: Profile, slos: dict, tokenizer, seed: int, traces=None,
    cores: int | None = None, more=(),
) -> dict:  # fmt: skip
    """``stored`` (a fidelity report) re-simulated on ``profile``: with ``traces`` (its runs'
    step-trace folder) each run on the costs fitted on every other run (``leave_one_out``,
    ``more`` joining the pool), else all on ``profile`` as it is."""
    costs = None
    if traces is not None:
        costs = leave_one_out(stored, profile, traces, cores, more, tokenizer)
    return resimulate(stored, profile, slos, tokenizer, seed, costs)


def _runs_of(sources, tokenizer=None) -> tuple[dict[str, tuple], dict[str, list[float]]]:
    runs, hops = {}, {}
    for stored_path, traces in sources:  # names kept apart per stored file
        stored = json.loads(Path(stored_path).read_text())
        runs.update({f"{stored_path}:{k}": v for k, v in traced_runs(stored, traces).items()})
        got = traced_hops(stored, traces, tokenizer).items()
        hops.update({f"{stored_path}:{k}": v for k, v in got})
    return runs, hops


def pooled_profile(
    profile: Profile, sources, cores: int | None, tokenizer=None
) -> tuple[Profile, dict]:
    """``profile`` with the live costs fitted on every run of each (stored fidelity JSON path,
    its traces folder) in ``sources``, pooled; and those costs (with ``tokenizer``, the
    disaggregated first token's path too)."""
    runs, hops = _runs_of(sources, tokenizer)
    costs = pooled_costs(profile, list(runs.values()), cores)
    if tokenizer is not None:
        every = [h for hs in hops.values() for h in hs]
        costs["disaggregated_hop_s"] = hop_beyond_router(every, profile.router_overhead_s)
    meta = {
        **profile.meta,
        "co_run": {
            "source": "step traces of the stored runs, pooled",
            "runs": sorted(runs),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
    }
    return dataclasses.replace(profile.with_cpu(**costs), meta=meta), costs


def format_mape(mape: dict, label: str = "MAPE") -> str:
    """A report's MAPE per metric on a line."""
    return label + " " + "  ".join(f"{m} {v:.1%}" for m, v in mape.items())


def format_row(r: dict) -> str:
    """One run's simulated / measured figures and errors on a line."""
    cells = [f"{r['split']:<6}{r['workload']:<8}{r['rate']:>5}"]
    for m in METRICS:
        cells.append(f"{m} {r['sim'][m]:.3g}/{r['real'][m]:.3g} ({r['error'][m]:.0%})")
    return "  ".join(cells)
