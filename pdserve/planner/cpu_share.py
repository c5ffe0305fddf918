"""Workers that share a few CPU cores (several workers on one small machine): fluid processor
sharing on the simulated clock.

Every running step has a remaining amount of work, in seconds of the step alone, and a rate.
Whenever a step starts or ends, or the background thread starts or runs dry, every running step
is advanced to now and re-rated, and its end is rescheduled. So a step that was running alone
slows down when a neighbour starts, and speeds up again when it ends (a step judged once at its
start would take all or none of a neighbour's cost).

A step's slowdown while ``k`` workers compute, each with ``threads`` threads, and the background
thread is busy (``b`` = 1) or not (0), is max(1, (k x threads + b) / cores) under fair sharing
(``weights`` all 1; else the cores are split by weight, ``shares``), times the slowdown
the profile measured for the step's kind beside a neighbour of each kind (k > 1; the largest
over the neighbours running): what a neighbour costs depends on both. A step also pays, once,
a fixed amount of work for its kind (``fixed``) when a neighbour first computes beside it: the
live steps' cost beside a neighbour is affine in their price (a short step loses relatively
more), not proportional. A decode step (bound by
memory bandwidth) loses more to a neighbour than a prefill step (bound by its own core's FLOPs),
and on vCPUs that are one core's two hyperthreads a prefill beside it costs far more than
another decode step. The background is the router's and its client's CPU work (``charge``),
worked through in order by one thread (one GIL), itself slowed only by processor sharing.
``cores`` None: every worker has its own hardware, as on GPUs; steps take their alone time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

KINDS = ("decode", "prefill")
_EPS = 1e-9  # seconds: float error on an hour-long clock is far below it


@dataclass
class _Running:
    kind: str
    remaining: float  # seconds of the step alone still to do
    done: Callable[[float], None]
    started: float
    fixed: float  # its once-per-step co-run work (its kind's, or its own)
    rate: float = 1.0  # work done per simulated second
    gen: int = 0  # the version of its end event that still counts
    fixed_paid: bool = False  # that work was added


class CpuShare:
    def __init__(
        self,
        cores: int | None = None,
        threads: int = 1,
        co_run_slowdown: float = 1.0,
        co_run_slowdown_prefill: float | None = None,
        clock=None,
        pairs: dict[tuple[str, str], float] | None = None,
        fixed: dict[str, float] | None = None,
        weights: dict[str, float] | None = None,
        pair_fixed: dict[tuple[str, str], float] | None = None,
    ):
        """``co_run_slowdown``: a decode step's beside a prefilling neighbour;
        ``co_run_slowdown_prefill``: a prefill step's beside a decoding one (None: the decode
        figure); ``pairs``: (kind, neighbour kind) -> slowdown for the other pairs (a pair not
        given takes its kind's figure); ``fixed``: kind -> the work a step adds once beside
        a computing neighbour; ``weights``: kind -> its claim on oversubscribed cores (1: fair);
        ``pair_fixed``: (kind, neighbour kind) -> that work where a pair has its own."""
        self.cores = cores
        self.threads = max(threads, 1)
        prefill = co_run_slowdown if co_run_slowdown_prefill is None else co_run_slowdown_prefill
        self.slowdown = {"decode": co_run_slowdown, "prefill": prefill}
        self.pairs = {(k, n): self.slowdown[k] for k in KINDS for n in KINDS}
        self.pairs.update({k: v for k, v in (pairs or {}).items() if v is not None})
        self.fixed = {k: (fixed or {}).get(k, 0.0) for k in KINDS}
        self.weights = {k: (weights or {}).get(k, 1.0) for k in KINDS}
        self.pair_fixed = {k: v for k, v in (pair_fixed or {}).items() if v is not None}
        self.clock = clock
        self.running: dict[int, _Running] = {}
        self._next_id = 0
        self._last = 0.0  # when every running step's remaining work was last brought up to date
        self.background_s = 0.0  # all the background was given
        self._bg_remaining = 0.0
        self._bg_active = False
        self._bg_rate = 1.0
        self._bg_gen = 0

    def pair_slowdown(self, kind: str, neighbours) -> float:
        """What the neighbours' kinds cost a step of ``kind`` beside them (the largest)."""
        return max(self.pairs[kind, n] for n in neighbours) if neighbours else 1.0

    def fixed_beside(self, step: _Running, neighbours) -> float:
        """The once-per-step work a step pays beside the neighbours' kinds (the largest)."""
        return max(self.pair_fixed.get((step.kind, n), step.fixed) for n in neighbours)

    def shares(self, kinds: list[str], background: bool) -> tuple[list[float], float]:
        """How many times slower than on free cores each running step (``kinds``) and the
        background run from processor sharing alone: 1 while the threads fit the cores, else
        the cores split in proportion to ``weights`` x threads (the background weighs 1) and
        no one given more than it can use (water-filling). Equal weights: the fair share,
        (threads computing) / cores, for all."""
        demand = [float(self.threads)] * len(kinds) + [1.0] * int(background)
        weight = [self.weights[k] * self.threads for k in kinds] + [1.0] * int(background)
        if not self.cores or sum(demand) <= self.cores:
            return [1.0] * len(kinds), 1.0
        if all(w == 1.0 for w in self.weights.values()):  # fair: the closed form, no search
            fair = sum(demand) / self.cores
            return [fair] * len(kinds), fair if background else 1.0
        alloc = [0.0] * len(demand)
        left, open_ = float(self.cores), set(range(len(demand)))
        while open_:
            total = sum(weight[i] for i in open_)
            full = {i for i in open_ if left * weight[i] / total >= demand[i]}
            if not full:
                for i in open_:
                    alloc[i] = left * weight[i] / total
                break
            for i in full:
                alloc[i] = demand[i]
                left -= demand[i]
            open_ -= full
        share = [d / a for d, a in zip(demand, alloc, strict=True)]
        return share[: len(kinds)], share[-1] if background else 1.0

    def begin(
        self,
        kind: str,
        alone_s: float,
        done: Callable[[float], None],
        fixed_s: float | None = None,
    ) -> None:
        """A step of ``kind`` ("prefill": it computes prompt tokens; else "decode") that takes
        ``alone_s`` on its own starts now; ``done(elapsed_s)`` runs at its end. ``fixed_s``:
        its once-per-step co-run work, where not its kind's."""
        now = self.clock.now
        if not self.cores:
            self.clock.at(now + alone_s, done, alone_s)
            return
        self._advance(now)
        self._next_id += 1
        kind = "prefill" if kind == "prefill" else "decode"
        fixed = self.fixed[kind] if fixed_s is None else fixed_s
        self.running[self._next_id] = _Running(kind, alone_s, done, now, fixed)
        self._rerate(now)

    def charge(self, now: float, cpu_s: float) -> None:
        """``cpu_s`` of background CPU work arrives at ``now``."""
        if not self.cores or cpu_s <= 0:
            return
        self.background_s += cpu_s
        if self._bg_active:  # rates unchanged: its end event, now early, is pushed back then
            self._bg_remaining += cpu_s
            return
        self._advance(now)
        self._bg_active, self._bg_remaining = True, cpu_s
        self._rerate(now)

    def _advance(self, now: float) -> None:
        dt = now - self._last
        if dt > 0:
            for step in self.running.values():
                step.remaining -= dt * step.rate
            if self._bg_active:
                self._bg_remaining -= dt * self._bg_rate
        self._last = now

    def _rerate(self, now: float) -> None:
        bg = self._bg_active
        counts = {k: 0 for k in KINDS}
        for step in self.running.values():
            counts[step.kind] += 1
        steps = list(self.running.items())
        shares, bg_share = self.shares([step.kind for _, step in steps], bg)
        for (sid, step), share in zip(steps, shares, strict=True):
            others = [k for k in KINDS if counts[k] - (k == step.kind) > 0]
            if others and not step.fixed_paid:
                step.remaining += self.fixed_beside(step, others)
                step.fixed_paid = True
            step.rate = 1.0 / (share * self.pair_slowdown(step.kind, others))
            step.gen += 1
            self.clock.at(now + max(step.remaining, 0.0) / step.rate, self._finish, sid, step.gen)
        if bg:
            self._bg_rate = 1.0 / bg_share
            self._schedule_background(now)

    def _schedule_background(self, now: float) -> None:
        self._bg_gen += 1
        end = now + max(self._bg_remaining, 0.0) / self._bg_rate
        self.clock.at(end, self._background_dry, self._bg_gen)

    def _finish(self, sid: int, gen: int) -> None:
        step = self.running.get(sid)
        if step is None or step.gen != gen:
            return  # superseded by a later re-rating
        now = self.clock.now
        self._advance(now)
        del self.running[sid]
        self._rerate(now)
        step.done(now - step.started)

    def _background_dry(self, gen: int) -> None:
        if gen != self._bg_gen:
            return
        now = self.clock.now
        self._advance(now)
        if self._bg_remaining > _EPS:  # work arrived since this end was scheduled
            self._schedule_background(now)
            return
        self._bg_active, self._bg_remaining = False, 0.0
        self._rerate(now)
