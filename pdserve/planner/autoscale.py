"""The pools' target sizes from the recent traffic: the autoscaler's planner mode.

The reactive autoscaler (pdserve/cluster/autoscaler.py) moves each pool by one worker when its
own signal crosses a target: it sees a TPOT over target, not that the traffic's outputs got
longer and want two more decode workers while prefill could shrink. Here the router's recently
finished requests (their arrival times and prompt / output lengths) are replayed through the
planner's simulator (pdserve/planner/sim.py: the project's own scheduler and block manager on a
simulated clock, priced by a `pdserve profile`) on every split the pools' bounds allow, at the
observed rate times a headroom; the target is the split with the fewest workers whose SLO
attainment reaches 90% (among those, the highest attainment), or, when none does, the one
with the highest attainment. Dynamo's SLA planner does this with a mean input and output
length; this replays the length distribution and arrival pattern as they came.

Only finished requests are seen, so a burst still in flight counts once it finishes; the
headroom covers growth within a window.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.metrics import ATTAINMENT_TARGET, SLO
from pdserve.planner.profile import Profile
from pdserve.planner.search import Evaluator, trace_workload
from pdserve.planner.sim import SimConfig, Split
from pdserve.planner.workload import TraceRequest


@dataclass(frozen=True)
class SplitTarget:
    prefill: int
    decode: int
    attainment: float  # simulated, at ``rate``
    rate: float  # requests/s simulated: the window's rate times the headroom
    reason: str


def recent_trace(observations, now: float, window_s: float) -> list[TraceRequest]:
    """The requests that arrived in the last ``window_s`` seconds and finished, as a trace
    (arrival times from the first one). ``observations``: the router's (finish time, TTFT,
    TPOT, arrival time, prompt tokens, output tokens) on one monotonic clock."""
    recent = sorted((o for o in observations if now - o[3] <= window_s), key=lambda o: o[3])
    if not recent:
        return []
    first = recent[0][3]
    return [TraceRequest(o[3] - first, int(o[4]), max(int(o[5]), 1)) for o in recent]


def target_split(
    profile: Profile,
    trace: list[TraceRequest],
    window_s: float,
    slo: SLO,
    bounds: dict[str, tuple[int, int]],
    headroom: float = 1.2,
    duration_s: float = 120.0,
    base: SimConfig | None = None,
) -> SplitTarget | None:
    """The split within ``bounds`` (role -> (min, max)) that the recent ``trace`` needs, or
    None without traffic. Splits are tried by total workers, smallest first; the first total
    with a split that holds the rate ends the search."""
    if not trace or window_s <= 0:
        return None
    rate = len(trace) / window_s * headroom
    workload = trace_workload(trace, duration_s, min_requests=50, max_requests=1000)
    ev = Evaluator(profile, workload, slo, base or SimConfig(Split(1, 1)))
    (p_lo, p_hi), (d_lo, d_hi) = bounds["prefill"], bounds["decode"]
    best: tuple[float, Split] | None = None
    for total in range(p_lo + d_lo, p_hi + d_hi + 1):
        splits = [Split(p, total - p) for p in range(p_lo, p_hi + 1) if d_lo <= total - p <= d_hi]
        scored = [(ev.at(s, rate)[0], s) for s in splits]
        holding = [x for x in scored if x[0] >= ATTAINMENT_TARGET]
        if holding:
            att, split = max(holding, key=lambda x: (x[0], x[1].num_decode))
            reason = f"{split.label} holds {rate:.2f} req/s ({att:.0%} within the SLO)"
            return SplitTarget(split.num_prefill, split.num_decode, att, rate, reason)
        for x in scored:
            if best is None or x[0] > best[0]:
                best = x
    att, split = best
    reason = f"no split holds {rate:.2f} req/s; {split.label} comes closest ({att:.0%})"
    return SplitTarget(split.num_prefill, split.num_decode, att, rate, reason)


def plan_pools(cfg, profile: Profile, observations, now: float, bounds) -> SplitTarget | None:
    """One round of the planner mode (``cfg``: pdserve.config.AutoscalerConfig): the target for
    the router's ``observations`` of the last ``cfg.window_s`` seconds, or None with fewer than
    ``cfg.planner_min_requests`` requests in it (too little traffic to plan for: hold)."""
    trace = recent_trace(observations, now, cfg.window_s)
    if len(trace) < cfg.planner_min_requests:
        return None
    slo = SLO(cfg.ttft_target_s, cfg.tpot_target_s)
    return target_split(profile, trace, cfg.window_s, slo, bounds, cfg.planner_headroom)
