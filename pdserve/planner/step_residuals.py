"""Each real step against the profile's price for it (engine/step_trace.py's traces).

A fidelity run's workers record every step's shape and duration; here each step is priced by
the profile exactly as the simulator prices it (``Profile.shape_seconds``), and the ratio
measured / priced is summarised by kind of step (decode only, prefill only, mixed) and by how
much of the step another worker was computing at the same time (alone, or co-running). A ratio
away from 1 in one cell names the cost the profile misses, instead of guessing it from the
latency percentiles.
"""

from __future__ import annotations

from bisect import bisect_left
from pathlib import Path

import numpy as np

from engine.step_trace import PlanShape, read_trace
from pdserve.planner.profile import Profile

SHAPE_FIELDS = tuple(PlanShape.__dataclass_fields__)
ALONE, CO_RUN = 0.1, 0.9  # share of a step's time another worker computes


def kind_of(shape: PlanShape) -> str:
    if not shape.prompt_tokens:
        return "decode"
    return "mixed" if shape.decode_rows else "prefill"


def overlap_share(start: float, end: float, others: list[tuple[list, list]]) -> float:
    """The share of [start, end) during which at least one other worker was in a step (each
    other worker: its step starts and ends, sorted; its steps never overlap each other)."""
    if end <= start:
        return 0.0
    covered = []
    for starts, ends in others:
        i = bisect_left(ends, start)  # the first step still running at ``start``
        while i < len(starts) and starts[i] < end:
            covered.append((max(starts[i], start), min(ends[i], end)))
            i += 1
    covered.sort()
    total, reach = 0.0, start
    for a, b in covered:  # union of the intervals
        a = max(a, reach)
        if b > a:
            total += b - a
            reach = b
    return total / (end - start)


def load_steps(folder: str | Path) -> dict[str, list[dict]]:
    return {p.stem: read_trace(p) for p in sorted(Path(folder).glob("*.jsonl"))}


def priced_steps(profile: Profile, steps_by_worker: dict[str, list[dict]]) -> list[dict]:
    """Every step of every worker with its priced seconds, kind and co-running share."""
    spans = {
        w: ([s["t"] for s in steps], [s["t"] + s["s"] for s in steps])
        for w, steps in steps_by_worker.items()
    }
    out = []
    for worker, steps in steps_by_worker.items():
        others = [span for w, span in spans.items() if w != worker]
        for s in steps:
            shape = PlanShape(**{f: s[f] for f in SHAPE_FIELDS})
            out.append(
                {
                    "worker": worker,
                    "kind": kind_of(shape),
                    "real_s": s["s"],
                    "priced_s": profile.shape_seconds(shape),
                    "co_run": overlap_share(s["t"], s["t"] + s["s"], others),
                }
            )
    return out


def summarise(rows: list[dict]) -> dict:
    """Per kind and co-running bucket: steps, median ratio, and summed measured over summed
    priced seconds (the time-weighted ratio: what the simulated clock would gain or lose)."""
    cells: dict[str, list[dict]] = {}
    for r in rows:
        bucket = "alone" if r["co_run"] < ALONE else "co-run" if r["co_run"] > CO_RUN else "part"
        cells.setdefault(f"{r['kind']}/{bucket}", []).append(r)
        cells.setdefault(f"{r['kind']}/all", []).append(r)
    out = {}
    for key, group in sorted(cells.items()):
        real = np.array([g["real_s"] for g in group])
        priced = np.array([g["priced_s"] for g in group])
        ok = priced > 0
        out[key] = {
            "steps": len(group),
            "median_ratio": float(np.median(real[ok] / priced[ok])) if ok.any() else None,
            "time_ratio": float(real.sum() / priced.sum()) if priced.sum() > 0 else None,
            "real_s": float(real.sum()),
            "priced_s": float(priced.sum()),
        }
    return out


def step_residuals(profile: Profile, folder: str | Path) -> dict:
    return summarise(priced_steps(profile, load_steps(folder)))


def format_residuals(summary: dict) -> str:
    lines = [f"{'step kind':<18}{'steps':>7}{'median':>9}{'time':>8}{'seconds':>9}"]
    for key, c in summary.items():
        med = "-" if c["median_ratio"] is None else f"{c['median_ratio']:.2f}"
        tim = "-" if c["time_ratio"] is None else f"{c['time_ratio']:.2f}"
        lines.append(f"{key:<18}{c['steps']:>7}{med:>9}{tim:>8}{c['real_s']:>9.1f}")
    return "\n".join(lines)


def co_run_factors(summary: dict) -> tuple[float, float]:
    """The co-run slowdowns a live run's steps show: decode-only and prompt-computing steps that
    ran with another worker busy (bucket "co-run"), their measured over priced seconds. This is
    what ``co_run_slowdown`` / ``co_run_slowdown_prefill`` stand for in the simulator, measured
    on the live cluster itself, where a neighbour also means KV frames streaming in or out
    through the workers' Python threads (GIL) beside the forward: two bare forwards side by
    side slow each other only 2-5% on this VM."""

    def ratio(*keys: str) -> float:
        cells = [summary[k] for k in keys if k in summary]
        real = sum(c["real_s"] for c in cells)
        priced = sum(c["priced_s"] for c in cells)
        return max(1.0, real / priced) if priced > 0 else 1.0

    return ratio("decode/co-run"), ratio("prefill/co-run", "mixed/co-run")
