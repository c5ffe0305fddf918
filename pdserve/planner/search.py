"""Search every xPyD split up to N workers, and colocated, for the one a workload needs.

For each split: SLO attainment and goodput at the target rate, and the split's *capacity*:
the highest rate at which >= 90% of requests meet both SLOs (DistServe's goodput of a system),
found by bracketing and bisection, each probe a simulation of the same workload shape (same
seed: common random numbers keep attainment monotone in the rate). Goodput per worker =
capacity / workers, the cost measure.

The recommendation: the split with the highest capacity per worker among those that hold the
target rate (capacity >= rate); if none does, the one with the highest capacity. Colocated is
recommended when it is that split, i.e. when disaggregation does not pay.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from pdserve.metrics import ATTAINMENT_TARGET, SLO
from pdserve.planner.profile import Profile
from pdserve.planner.sim import SimConfig, Split, simulate
from pdserve.planner.workload import (
    TraceRequest,
    at_rate,
    repeat_trace,
    requests_for,
    synthetic,
)

BISECT_STEPS = 6
MAX_BRACKET_STEPS = 10

# A rate -> the requests to serve at that rate.
WorkloadAt = Callable[[float], list[TraceRequest]]


@dataclass
class SplitResult:
    split: Split
    attainment: float  # at the target rate
    goodput: float  # good requests / s at the target rate
    capacity: float  # highest rate with attainment >= 90%
    p90_ttft_ms: float = 0.0
    p50_tpot_ms: float = 0.0
    curve: list[tuple[float, float, float]] = field(default_factory=list)  # rate, att, goodput
    replicas: int = 1  # copies of this unit in the deployment (each takes 1/replicas of it)

    @property
    def deployment_capacity(self) -> float:
        return self.capacity * self.replicas

    @property
    def capacity_per_worker(self) -> float:
        return self.capacity / self.split.workers

    @property
    def goodput_per_worker(self) -> float:
        return self.goodput / self.split.workers


@dataclass
class Plan:
    rate: float
    slo: SLO
    results: list[SplitResult]
    recommended: SplitResult
    holds_rate: bool  # whether the recommended split holds the target rate
    best_disaggregated: SplitResult | None = None
    best_colocated: SplitResult | None = None

    @property
    def disaggregation_pays(self) -> bool:
        return not self.recommended.split.colocated


@dataclass(frozen=True)
class SyntheticWorkload:
    """A named or ranged length mix at any rate (a class, not a closure: probes run in other
    processes and take it with them)."""

    spec: str
    seed: int = 0
    arrival: str = "poisson"
    cv: float = 1.0
    duration_s: float = 300.0
    min_requests: int = 200
    max_requests: int = 4000

    def __call__(self, rate: float) -> list[TraceRequest]:
        n = requests_for(rate, self.duration_s, self.min_requests, self.max_requests)
        return synthetic(self.spec, n, rate, self.seed, self.arrival, self.cv)

    def longer(self, factor: float) -> SyntheticWorkload:
        """The same traffic over ``factor`` x the duration (a fresh seed: a check, not a fit)."""
        return replace(
            self,
            duration_s=self.duration_s * factor,
            max_requests=int(self.max_requests * factor),
            seed=self.seed + 1,
        )


@dataclass(frozen=True)
class TraceWorkload:
    """The trace's lengths and arrival pattern, time-scaled to each rate (cycled to length)."""

    trace: tuple[TraceRequest, ...]
    duration_s: float = 300.0
    min_requests: int = 200
    max_requests: int = 4000

    def __call__(self, rate: float) -> list[TraceRequest]:
        n = requests_for(
            rate, self.duration_s, max(self.min_requests, len(self.trace)), self.max_requests
        )
        return at_rate(repeat_trace(list(self.trace), n), rate)

    def longer(self, factor: float) -> TraceWorkload:
        return replace(
            self, duration_s=self.duration_s * factor, max_requests=int(self.max_requests * factor)
        )


def synthetic_workload(
    spec: str,
    seed: int = 0,
    arrival: str = "poisson",
    cv: float = 1.0,
    duration_s: float = 300.0,
    min_requests: int = 200,
    max_requests: int = 4000,
) -> SyntheticWorkload:
    return SyntheticWorkload(spec, seed, arrival, cv, duration_s, min_requests, max_requests)


def trace_workload(
    trace: list[TraceRequest],
    duration_s: float = 300.0,
    min_requests: int = 200,
    max_requests: int = 4000,
) -> TraceWorkload:
    return TraceWorkload(tuple(trace), duration_s, min_requests, max_requests)


def candidate_splits(max_workers: int, colocated_sizes: str = "all") -> list[Split]:
    """Every xPyD with x + y <= max_workers, then colocated pools (every size, or only N)."""
    if max_workers < 1:
        raise ValueError("max_workers must be >= 1")
    out = [Split(p, n - p) for n in range(2, max_workers + 1) for p in range(1, n)]
    sizes = range(1, max_workers + 1) if colocated_sizes == "all" else [max_workers]
    return out + [Split(0, n) for n in sizes]


class Evaluator:
    """Simulates one split at given rates, caching each (split, rate) run."""

    def __init__(self, profile: Profile, workload: WorkloadAt, slo: SLO, base: SimConfig):
        self.profile = profile
        self.workload = workload
        self.slo = slo
        self.base = base
        self._cache: dict[tuple[Split, float], tuple[float, float, object]] = {}
        self.sim_seconds = 0.0

    def at(self, split: Split, rate: float):
        """(attainment, goodput, BenchResult) of ``split`` at ``rate``."""
        key = (split, round(rate, 9))
        if key not in self._cache:
            run = simulate(
                self.profile, self.workload(rate), replace(self.base, split=split), self.slo
            )
            self.sim_seconds += run.wall_s
            res = run.result
            self._cache[key] = (res.slo_attainment or 0.0, res.request_goodput or 0.0, res)
        return self._cache[key]

    def holds(self, split: Split, rate: float) -> bool:
        return self.at(split, rate)[0] >= ATTAINMENT_TARGET

    def capacity(self, split: Split, start: float) -> float:
        """Highest rate with attainment >= target: bracket by doubling/halving, then bisect."""
        lo = hi = None
        probe = start
        for _ in range(MAX_BRACKET_STEPS):
            if self.holds(split, probe):
                lo = probe
                if hi is not None:
                    break
                probe *= 2
            else:
                hi = probe
                if lo is not None:
                    break
                probe /= 2
        if lo is None:
            return 0.0
        if hi is None:
            return lo
        for _ in range(BISECT_STEPS):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.holds(split, mid) else (lo, mid)
        return lo


def evaluate(ev: Evaluator, split: Split, rate: float, curve_rates: list[float]) -> SplitResult:
    att, goodput, res = ev.at(split, rate)
    capacity = ev.capacity(split, rate)
    curve = [(r, *ev.at(split, r)[:2]) for r in curve_rates]
    return SplitResult(split, att, goodput, capacity, res.ttft_ms.p90, res.tpot_ms.median, curve)


def recommend(results: list[SplitResult], rate: float) -> tuple[SplitResult, bool]:
    holding = [r for r in results if r.deployment_capacity >= rate]
    if holding:
        best = max(holding, key=lambda r: (r.capacity_per_worker, -r.split.workers, r.capacity))
        return best, True
    return max(results, key=lambda r: (r.deployment_capacity, -r.split.workers)), False


def plan(
    profile: Profile,
    workload: WorkloadAt,
    rate: float,
    slo: SLO,
    max_workers: int,
    base: SimConfig | None = None,
    curve_points: int = 8,
    progress: Callable[[str], None] | None = None,
    unit_max: int | None = None,
) -> Plan:
    """Every split up to ``max_workers``; past ``unit_max`` workers (a 64-GPU deployment),
    every *unit* up to ``unit_max`` instead, replicated to fill ``max_workers``, each copy
    serving its share of the rate (copies behind one router pool a little better than that,
    so this errs on the safe side)."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    if not slo.is_set:
        raise ValueError("give an SLO: slo_ttft and/or slo_tpot")
    ev = Evaluator(profile, workload, slo, base or SimConfig(Split(1, 1)))
    unit_max = min(unit_max or max_workers, max_workers)
    results = []
    for split in candidate_splits(unit_max):
        replicas = max_workers // split.workers if unit_max < max_workers else 1
        share = rate / replicas
        curve_rates = [share * 2 * (i + 1) / curve_points for i in range(curve_points)]
        result = evaluate(ev, split, share, curve_rates)
        result.replicas = replicas
        results.append(result)
        if progress is not None:
            progress(split.label)
    best, holds = recommend(results, rate)
    disagg = [r for r in results if not r.split.colocated]
    colo = [r for r in results if r.split.colocated]
    return Plan(
        rate,
        slo,
        results,
        best,
        holds,
        max(disagg, key=lambda r: r.capacity_per_worker, default=None),
        max(colo, key=lambda r: r.capacity_per_worker, default=None),
    )
