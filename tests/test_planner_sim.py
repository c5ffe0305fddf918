"""The planner's simulator against closed forms, and its use of the real scheduler."""

from __future__ import annotations

import pytest

from pdserve.bench.loadgen.metrics import SLO
from pdserve.planner.analytic import Hardware, ModelShape, analytic_profile
from pdserve.planner.profile import EngineSettings, Profile, Table2D, interp
from pdserve.planner.sim import SimCluster, SimConfig, Split, simulate
from pdserve.planner.workload import TraceRequest, arrival_times, synthetic

DEFAULT_ENGINE = EngineSettings()


def toy_profile(engine: EngineSettings = DEFAULT_ENGINE, router_s: float = 1e-3) -> Profile:
    """SmolLM2-sized model on a slow CPU-like machine: prefill 512 tokens ~ 1 s."""
    hw = Hardware("toy", 100e9, 10e9, 1e9, mfu=1.0, mbu=1.0, step_overhead_s=2e-3)
    model = ModelShape("toy", 1.0e8, 5.4e8, 30, 576, 2 * 30 * 192 * 4)
    prof = analytic_profile(hw, model, engine)
    return Profile(**{**prof.__dict__, "router_overhead_s": router_s})


def test_interp_is_flat_below_and_linear_past_the_table():
    assert interp([1, 2], [10, 20], 0) == 10
    assert interp([1, 2], [10, 20], 1.5) == 15
    assert interp([1, 2], [10, 20], 4) == 40
    assert interp([1, 2], [10, 5], 4) == 5  # never extrapolated downward
    t = Table2D((1, 2), (0, 10), ((1, 2), (3, 4)))
    assert t.at(1.5, 5) == pytest.approx(2.5)


def test_noisy_measurements_become_monotone():
    from pdserve.planner.profile import monotone

    assert monotone([[3, 2, 4], [1, 5, 1]]) == ((3, 3, 4), (3, 5, 5))


def test_profile_round_trips_through_json(tmp_path):
    from pdserve.planner.profile import load_profile

    prof = toy_profile()
    prof.save(tmp_path / "p.json")
    again = load_profile(tmp_path / "p.json")
    assert again.prefill_seconds(300, 100) == prof.prefill_seconds(300, 100)
    assert again.engine == prof.engine


def test_bad_profile_is_named(tmp_path):
    from pdserve.planner.profile import load_profile

    (tmp_path / "p.json").write_text('{"prefill": {}}')
    with pytest.raises(ValueError, match="p.json"):
        load_profile(tmp_path / "p.json")


def test_zero_load_ttft_is_router_plus_prefill_and_decode_waits_for_the_transfer():
    prof = toy_profile(router_s=0.004)
    n = 300
    run = simulate(prof, [TraceRequest(0.0, n, 3)], Split(1, 1))
    [ttft] = run.result.ttfts
    prefill = prof.prefill_seconds(n, 0)
    assert ttft == pytest.approx(prof.router_overhead_s + prefill)
    exposed = prof.exposed_transfer_s(n, prefill)
    # Token 2 comes from the decode worker's first step, once the KV is committed.
    second = run.result.itls[0]
    assert second == pytest.approx(exposed + prof.decode_seconds(1, n + 1))


def test_zero_load_ttft_when_the_first_token_waits_for_the_kv():
    prof = toy_profile(router_s=0.004)
    n = 300
    cfg = SimConfig(Split(1, 1), first_token_waits_for_kv=True)
    [ttft] = simulate(prof, [TraceRequest(0.0, n, 1)], cfg).result.ttfts
    prefill = prof.prefill_seconds(n, 0)
    transfer = prof.exposed_transfer_s(n, prefill)
    assert ttft == pytest.approx(prefill + transfer + prof.router_overhead_s)


@pytest.mark.parametrize("split", [Split(0, 1), Split(1, 1)], ids=["colocated", "prefill-pool"])
def test_one_deterministic_server_matches_md1_mean_wait(split):
    """Same-length prompts, one token out, one at a time: an M/D/1 queue in front of prefill.
    Mean wait = rho * S / (2 (1 - rho))."""
    n = 256
    engine = EngineSettings(max_num_batched_tokens=n, max_num_seqs=1)
    prof = toy_profile(engine)
    service = prof.prefill_seconds(n, 0)
    rho = 0.7
    times = arrival_times(20000, rho / service, seed=3)
    trace = [TraceRequest(float(t), n, 1) for t in times]
    run = simulate(prof, trace, split)
    waits = [t - service - prof.router_overhead_s for t in run.result.ttfts]
    expected = rho * service / (2 * (1 - rho))
    assert sum(waits) / len(waits) == pytest.approx(expected, rel=0.08)


def test_every_block_comes_back_and_preemption_recomputes():
    """A decode pool too small for the load: the real scheduler preempts, the router sends
    the request around again, and every request still gets all its tokens."""
    prof = toy_profile(EngineSettings(num_blocks=2048, max_num_seqs=64))
    trace = synthetic("200-400/100-200", 60, 4.0, seed=2)
    cfg = SimConfig(Split(1, 1), decode_num_blocks=120, reserve_timeout_s=1e9)  # no 429s
    sim = SimCluster(prof, cfg)
    run = sim.run(trace)
    assert run.preemptions > 0
    assert run.result.completed == len(trace)
    in_order = sorted(trace, key=lambda r: r.arrival_s)
    assert run.result.output_lens == [r.output_tokens for r in in_order]
    for w in sim.prefill + sim.decode:
        assert w.blocks.num_free == w.blocks.num_total
        assert not w.scheduler.has_unfinished


def test_chunked_prefill_takes_several_steps():
    prof = toy_profile(EngineSettings(max_num_batched_tokens=512, prefill_chunk_size=128))
    sim = SimCluster(prof, SimConfig(Split(1, 1)))
    sim.run([TraceRequest(0.0, 1000, 2)])
    assert sim.prefill[0].steps == 8


def test_an_hour_of_1p1d_traffic_simulates_in_under_a_minute():
    prof = toy_profile()
    trace = synthetic("mixed", 3600, 1.0, seed=0)  # one hour at 1 req/s
    run = simulate(prof, trace, Split(1, 1), SLO(5.0, 0.2))
    assert run.result.completed == len(trace)
    assert run.wall_s < 60


def test_workers_sharing_cores_run_slower_than_workers_with_their_own():
    prof = toy_profile()
    trace = synthetic("100-200/20-40", 40, 2.0, seed=5)
    own = simulate(prof, trace, SimConfig(Split(1, 1))).result
    shared = simulate(prof, trace, SimConfig(Split(1, 1), cpu_cores=1)).result
    assert shared.tpot_ms.median > own.tpot_ms.median
    alone = simulate(prof, [TraceRequest(0.0, 300, 1)], SimConfig(Split(1, 1), cpu_cores=1))
    assert alone.result.ttfts[0] == pytest.approx(
        prof.router_overhead_s + prof.prefill_seconds(300)
    )


def test_a_step_beside_another_worker_takes_the_measured_co_run_slowdown():
    from pdserve.planner.sim_workers import CpuShare

    cpu = CpuShare(cores=2, threads=1, co_run_slowdown=1.5)
    assert cpu.start() == 1.0  # alone
    assert cpu.start() == 1.5  # beside one other, each on its own core
    assert cpu.start() == pytest.approx(1.5 * 1.5)  # three on two cores, and beside others
    assert CpuShare(None, 1, 1.5).start() == 1.0  # own hardware: no sharing at all


def test_prefill_and_decode_steps_take_their_own_co_run_slowdowns():
    from pdserve.planner.sim_workers import CpuShare

    cpu = CpuShare(cores=2, threads=1, co_run_slowdown=2.0, co_run_slowdown_prefill=1.2)
    assert cpu.start("prefill") == 1.0  # alone
    assert cpu.start("prefill") == pytest.approx(1.2)  # beside a neighbour
    cpu.end()
    assert cpu.start("decode") == pytest.approx(2.0)
    # A profile from before the split: prefill steps take the one (decode) figure.
    assert CpuShare(2, 1, 2.0).slowdown == {"decode": 2.0, "prefill": 2.0}


def test_a_prefill_beside_decodes_is_slowed_by_the_prefill_figure_only():
    """Two workers on two cores: the colocated request's first token (a prefill beside the
    other worker's decode stream) takes the prefill slowdown; the stream's TPOT the decode
    one."""
    base = toy_profile()
    trace = [TraceRequest(0.0, 100, 400), TraceRequest(1.0, 300, 1)]
    cfg = SimConfig(Split(0, 2), cpu_cores=2)

    def run(decode: float, prefill: float):
        prof = Profile(
            **{**base.__dict__, "co_run_slowdown": decode, "co_run_slowdown_prefill": prefill}
        )
        return simulate(prof, trace, cfg).result

    slow_decode, slow_both = run(3.0, 1.0), run(3.0, 3.0)
    alone = base.router_overhead_s + base.prefill_seconds(300)
    assert slow_decode.ttfts[1] == pytest.approx(alone, rel=0.05)
    assert slow_both.ttfts[1] > 2 * alone
    assert slow_decode.tpot_ms.median == pytest.approx(slow_both.tpot_ms.median, rel=0.05)


def test_profile_keeps_the_prefill_co_run_slowdown(tmp_path):
    from pdserve.planner.profile import load_profile

    prof = Profile(**{**toy_profile().__dict__, "co_run_slowdown_prefill": 1.3})
    prof.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").co_run_slowdown_prefill == 1.3
