"""Simulation probes, run in parallel across cores and cached.

A probe is one deployment (a prefill shape x workers, a decode shape x workers, or a colocated
pool) at one rate, scored against the SLO spec or one pool's part of it; a capacity probe
bisects the rate of one deployment inside its process. ``ProbeRunner.run`` sends the uncached
ones to a ``concurrent.futures.ProcessPoolExecutor`` (each process gets the profiles, the
workload and the settings once, at start) and keeps every answer.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

from pdserve.metrics import compute_result
from pdserve.planner.profile import Profile
from pdserve.planner.sim import SimConfig, Split, simulate
from pdserve.planner.slo import SloSpec

PARTS = ("all", "prefill", "decode")


@dataclass(frozen=True)
class Deployment:
    """``num_prefill`` workers of shape ``prefill`` and ``num_decode`` of ``decode``; colocated
    (``prefill`` None) serves both phases on the decode pool's workers."""

    prefill: str | None
    num_prefill: int
    decode: str
    num_decode: int

    @property
    def colocated(self) -> bool:
        return self.prefill is None

    @property
    def split(self) -> Split:
        return Split(0 if self.colocated else self.num_prefill, self.num_decode)

    def grow(self, pool: str, by: int) -> Deployment:
        if pool == "prefill":
            return replace(self, num_prefill=self.num_prefill + by)
        return replace(self, num_decode=self.num_decode + by)


@dataclass(frozen=True)
class Probe:
    deployment: Deployment
    rate: float
    part: str = "all"  # which targets score it: all, or one pool's (slo.SloSpec.part)
    longer: float = 0.0  # > 0: a check run on a fresh, this-times-longer workload


@dataclass(frozen=True)
class Outcome:
    holds: bool
    margin: float  # smallest relative slack to the targets (< 0: missed)
    prefill_margin: float  # of the prefill pool's targets alone
    decode_margin: float
    attainment: float
    goodput: float
    p50_ttft_s: float
    p90_ttft_s: float
    p99_ttft_s: float
    p50_tpot_s: float
    p90_tpot_s: float
    p99_itl_s: float
    requests: int


_ctx: dict = {}


def _init(ctx: dict) -> None:
    global _ctx
    _ctx = ctx


def _simulate(ctx: dict, dep: Deployment, rate: float, longer: float = 0.0):
    profiles: dict[str, Profile] = ctx["profiles"]
    workload = ctx["workload"].longer(longer) if longer else ctx["workload"]
    spec: SloSpec = ctx["spec"]
    base: SimConfig = ctx["base"]
    pre = profiles[dep.decode if dep.colocated else dep.prefill]
    dec = profiles[dep.decode]
    run = simulate(pre, workload(rate), replace(base, split=dep.split), spec.per_request, dec)
    return run.result, _last_third(run, spec)


def _last_third(run, spec: SloSpec):
    """The run's last third of requests (in send order) scored alone. A deployment just past
    its capacity serves a short run well while its queue builds; the late requests show it
    (a 3,000-request probe held 99.9% where the same deployment on 6,000 held 77%)."""
    records = run.records[-(len(run.records) // 3) :] if len(run.records) >= 30 else []
    if not records:
        return run.result
    duration = max(r.end_time for r in records) - min(r.send_time for r in records)
    return compute_result(records, duration, spec.per_request)


def _margins(spec: SloSpec, res, tail) -> tuple[float, float, float]:
    """(whole spec, prefill part, decode part) margins: the worse of the run and its end."""
    return tuple(
        min(s.margin(res), s.margin(tail))
        for s in (spec, spec.part("prefill"), spec.part("decode"))
    )


def _score(ctx: dict, probe: Probe) -> Outcome:
    res, tail = _simulate(ctx, probe.deployment, probe.rate, probe.longer)
    spec: SloSpec = ctx["spec"]
    scored = spec if probe.part == "all" else spec.part(probe.part)
    margin = min(scored.margin(res), scored.margin(tail))
    pre_margin, dec_margin = _margins(spec, res, tail)[1:]
    s = 1e-3
    return Outcome(
        margin >= 0,
        margin,
        pre_margin,
        dec_margin,
        scored.attained(res),
        (res.slo_attainment or scored.attained(res)) * probe.rate,
        res.ttft_ms.median * s,
        res.ttft_ms.p90 * s,
        res.ttft_ms.p99 * s,
        res.tpot_ms.median * s,
        res.tpot_ms.p90 * s,
        res.itl_ms.p99 * s,
        res.num_requests,
    )


def _capacity(
    ctx: dict, dep: Deployment, part: str, start: float, steps: int, factor: float = 2.0
) -> float:
    """Highest rate at which ``dep`` holds ``part``: bracket from ``start`` by ``factor``,
    then bisect ``steps`` times."""

    def holds(rate: float) -> bool:
        return _score(ctx, Probe(dep, rate, part)).holds

    lo, hi, rate = 0.0, 0.0, start
    for _ in range(12):
        if holds(rate):
            lo = rate
            if hi:
                break
            rate *= factor
        else:
            hi = rate
            if lo:
                break
            rate /= factor
    if not lo or not hi:
        return lo
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if holds(mid) else (lo, mid)
    return lo


def _task(args):
    kind, payload = args
    if kind == "probe":
        return _score(_ctx, payload)
    return _capacity(_ctx, *payload)


class ProbeRunner:
    """Runs probes over ``workers`` processes (1: in this process, as tests do)."""

    def __init__(
        self,
        profiles: dict[str, Profile],
        workload,
        spec: SloSpec,
        base: SimConfig,
        workers: int | None = None,
    ):
        self.ctx = {"profiles": profiles, "workload": workload, "spec": spec, "base": base}
        self.workers = workers or os.cpu_count() or 1
        self.cache: dict = {}
        self.simulations = 0
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self):
        if self.workers > 1:
            self._pool = ProcessPoolExecutor(self.workers, initializer=_init, initargs=(self.ctx,))
        else:
            _init(self.ctx)
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

    def _map(self, tasks: list) -> list:
        todo = [t for t in dict.fromkeys(tasks) if t not in self.cache]
        if todo:
            self.simulations += len(todo)
            results = self._pool.map(_task, todo) if self._pool else map(_task, todo)
            self.cache.update(zip(todo, results))
        return [self.cache[t] for t in tasks]

    def run(self, probes: list[Probe]) -> list[Outcome]:
        return self._map([("probe", p) for p in probes])

    def one(self, probe: Probe) -> Outcome:
        return self.run([probe])[0]

    def capacities(self, asks: list[tuple]) -> list[float]:
        """For each (deployment, part, start rate, bisection steps[, bracket factor]): its
        capacity."""
        return self._map([("capacity", a) for a in asks])
