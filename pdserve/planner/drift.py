"""A live cluster against its plan: what the planner predicts for the traffic it just served,
beside what the router measured, so an operator sees the profile drift.

The router keeps its finished requests (arrival time, prompt and output tokens, TTFT, TPOT).
The controller replays the last window's through the simulator on the pools as they stand,
at the requests' own arrival times and lengths, and compares the simulated percentiles with
the measured ones. The router exports the relative errors as
``pdserve:planner_prediction_error{metric=...}`` and ``pdserve status`` prints them. The
simulation runs in the controller (it needs the profile and the engine's scheduler); the
router only holds the numbers, so it stays torch-free.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pdserve.planner.autoscale import recent_trace
from pdserve.planner.profile import Profile
from pdserve.planner.sim import SimConfig, Split, simulate

MIN_REQUESTS = 20  # fewer in the window: no percentile worth comparing
FIGURES = ("p50_ttft", "p90_ttft", "p50_tpot")
LABELS = {"p50_ttft": "p50 TTFT", "p90_ttft": "p90 TTFT", "p50_tpot": "p50 TPOT"}


def _percentiles(ttfts, tpots) -> dict[str, float]:
    return {
        "p50_ttft": float(np.percentile(ttfts, 50)) if len(ttfts) else 0.0,
        "p90_ttft": float(np.percentile(ttfts, 90)) if len(ttfts) else 0.0,
        "p50_tpot": float(np.percentile(tpots, 50)) if len(tpots) else 0.0,
    }


def prediction_error(
    profile: Profile,
    observations,
    now: float,
    window_s: float,
    split: Split,
    base: SimConfig | None = None,
    min_requests: int = MIN_REQUESTS,
) -> dict | None:
    """``{"requests", "rate", "predicted", "measured", "error"}`` for the requests that
    arrived in the last ``window_s`` seconds (``observations``: the router's (finish time,
    TTFT, TPOT, arrival time, prompt tokens, output tokens)), served on ``split``; ``error``
    is predicted / measured - 1 per figure. None with fewer than ``min_requests``."""
    recent = [o for o in observations if now - o[3] <= window_s]
    trace = recent_trace(observations, now, window_s)
    if len(trace) < min_requests:
        return None
    cfg = SimConfig(split) if base is None else replace(base, split=split)
    res = simulate(profile, trace, cfg).result
    measured = _percentiles(
        [o[1] for o in recent], [o[2] for o in recent if o[2] is not None and o[5] > 1]
    )
    predicted = _percentiles(res.ttfts, res.tpots)
    error = {
        k: predicted[k] / measured[k] - 1 for k in FIGURES if measured[k] > 0 and predicted[k] > 0
    }
    span = max(t.arrival_s for t in trace) or window_s
    return {
        "requests": len(trace),
        "rate": len(trace) / max(span, 1e-9),
        "split": split.label,
        "predicted": predicted,
        "measured": measured,
        "error": error,
    }


def format_prediction(pred: dict | None) -> str:
    """``pdserve status``'s line."""
    if not pred:
        return "planner: no prediction yet (planner_profile unset, or too few requests)"
    cells = [
        f"{LABELS[k]} {pred['predicted'][k] * 1e3:.0f}/{pred['measured'][k] * 1e3:.0f} ms "
        f"({pred['error'][k]:+.0%})"
        for k in FIGURES
        if k in pred["error"]
    ]
    return (
        f"planner: predicted/measured over the last {pred['requests']} requests on "
        f"{pred['split']}: " + ", ".join(cells)
    )
