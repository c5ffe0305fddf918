"""The sizing search's speedups keep its answers: the simulator's output is the one it gave
before them, bit for bit; one simulation scored for every part, the capacity bisection run
ahead on idle processes, and shapes sized side by side in threads all give what the
one-probe-at-a-time path gives."""

from __future__ import annotations

import hashlib

import pytest

from pdserve.planner.capacity_search import Bisection, capacity_of
from pdserve.planner.kv_link import KvLink
from pdserve.planner.probes import PARTS, Deployment, Probe, _capacity, _score, speculative_capacity
from pdserve.planner.profile import EngineSettings
from pdserve.planner.sim import SimConfig, Split, simulate
from pdserve.planner.sizing import fewest_devices
from pdserve.planner.workload import synthetic
from tests.test_planner_sim import toy_profile
from tests.test_planner_sizing import _runner

PINNED = [  # config, (lengths, requests, rate, seed) -> (digest, preemptions) as 74b2d51 gave
    (
        SimConfig(
            Split(2, 1),
            decode_num_blocks=150,
            reserve_timeout_s=1e9,
            kv_link=KvLink(1e9, 1e-4, "prefill_worker"),
        ),
        ("200-400/100-200", 80, 5.0, 2),
        ("9589e170252edee4", 52),
    ),
    (
        SimConfig(Split(0, 1), decode_num_blocks=150),
        ("200-400/100-200", 60, 3.0, 3),
        ("c37f47b562a7e0d6", 58),
    ),
    (
        SimConfig(Split(1, 2), shared_prefix_tokens=40, cpu_cores=2, temperature=0.0),
        ("100-300/20-60", 80, 4.0, 4),
        ("bd34ed0791da87cb", 0),
    ),
]


@pytest.mark.parametrize("cfg,workload,expected", PINNED, ids=["2P1D-link", "colo", "prefix"])
def test_the_simulator_gives_what_it_gave_before_the_speedups(cfg, workload, expected):
    """Every request's send, end and token times, bit for bit, as the simulator gave them
    before #53's speedups (the scheduler's per-token work): preemption on a decode worker and
    on a colocated one, a queued KV link, prefix caching on shared cores. A change to the
    model (not its speed) updates these figures, saying why."""
    spec, n, rate, seed = workload
    prof = toy_profile(EngineSettings(num_blocks=2048, max_num_seqs=64))
    run = simulate(prof, synthetic(spec, n, rate, seed=seed), cfg)
    h = hashlib.sha256()
    for r in run.records:
        fields = (r.send_time, r.end_time, r.success, r.error, r.completion_tokens, r.token_times)
        h.update(repr(fields).encode())
    assert (h.hexdigest()[:16], run.preemptions) == expected


def _reference_capacity(holds, start: float, steps: int, factor: float) -> float:
    """The bisection as probes.py wrote it before it became ``Bisection``'s states."""
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


@pytest.mark.parametrize("capacity", [0.0, 1e-6, 0.3, 1.0, 2.5, 7.77, 250.0, 1e9])
@pytest.mark.parametrize("start,steps,factor", [(1.0, 4, 2.0), (250.0, 3, 1.1), (3.0, 0, 2.0)])
def test_the_bisection_states_walk_the_reference_search(capacity, start, steps, factor):
    def holds(rate: float) -> bool:
        return rate <= capacity

    assert capacity_of(holds, start, steps, factor) == _reference_capacity(
        holds, start, steps, factor
    )


def test_looking_ahead_lists_the_next_rate_then_each_outcomes_next():
    state = Bisection(250.0, 3, 1.1).after(True)  # 250 held: 275 next
    assert state.rate == pytest.approx(275.0)
    assert state.ahead(1) == [state.rate]
    miss, held = state.after(False), state.after(True)
    assert state.ahead(3) == [state.rate, miss.rate, held.rate]
    assert miss.rate == pytest.approx(262.5) and held.rate == pytest.approx(302.5)


@pytest.mark.parametrize("width", [1, 2, 3])
def test_a_speculative_capacity_equals_the_one_probe_at_a_time_one(width):
    dep = Deployment("toy", 2, "toy", 1)
    with _runner({"toy": toy_profile()}) as runner:
        serial = _capacity(runner.ctx, dep, "all", 4.0, 4)
        assert speculative_capacity(runner, dep, "all", 4.0, 4, 2.0, width) == serial > 0
        again = runner.simulations
        # Every probe is cached: the same search again simulates nothing.
        assert speculative_capacity(runner, dep, "all", 4.0, 4, 2.0, width) == serial
        assert runner.simulations == again


def test_a_speculative_capacity_looks_ahead_only_of_what_is_not_known():
    dep = Deployment("toy", 2, "toy", 1)
    with _runner({"toy": toy_profile()}) as runner:
        start = _capacity(runner.ctx, dep, "all", 4.0, 0) / 2  # a rate that holds
        assert runner.one(Probe(dep, start)).holds
        speculative_capacity(runner, dep, "all", start, 2, 2.0, width=2)
        # The start held (known before): the rate its miss would have led to is not simulated.
        assert not runner.known(Probe(dep, start / 2))


def test_one_simulation_serves_every_part_of_the_targets():
    dep = Deployment("toy", 1, "toy", 1)
    with _runner({"toy": toy_profile()}) as runner:
        outs = runner.run([Probe(dep, 3.0, part) for part in PARTS])
        assert runner.simulations == 1
        for part, out in zip(PARTS, outs, strict=True):
            assert out == _score(runner.ctx, Probe(dep, 3.0, part))
    assert len({(o.p90_ttft_s, o.p50_tpot_s, o.requests) for o in outs}) == 1


def test_shapes_sized_side_by_side_give_the_serial_answer():
    profiles = {"toy": toy_profile()}
    args = (6.0, [("toy", "toy")], ["toy"], {"toy": 1})
    with _runner(profiles) as serial:
        one = fewest_devices(serial, *args)
    with _runner(profiles, workers=2) as parallel:
        two = fewest_devices(parallel, *args)
    assert [(s.deployment, s.outcome, s.devices, s.estimate_devices) for s in one] == [
        (s.deployment, s.outcome, s.devices, s.estimate_devices) for s in two
    ]
    assert {s.deployment.colocated for s in two} == {True, False}
