"""The planner's simulator against closed forms, and its use of the real scheduler."""

from __future__ import annotations

import pytest

from pdserve.metrics import SLO
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


def test_a_single_point_spike_is_taken_out_before_the_running_maximum():
    """A timing over both its neighbours on an axis by more than 15% becomes their mean (Zen
    4's batch 2 at context 64, 36.3 ms between 27.2 and 29.7, and batch 1 at 512); a steep
    but steady rise, or a high point on the table's edge, is kept."""
    from pdserve.planner.profile import despike, monotone

    raw = [[27.0, 27.0, 32.0, 27.5], [36.0, 29.0, 30.0, 44.0], [30.0, 34.0, 38.0, 46.0]]
    got = despike(raw)
    assert got[1][0] == pytest.approx((27.0 + 30.0) / 2)
    assert got[0][2] == pytest.approx((27.0 + 27.5) / 2)
    changed = {(i, j) for i in range(3) for j in range(4) if got[i][j] != raw[i][j]}
    assert changed == {(1, 0), (0, 2)}
    assert monotone(got)[1][0] == pytest.approx(28.5)  # no longer carried to larger batches
    assert despike([[10.0, 20.0, 40.0]]) == [[10.0, 20.0, 40.0]]


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


@pytest.mark.parametrize("shared_prefix", [0, 35], ids=["unique-prompts", "shared-prefix"])
def test_an_hour_of_1p1d_traffic_simulates_in_under_a_minute(shared_prefix):
    prof = toy_profile()
    trace = synthetic("mixed", 3600, 1.0, seed=0)  # one hour at 1 req/s
    cfg = SimConfig(Split(1, 1), shared_prefix_tokens=shared_prefix)  # hashing every block
    run = simulate(prof, trace, cfg, SLO(5.0, 0.2))
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


def _steps_on_shared_cores(cpu_kw: dict, steps: list[tuple[float, str, float]]) -> list[float]:
    """Run ``(start, kind, alone_s)`` steps on a CpuShare; each one's end time, in order."""
    from pdserve.planner.cpu_share import CpuShare
    from pdserve.planner.sim_workers import Clock

    clock = Clock()
    cpu = CpuShare(clock=clock, **cpu_kw)
    ends = [None] * len(steps)

    def finish(i: int, elapsed: float) -> None:
        ends[i] = clock.now
        assert elapsed == pytest.approx(clock.now - steps[i][0])

    for i, (t, kind, alone) in enumerate(steps):
        clock.at(t, cpu.begin, kind, alone, lambda e, i=i: finish(i, e))
    clock.run()
    return ends


def test_a_step_beside_another_worker_takes_the_measured_co_run_slowdown():
    kw = {"cores": 2, "threads": 1, "co_run_slowdown": 1.5}
    assert _steps_on_shared_cores(kw, [(0.0, "decode", 1.0)]) == [1.0]  # alone
    two = _steps_on_shared_cores(kw, [(0.0, "decode", 1.0)] * 2)  # each on its own core
    assert two == pytest.approx([1.5, 1.5])
    three = _steps_on_shared_cores(kw, [(0.0, "decode", 1.0)] * 3)  # three on two cores
    assert three == pytest.approx([1.5 * 1.5] * 3)
    own = {**kw, "cores": None}  # own hardware: no sharing at all
    assert _steps_on_shared_cores(own, [(0.0, "decode", 1.0)] * 3) == [1.0] * 3


def test_running_steps_are_re_rated_when_a_neighbour_starts_and_ends():
    """Fluid sharing: A (1 s alone) runs alone for 0.5 s, then at half speed beside B until
    it ends at 1.5; B (1 s alone) does 0.5 s of work by then and the rest alone, ending at 2."""
    kw = {"cores": 2, "threads": 1, "co_run_slowdown": 2.0}
    ends = _steps_on_shared_cores(kw, [(0.0, "decode", 1.0), (0.5, "decode", 1.0)])
    assert ends == pytest.approx([1.5, 2.0])


def test_background_work_shares_the_cores_while_it_lasts():
    """One core, a 1 s step, 0.25 s of router CPU arriving at 0: the two share the core until
    the background is done at 0.5 (0.25 of the step done), then the step ends at 1.25."""
    from pdserve.planner.cpu_share import CpuShare
    from pdserve.planner.sim_workers import Clock

    clock = Clock()
    cpu = CpuShare(cores=1, clock=clock)
    ends = []
    clock.at(0.0, cpu.begin, "decode", 1.0, lambda e: ends.append(clock.now))
    clock.at(0.0, cpu.charge, 0.0, 0.25)
    clock.run()
    assert ends == pytest.approx([1.25])
    assert cpu.background_s == 0.25


def test_a_step_pays_its_fixed_co_run_work_once_when_a_neighbour_starts():
    """Fixed 0.1 s (seconds alone) and factor 2: two 1 s steps side by side each end at
    2 x 1.1; a step alone pays nothing; B joining A at 0.5 makes A pay once (0.5 done, 0.6
    left at half speed: 1.7) and B pay once too (1.1 of work, 0.6 done at half speed by 1.7,
    the last 0.5 alone: 2.2)."""
    kw = {"cores": 2, "threads": 1, "co_run_slowdown": 2.0, "fixed": {"decode": 0.1}}
    assert _steps_on_shared_cores(kw, [(0.0, "decode", 1.0)]) == [1.0]
    assert _steps_on_shared_cores(kw, [(0.0, "decode", 1.0)] * 2) == pytest.approx([2.2] * 2)
    later = _steps_on_shared_cores(kw, [(0.0, "decode", 1.0), (0.5, "decode", 1.0)])
    assert later == pytest.approx([1.7, 2.2])
    prefill = _steps_on_shared_cores(kw, [(0.0, "prefill", 1.0), (0.0, "prefill", 1.0)])
    assert prefill == pytest.approx([2.0, 2.0])  # no fixed work given for prefill steps


def test_a_decode_pair_pays_its_own_fixed_work_and_a_prefill_neighbour_the_kinds():
    """Decode beside decode pays the pair's fixed work (0.1 s) at the pair's factor (1.0): two
    1 s steps end at 1.1, as the live pair costs a few ms at every batch; beside a prefill
    step a decode step pays its kind's (0.02) at its kind's factor (1.5)."""
    kw = {"cores": 2, "threads": 1, "co_run_slowdown": 1.5, "co_run_slowdown_prefill": 1.0,
          "pairs": {("decode", "decode"): 1.0}, "fixed": {"decode": 0.02},
          "pair_fixed": {("decode", "decode"): 0.1}}  # fmt: skip
    assert _steps_on_shared_cores(kw, [(0.0, "decode", 1.0)] * 2) == pytest.approx([1.1] * 2)
    beside = _steps_on_shared_cores(kw, [(0.0, "decode", 1.0), (0.0, "prefill", 10.0)])
    assert beside[0] == pytest.approx(1.5 * 1.02)
    none = {**kw, "pair_fixed": {("decode", "decode"): None}}  # an older profile's
    assert _steps_on_shared_cores(none, [(0.0, "decode", 1.0)] * 2) == pytest.approx([1.02] * 2)


def test_the_decode_pairs_fixed_work_is_kept_in_the_file_and_scaled_with_the_speed(tmp_path):
    from pdserve.planner.profile import load_profile

    prof = toy_profile().with_cpu(co_run_fixed_s_decode_pair=0.006)
    prof.save(tmp_path / "p.json")
    again = load_profile(tmp_path / "p.json")
    assert again.cpu.co_run_fixed_s_decode_pair == 0.006
    assert again.at_speed(decode=2.0).cpu.co_run_fixed_s_decode_pair == pytest.approx(0.012)
    assert toy_profile().at_speed(decode=2.0).cpu.co_run_fixed_s_decode_pair is None


def test_oversubscribed_cores_are_split_by_weight_and_fairly_without_weights():
    """Two decode steps and a prefill step on 2 cores: fair, each runs 1.5x slower; with the
    prefill weighing 0.5 it gets 2 x 0.5 / 2.5 = 0.4 of a core (2.5x) and each decode step
    0.8 (1.25x). A claim past what a step can use goes to the others (water-filling)."""
    from pdserve.planner.cpu_share import CpuShare

    fair = CpuShare(cores=2, threads=1)
    assert fair.shares(["decode", "decode", "prefill"], False) == (pytest.approx([1.5] * 3), 1.0)
    assert fair.shares(["decode", "prefill"], True)[0] == pytest.approx([1.5, 1.5])
    weighted = CpuShare(cores=2, threads=1, weights={"prefill": 0.5})
    shares, _ = weighted.shares(["decode", "decode", "prefill"], False)
    assert shares == pytest.approx([1.25, 1.25, 2.5])
    assert weighted.shares(["decode", "prefill"], False) == ([1.0, 1.0], 1.0)  # they fit
    # One decode step and a prefill beside the background on 2 cores, prefill weight 0.1:
    # by weight the decode step would get 2 / 2.1 of a core; the background the same.
    light = CpuShare(cores=2, threads=1, weights={"prefill": 0.1})
    shares, bg = light.shares(["decode", "prefill"], True)
    assert shares[0] == pytest.approx(2.1 / 2) and bg == pytest.approx(2.1 / 2)
    assert shares[1] == pytest.approx(2.1 / 0.2)
    capped = CpuShare(cores=3, threads=1, weights={"prefill": 0.2})
    shares, _ = capped.shares(["decode", "decode", "decode", "prefill"], False)
    # By weight each decode step would get 3 / 3.2 and the prefill 0.19; nobody is capped.
    assert shares == pytest.approx([3.2 / 3] * 3 + [3.2 / 0.6])
    few = CpuShare(cores=3, threads=1, weights={"prefill": 0.2})
    shares, _ = few.shares(["decode", "prefill", "prefill", "prefill"], False)
    # The decode step's claim (3 x 1 / 1.6) is more than its core: it gets 1, the rest split.
    assert shares == pytest.approx([1.0, 1.5, 1.5, 1.5])


def test_a_neighbour_costs_what_its_kind_costs(tmp_path):
    """A decode step beside a prefill takes ``co_run_slowdown``, beside another decode step the
    decode pair's figure; a pair the profile did not measure takes its kind's figure."""
    kw = {"cores": 2, "threads": 1, "co_run_slowdown": 2.0, "co_run_slowdown_prefill": 1.0,
          "pairs": {("decode", "decode"): 1.25}}  # fmt: skip
    decodes = _steps_on_shared_cores(kw, [(0.0, "decode", 1.0)] * 2)
    assert decodes == pytest.approx([1.25, 1.25])
    beside_prefill = _steps_on_shared_cores(kw, [(0.0, "decode", 1.0), (0.0, "prefill", 10.0)])
    assert beside_prefill[0] == pytest.approx(2.0)
    prefills = _steps_on_shared_cores(kw, [(0.0, "prefill", 1.0)] * 2)
    assert prefills == pytest.approx([1.0, 1.0])  # no prefill pair given: the prefill figure
    from pdserve.planner.profile import load_profile

    prof = toy_profile().with_cpu(co_run_slowdown_decode_pair=1.1)
    prof.save(tmp_path / "p.json")
    again = load_profile(tmp_path / "p.json").cpu.co_run_pairs
    assert again == {("decode", "decode"): 1.1, ("prefill", "prefill"): None}


def test_prefill_and_decode_steps_take_their_own_co_run_slowdowns():
    from pdserve.planner.cpu_share import CpuShare

    kw = {"cores": 2, "threads": 1, "co_run_slowdown": 2.0, "co_run_slowdown_prefill": 1.2}
    pair = _steps_on_shared_cores(kw, [(0.0, "prefill", 1.0), (0.0, "decode", 1.0)])
    assert pair == pytest.approx([1.2, 1.2 + (1.0 - 1.2 / 2.0)])
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
        prof = base.with_cpu(co_run_slowdown=decode, co_run_slowdown_prefill=prefill)
        return simulate(prof, trace, cfg).result

    slow_decode, slow_both = run(3.0, 1.0), run(3.0, 3.0)
    alone = base.router_overhead_s + base.prefill_seconds(300)
    assert slow_decode.ttfts[1] == pytest.approx(alone, rel=0.05)
    assert slow_both.ttfts[1] > 2 * alone
    assert slow_decode.tpot_ms.median == pytest.approx(slow_both.tpot_ms.median, rel=0.05)


def test_profile_keeps_the_prefill_co_run_slowdown(tmp_path):
    from pdserve.planner.profile import load_profile

    prof = toy_profile().with_cpu(co_run_slowdown_prefill=1.3)
    prof.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").cpu.co_run_slowdown_prefill == 1.3


@pytest.mark.parametrize("split", [Split(0, 1), Split(1, 1)], ids=["colocated", "prefill-pool"])
def test_a_shared_prefix_is_served_from_the_prefix_cache_after_the_first_prompt(split):
    """Prompts sharing a chat template's 35 leading tokens: the first computes them, every
    later one finds their 2 full blocks in the worker's prefix cache (the engine's own), as
    the live engine does, and computes the rest at offset 32."""
    prof = toy_profile(router_s=0.004)
    n = 300
    trace = [TraceRequest(float(i), n, 1) for i in range(3)]  # one at a time
    cfg = SimConfig(split, shared_prefix_tokens=35)
    ttfts = simulate(prof, trace, cfg).result.ttfts
    router = prof.router_overhead_s
    assert ttfts[0] == pytest.approx(router + prof.prefill_seconds(n, 0))
    cached = router + prof.prefill_seconds(n - 32, 32)
    assert ttfts[1:] == pytest.approx([cached, cached])
    assert cached < ttfts[0]
    plain = simulate(prof, trace, SimConfig(split)).result.ttfts  # no shared prefix: no hits
    assert plain == pytest.approx([ttfts[0]] * 3)


def test_prompts_share_only_the_prefix():
    from pdserve.planner.sim_workers import prompt_content

    a, b = prompt_content(40, 35), prompt_content(40, 35)
    assert a[:35] == b[:35] and len(a) == len(b) == 40
    assert not set(a[35:]) & set(b[35:])
    assert prompt_content(20, 35) == prompt_content(20, 35)  # all of it is the shared part


def test_a_prefill_workers_steps_take_its_measured_live_slowdown_and_colocated_ones_do_not():

    prof = toy_profile(router_s=0.004).with_cpu(prefill_worker_slowdown=1.25)
    n = 300
    router, prefill = prof.router_overhead_s, prof.prefill_seconds(n, 0)
    [disagg] = simulate(prof, [TraceRequest(0.0, n, 1)], Split(1, 1)).result.ttfts
    assert disagg == pytest.approx(router + 1.25 * prefill)
    [colocated] = simulate(prof, [TraceRequest(0.0, n, 1)], Split(0, 1)).result.ttfts
    assert colocated == pytest.approx(router + prefill)


def test_a_decode_workers_decode_steps_take_its_live_slowdown_and_its_local_prefills_do_not():

    prof = toy_profile(router_s=0.004).with_cpu(decode_worker_slowdown=1.2)
    n = 300
    run = simulate(prof, [TraceRequest(0.0, n, 3)], Split(1, 1))
    exposed = prof.exposed_transfer_s(n, prof.prefill_seconds(n, 0))
    assert run.result.itls[0] == pytest.approx(exposed + 1.2 * prof.decode_seconds(1, n + 1))
    assert run.result.itls[1] == pytest.approx(1.2 * prof.decode_seconds(1, n + 2))
    [colocated] = simulate(prof, [TraceRequest(0.0, n, 1)], Split(0, 1)).result.ttfts
    assert colocated == pytest.approx(prof.router_overhead_s + prof.prefill_seconds(n, 0))


def test_a_step_given_its_own_fixed_work_pays_that_instead_of_its_kinds():
    """A decode (colocated) worker's prompt step carries the profile's local fixed work
    (SimDecodeWorker.prompt_fixed_s): beside a decode step, factor 1, it pays 0.05 s where a
    prefill worker's prompt step pays its kind's 0.2 s."""
    from pdserve.planner.cpu_share import CpuShare
    from pdserve.planner.sim_workers import Clock

    def prompt_end(fixed_s):
        clock = Clock()
        cpu = CpuShare(cores=2, threads=1, clock=clock, fixed={"prefill": 0.2})
        ends = {}
        cpu.begin("decode", 5.0, lambda e: None)
        cpu.begin("prefill", 1.0, lambda e: ends.setdefault("p", clock.now), fixed_s)
        clock.run()
        return ends["p"]

    assert prompt_end(None) == pytest.approx(1.2)
    assert prompt_end(0.05) == pytest.approx(1.05)


def test_a_colocated_prompt_beside_a_decode_stream_pays_the_local_fixed_work():
    """Through the simulator (SimDecodeWorker.prompt_fixed_s): the colocated request's prompt
    step, beside the other worker's decode stream, adds co_run_fixed_s_local_prefill (0.05 s)
    to its first token, not the prefill worker's figure (0.5 s)."""
    base = toy_profile()
    trace = [TraceRequest(0.0, 100, 400), TraceRequest(1.0, 300, 1)]
    fixed = {"co_run_fixed_s_prefill": 0.5, "co_run_fixed_s_local_prefill": 0.05}
    prof = base.with_cpu(**fixed)
    [_, ttft] = simulate(prof, trace, SimConfig(Split(0, 2), cpu_cores=2)).result.ttfts
    alone = base.router_overhead_s + base.prefill_seconds(300)
    assert ttft == pytest.approx(alone + 0.05, rel=0.02)
