"""The operator's question: the fewest devices that hold a rate, in which shapes; or the most
goodput a number of devices gives.

Prefill and decode capacities are largely separable once the KV link is modelled: a first
token waits on the prefill pool, the tokens after it on the decode pool. So each pool is sized
on its own targets (``SloSpec.part``), at full scale, with the other pool ample:

1. per-worker capacities from small units (1 prefill worker beside 2 decode workers on TTFT's
   targets; 1 decode worker behind 2 prefill workers on TPOT's and ITL's), one bisection each;
2. each pool's first guess ``ceil(rate / capacity)``, then, at the full rate, the fewest
   workers of that pool that hold its targets (bisection on the count; pooling behind one
   router makes a pool of n hold more than n units, so the guess is an upper bound);
3. the two counts together, simulated at the full rate on the whole spec; a pool whose part
   misses grows by one until the whole holds, then each pool gives back a worker while it
   still holds: the answer is verified by a full-cluster simulation, and one fewer worker in
   either pool does not hold.

Any uneven ratio comes out (5P3D, 42P21D): nothing is a replica of a small unit. Every pair of
(prefill shape, decode shape) given is sized, and colocated shapes likewise (step 2 on the
whole spec); the answer is the one with the fewest devices (workers x TP degree).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.planner.probes import Deployment, Outcome, Probe, ProbeRunner

MAX_WORKERS = 4096


@dataclass
class Sized:
    deployment: Deployment
    outcome: Outcome | None  # the full-cluster simulation at the target rate
    devices: int
    estimate_devices: int  # from the small units' capacities alone
    unit_capacity: dict = field(default_factory=dict)  # pool -> req/s of one worker
    capacity: float = 0.0  # the deployment's own (budget mode), req/s

    @property
    def holds(self) -> bool:
        return self.outcome is not None and self.outcome.holds


def devices(dep: Deployment, tp: dict[str, int]) -> int:
    n = dep.num_decode * tp[dep.decode]
    return n if dep.colocated else n + dep.num_prefill * tp[dep.prefill]


def unit_capacities(runner: ProbeRunner, pairs, colos, rate: float) -> dict:
    """One worker's capacity per (pool, shape): a prefill worker beside 2 decode workers (of
    the pair's decode shape), a decode worker behind 2 prefill workers, a colocated worker.
    Each bisection starts from the profile's own busy-time estimate, a few probes away."""
    prompt, output = _mean_lengths(runner.ctx["workload"], rate)
    profiles = runner.ctx["profiles"]
    asks, keys = [], []
    for pk, dk in pairs:
        cp, cd = (
            _busy_estimate(profiles[pk], prompt, output),
            _busy_estimate(profiles[dk], prompt, output),
        )
        keys += [("prefill", pk, dk), ("decode", pk, dk)]
        asks += [(Deployment(pk, 1, dk, 2), "prefill", cp[0], UNIT_STEPS)]
        asks += [(Deployment(pk, 2, dk, 1), "decode", cd[1], UNIT_STEPS)]
    for ck in colos:
        cp, cd = _busy_estimate(profiles[ck], prompt, output)
        keys.append(("colocated", ck, ck))
        asks.append((Deployment(None, 0, ck, 1), "all", 1 / (1 / cp + 1 / cd), UNIT_STEPS))
    return dict(zip(keys, runner.capacities(asks)))


UNIT_STEPS = 4  # bisection steps of a unit's capacity: within 1/16 of its bracket


def _mean_lengths(workload, rate: float) -> tuple[float, float]:
    reqs = workload(rate)
    n = max(len(reqs), 1)
    return sum(r.prompt_tokens for r in reqs) / n, sum(r.output_tokens for r in reqs) / n


def _busy_estimate(profile, prompt: float, output: float) -> tuple[float, float]:
    """Requests a second one worker could serve if always busy: prefilling one prompt at a
    time, or decoding a batch of up to 128 (a start for the bisection, no more)."""
    prefill = 1 / profile.prefill_seconds(max(prompt, 1))
    batch = min(profile.engine.max_num_seqs, 128)
    step = profile.decode_seconds(batch, prompt + output / 2)
    return prefill, batch / (max(output, 1) * step)


def _guess(rate: float, capacity: float) -> int:
    return min(MAX_WORKERS, max(1, math.ceil(rate / capacity))) if capacity > 0 else MAX_WORKERS


def _fewest(runner: ProbeRunner, searches: list[tuple], rate: float) -> list[int]:
    """For each (make deployment from n, part, upper guess): the fewest n that holds at
    ``rate``. All searches advance together, one parallel batch a round."""
    state = []
    for make, part, hi in searches:
        state.append([make, part, max(1, hi // 2), hi])  # lo: may hold, hi: holds once checked
    # The guesses hold? Grow past any that does not (pooling rarely is worse than a unit).
    for _ in range(8):
        outs = runner.run([Probe(make(hi), rate, part) for make, part, _, hi in state])
        bad = [s for s, o in zip(state, outs) if not o.holds]
        if not bad:
            break
        for s in bad:
            s[2], s[3] = s[3] + 1, min(MAX_WORKERS, math.ceil(s[3] * 1.5))
    while any(s[2] < s[3] for s in state):
        live = [s for s in state if s[2] < s[3]]
        mids = [(s[2] + s[3]) // 2 for s in live]
        outs = runner.run([Probe(s[0](m), rate, s[1]) for s, m in zip(live, mids)])
        for s, m, o in zip(live, mids, outs):
            if o.holds:
                s[3] = m
            else:
                s[2] = m + 1
    return [s[3] for s in state]


def _settle(runner: ProbeRunner, dep: Deployment, rate: float) -> tuple[Deployment, Outcome]:
    """Grow the pools whose part misses until the whole spec holds (a few sizes at once, one
    per process), then shrink either pool while it still holds: a deployment verified at
    ``rate``, with no worker to spare."""
    # The check first, then the likely next probes (each pool holds its own part already) on
    # the processes it leaves idle: cached, and nothing is decided by them early.
    runner.submit([Probe(d, rate) for d in [dep, *_fewer(dep)][: runner.workers]])
    out = runner.one(Probe(dep, rate))
    for _ in range(16):
        if out.holds:
            break
        pools = _missing(dep, out)
        steps = range(1, max(2, runner.workers) + 1)
        bigger = [_grown(dep, pools, k) for k in steps]
        outs = runner.run([Probe(d, rate) for d in bigger])
        held = [(d, o) for d, o in zip(bigger, outs) if o.holds]
        dep, out = held[0] if held else (bigger[-1], outs[-1])
    if not out.holds:
        return dep, out
    while True:
        fewer = _fewer(dep)
        outs = runner.run([Probe(d, rate) for d in fewer])
        held = [(d, o) for d, o in zip(fewer, outs) if o.holds]
        if not held:
            return dep, out
        dep, out = max(held, key=lambda x: x[1].margin)


def _fewer(dep: Deployment) -> list[Deployment]:
    """``dep`` with one worker fewer in each pool in turn (where the pool keeps one)."""
    pools = ["decode"] if dep.colocated else ["prefill", "decode"]
    fewer = [dep.grow(p, -1) for p in pools]
    return [d for d in fewer if d.num_decode >= 1 and (d.colocated or d.num_prefill >= 1)]


def _missing(dep: Deployment, out: Outcome) -> list[str]:
    """The pools whose own targets the run missed (else the one closer to missing)."""
    if dep.colocated:
        return ["decode"]
    margins = (("prefill", out.prefill_margin), ("decode", out.decode_margin))
    return [p for p, m in margins if m < 0] or [min(margins, key=lambda x: x[1])[0]]


def _grown(dep: Deployment, pools: list[str], k: int) -> Deployment:
    for pool in pools:
        dep = dep.grow(pool, k)
    return dep


def fewest_devices(
    runner: ProbeRunner,
    rate: float,
    pairs: list[tuple[str, str]],
    colos: list[str],
    tp: dict[str, int],
) -> list[Sized]:
    """Every shape sized for ``rate`` (headroom already in it), fewest devices first. The
    shapes' searches are independent: they run side by side on the runner's processes, so
    one shape's probes fill the cores another's rounds leave idle."""
    shapes = [(pk, dk) for pk, dk in pairs] + [(None, ck) for ck in colos]
    sized = runner.concurrently(
        [lambda pk=pk, dk=dk: _size_shape(runner, rate, pk, dk, tp) for pk, dk in shapes]
    )
    return sorted(sized, key=lambda s: (not s.holds, s.devices, -s.outcome.margin))


def _size_shape(runner: ProbeRunner, rate: float, pk: str | None, dk: str, tp) -> Sized:
    """One shape (``pk`` None: colocated on ``dk``): its units, each pool's fewest workers at
    full scale, then the whole settled."""
    if pk is None:
        units = unit_capacities(runner, [], [dk], rate)
        g = _guess(rate, units["colocated", dk, dk])
        [n] = _fewest(runner, [(lambda n: Deployment(None, 0, dk, n), "all", g)], rate)
        dep, guess = Deployment(None, 0, dk, n), Deployment(None, 0, dk, g)
        unit = {"colocated": units["colocated", dk, dk]}
    else:
        units = unit_capacities(runner, [(pk, dk)], [], rate)
        gp = _guess(rate, units["prefill", pk, dk])
        gd = _guess(rate, units["decode", pk, dk])
        searches = [
            (lambda n: Deployment(pk, n, dk, gd), "prefill", gp),
            (lambda n: Deployment(pk, gp, dk, n), "decode", gd),
        ]
        n_p, n_d = _fewest(runner, searches, rate)
        dep, guess = Deployment(pk, n_p, dk, n_d), Deployment(pk, gp, dk, gd)
        unit = {"prefill": units["prefill", pk, dk], "decode": units["decode", pk, dk]}
    dep, out = _settle(runner, dep, rate)
    return Sized(dep, out, devices(dep, tp), devices(guess, tp), unit)


def best_within(
    runner: ProbeRunner, budget: int, rate: float, pairs, colos, tp: dict[str, int]
) -> list[Sized]:
    """The most goodput (the highest rate held at the SLOs) each shape gives within
    ``budget`` devices: the split that balances the pools' unit capacities, then its own
    capacity by bisection at full scale; best first."""
    units = unit_capacities(runner, pairs, colos, rate)
    deps, guesses = [], []
    for pk, dk in pairs:
        cp, cd = units["prefill", pk, dk], units["decode", pk, dk]
        best = None
        for n_p in range(1, budget // tp[pk] + 1):
            n_d = (budget - n_p * tp[pk]) // tp[dk]
            if n_d >= 1 and (best is None or min(n_p * cp, n_d * cd) > best[0]):
                best = (min(n_p * cp, n_d * cd), n_p, n_d)
        if best is not None:
            deps.append(Deployment(pk, best[1], dk, best[2]))
            guesses.append(best[0])
    for ck in colos:
        if budget // tp[ck] >= 1:
            deps.append(Deployment(None, 0, ck, budget // tp[ck]))
            guesses.append(budget // tp[ck] * units["colocated", ck, ck])
    caps = runner.capacities([(d, "all", max(g, 1e-3), 5) for d, g in zip(deps, guesses)])
    outs = runner.run([Probe(d, rate) for d in deps])
    sized = [
        Sized(d, o, devices(d, tp), devices(d, tp), capacity=c) for d, o, c in zip(deps, outs, caps)
    ]
    return sorted(sized, key=lambda s: (-s.capacity, s.devices))
