"""The fewest devices for a rate, and the most goodput within a budget: pools sized apart, then
verified together, in any ratio; worker shapes of several devices and of different GPUs."""

from __future__ import annotations

import pytest

from pdserve.metrics import SLO
from pdserve.planner.gpu_catalog import roofline_profile
from pdserve.planner.probes import Deployment, Probe, ProbeRunner
from pdserve.planner.search import synthetic_workload
from pdserve.planner.sim import SimConfig, Split, check_compatible
from pdserve.planner.sizing import best_within, fewest_devices
from pdserve.planner.slo import Bound, SloSpec
from tests.test_planner_sim import toy_profile

WORKLOAD = synthetic_workload("100-300/20-60", seed=3, duration_s=30, max_requests=300)
SPEC = SloSpec(SLO(2.0, 0.1), 0.9)
# Long prompts, short answers: several prefill workers, and quick to simulate.
GPU_WORKLOAD = synthetic_workload("3000-6000/20-60", seed=1, duration_s=15, max_requests=150)


def _runner(profiles, spec=SPEC, workload=WORKLOAD, workers=1):
    return ProbeRunner(profiles, workload, spec, SimConfig(Split(1, 1)), workers)


def _minimal(runner: ProbeRunner, dep: Deployment, rate: float) -> None:
    """``dep`` holds at ``rate`` and one worker fewer in either pool does not."""
    assert runner.one(Probe(dep, rate)).holds
    for pool in ("decode",) if dep.colocated else ("prefill", "decode"):
        fewer = dep.grow(pool, -1)
        if fewer.num_decode and (fewer.colocated or fewer.num_prefill):
            assert not runner.one(Probe(fewer, rate)).holds, pool


def test_the_fewest_workers_hold_the_rate_and_one_fewer_in_either_pool_does_not():
    profiles = {"toy": toy_profile()}
    rate = 6.0
    with _runner(profiles) as runner:
        sized = fewest_devices(runner, rate, [("toy", "toy")], ["toy"], {"toy": 1})
        assert {s.deployment.colocated for s in sized} == {True, False}
        for s in sized:
            assert s.holds
            _minimal(runner, s.deployment, rate)
        assert sized[0].devices == min(s.devices for s in sized)
    disagg = next(s for s in sized if not s.deployment.colocated).deployment
    # Sized per pool, not as copies of a small unit: prefill-heavy traffic, more P than D.
    assert disagg.num_prefill > disagg.num_decode >= 1


def test_a_70b_model_plans_on_tp8_prefill_and_tp4_decode():
    profiles = {
        "p": roofline_profile("h100", "llama3_70b", 8),
        "d": roofline_profile("h100", "llama3_70b", 4),
    }
    assert (profiles["p"].devices_per_worker, profiles["d"].devices_per_worker) == (8, 4)
    spec = SloSpec(SLO(1.0, 0.05), 0.9)
    rate = 12.0
    with _runner(profiles, spec, GPU_WORKLOAD) as runner:
        [s] = fewest_devices(runner, rate, [("p", "d")], [], {"p": 8, "d": 4})
        d = s.deployment
        assert s.holds and s.devices == 8 * d.num_prefill + 4 * d.num_decode
        assert d.num_prefill > 1  # a pool of several TP-8 workers, minimal below
        _minimal(runner, d, rate)


def test_prefill_on_one_gpu_and_decode_on_another_plans():
    profiles = {
        "h200": roofline_profile("h200", "llama3_70b", 8),
        "a100": roofline_profile("a100", "llama3_70b", 8),
    }
    spec = SloSpec(SLO(1.0, 0.08), 0.9)
    with _runner(profiles, spec, GPU_WORKLOAD) as runner:
        [s] = fewest_devices(runner, 12.0, [("h200", "a100")], [], {"h200": 8, "a100": 8})
        assert s.holds
        # The decode pool is priced by the A100's profile: slower steps than the H200's.
        out = runner.one(Probe(s.deployment, 12.0))
        faster = runner.one(
            Probe(
                Deployment("h200", s.deployment.num_prefill, "h200", s.deployment.num_decode), 12.0
            )
        )
        assert out.p50_tpot_s > faster.p50_tpot_s


def test_pools_of_different_models_are_refused():
    with pytest.raises(ValueError, match="different models"):
        check_compatible(
            roofline_profile("h100", "llama3_8b", 1), roofline_profile("h100", "llama3_70b", 4)
        )


def test_a_budget_gives_the_deployment_with_the_most_goodput_within_it():
    profiles = {"toy": toy_profile()}
    with _runner(profiles) as runner:
        sized = best_within(runner, 6, 3.0, [("toy", "toy")], ["toy"], {"toy": 1})
        assert all(s.devices <= 6 for s in sized)
        best = sized[0]
        assert best.capacity == max(s.capacity for s in sized) > 0
        assert runner.one(Probe(best.deployment, best.capacity)).holds
        assert not runner.one(Probe(best.deployment, best.capacity * 1.3)).holds


def test_probes_in_parallel_processes_match_the_serial_ones():
    profiles = {"toy": toy_profile()}
    probes = [Probe(Deployment("toy", 2, "toy", 1), r) for r in (2.0, 4.0, 8.0)]
    with _runner(profiles) as serial:
        one = serial.run(probes)
    with _runner(profiles, workers=2) as parallel:
        two = parallel.run(probes)
    assert one == two


def test_percentile_bounds_and_each_pools_part_of_the_targets():
    spec = SloSpec(SLO(2.0, 0.1), 0.95, (Bound.parse("itl:p99=0.2"), Bound.parse("ttft:p50=1")))
    pre, dec = spec.part("prefill"), spec.part("decode")
    assert (pre.per_request, [b.metric for b in pre.bounds]) == (SLO(2.0, None), ["ttft"])
    assert (dec.per_request, [b.metric for b in dec.bounds]) == (SLO(None, 0.1), ["itl"])
    with _runner({"toy": toy_profile()}, spec) as runner:
        light = runner.one(Probe(Deployment("toy", 2, "toy", 2), 1.0))
        heavy = runner.one(Probe(Deployment("toy", 1, "toy", 1), 8.0))
    assert light.holds and light.p50_ttft_s <= 1
    assert not heavy.holds and heavy.prefill_margin < 0


@pytest.mark.parametrize(
    "text", ["ttft:p101=1", "ttfx:p90=1", "tpot:p50=-1", "tpot:50=0.1", "itl:p90"]
)
def test_a_bad_bound_is_named(text):
    with pytest.raises(ValueError, match="SLO bound"):
        Bound.parse(text)
