"""The profile's CPU costs beside the forward (temperature sampling, the router's and client's
CPU) and how the simulator charges them, against closed forms."""

from __future__ import annotations

import json

import pytest

from engine.request import Request, SamplingParams
from engine.scheduler import ScheduledSequence
from pdserve.planner.cpu_share import CpuShare
from pdserve.planner.profile import EngineSettings, Profile, load_profile
from pdserve.planner.sim import SimConfig, Split, simulate
from pdserve.planner.sim_workers import Clock
from pdserve.planner.workload import TraceRequest
from tests.conftest import needs_embedded
from tests.test_planner_sim import toy_profile

SAMPLE_S = 0.004


# The router's and the decode worker's CPU costs (the CPU corrections they are among).
CPU_COST_FIELDS = ("router_cpu_per_request_s", "router_cpu_per_token_s", "stream_cpu_per_token_s")


def with_costs(sample_seconds_per_row: float = 0.0, **costs) -> Profile:
    prof = toy_profile().with_cpu(**costs)
    return Profile(**{**prof.__dict__, "sample_seconds_per_row": sample_seconds_per_row})


def decode_rows(n: int, temperature: float, context: int = 100) -> list[ScheduledSequence]:
    params = SamplingParams(max_tokens=50, temperature=temperature)
    rows = []
    for i in range(n):
        req = Request(f"r{i}", [3] * context, params, output_token_ids=[3])
        req.num_computed_tokens = context
        rows.append(ScheduledSequence(req, 1, True))
    return rows


def test_a_sampled_row_costs_the_profiles_figure_and_a_greedy_row_nothing():
    prof = with_costs(sample_seconds_per_row=SAMPLE_S)
    greedy, sampled = decode_rows(8, 0.0), decode_rows(8, 1.0)
    forward = prof.decode_seconds(8, 101)
    assert prof.step_seconds(greedy) == pytest.approx(forward)
    assert prof.step_seconds(sampled) == pytest.approx(forward + 8 * SAMPLE_S)
    # A prefill chunk that does not reach the prompt's end samples nothing.
    req = Request("p", [3] * 300, SamplingParams(max_tokens=4, temperature=1.0))
    assert prof.step_seconds([ScheduledSequence(req, 128, False)]) == pytest.approx(
        prof.prefill_seconds(128, 0)
    )


def test_cpu_costs_round_trip_and_an_older_profile_reads_zero(tmp_path):
    costs = dict(zip(CPU_COST_FIELDS, (0.003, 3e-4, 1e-4), strict=True))
    with_costs(0.004, **costs).save(tmp_path / "p.json")
    again = load_profile(tmp_path / "p.json")
    assert {k: getattr(again.cpu, k) for k in CPU_COST_FIELDS} == costs
    assert again.sample_seconds_per_row == 0.004
    old = json.loads((tmp_path / "p.json").read_text())
    for k in (*CPU_COST_FIELDS, "sample_seconds_per_row"):
        del old[k]
    (tmp_path / "old.json").write_text(json.dumps(old))
    older = load_profile(tmp_path / "old.json")
    assert older.sample_seconds_per_row == 0
    assert all(getattr(older.cpu, k) == 0 for k in CPU_COST_FIELDS)


def test_zero_load_tpot_is_a_decode_step_plus_one_sampled_row():
    prof = with_costs(sample_seconds_per_row=SAMPLE_S)
    trace = [TraceRequest(0.0, 100, 20)]
    greedy = simulate(prof, trace, SimConfig(Split(0, 1), temperature=0.0)).result
    sampled = simulate(prof, trace, SimConfig(Split(0, 1), temperature=1.0)).result
    assert sampled.tpot_ms.median == pytest.approx(greedy.tpot_ms.median + SAMPLE_S * 1e3)
    assert sampled.ttfts[0] == pytest.approx(greedy.ttfts[0] + SAMPLE_S)


def _step_ends(cores, steps: int, background_s: float) -> tuple[list[float], CpuShare]:
    """``steps`` decode steps of 0.1 s alone and ``background_s`` of router CPU, all at 0."""
    clock = Clock()
    cpu = CpuShare(cores=cores, threads=1, clock=clock)
    ends = []
    for _ in range(steps):
        clock.at(0.0, cpu.begin, "decode", 0.1, lambda e: ends.append(clock.now))
    clock.at(0.0, cpu.charge, 0.0, background_s)
    clock.run()
    return ends, cpu


def test_background_cpu_slows_a_step_only_past_the_cores():
    # One worker and the background thread fit on 2 cores.
    assert _step_ends(2, 1, 0.05)[0] == pytest.approx([0.1])
    # Two workers and the background: 3 threads on 2 cores, each at 2/3 speed until the
    # background's 0.05 s are done (at 0.075, 0.05 of each step done), then full speed.
    assert _step_ends(2, 2, 0.05)[0] == pytest.approx([0.125, 0.125])
    ends, own = _step_ends(None, 2, 1.0)  # own hardware: the router has cores of its own
    assert ends == pytest.approx([0.1, 0.1]) and own.background_s == 0


def test_on_one_core_every_streamed_tokens_router_cpu_adds_to_the_next_step():
    """One worker, one core: the step after a token starts with that token's router work queued
    (per_token of it), which shares the core: the step takes decode + per_token exactly."""
    per_token = 0.002
    prof = with_costs(router_cpu_per_token_s=per_token / 2, stream_cpu_per_token_s=per_token / 2)
    trace = [TraceRequest(0.0, 100, 20)]
    plain = simulate(with_costs(), trace, SimConfig(Split(0, 1), cpu_cores=1)).result
    taxed = simulate(prof, trace, SimConfig(Split(0, 1), cpu_cores=1)).result
    assert taxed.tpot_ms.median == pytest.approx(plain.tpot_ms.median + per_token * 1e3)
    # With its own hardware (no cpu_cores) the router costs the workers nothing.
    own = simulate(prof, trace, SimConfig(Split(0, 1))).result
    assert own.tpot_ms.median == pytest.approx(
        simulate(with_costs(), trace, SimConfig(Split(0, 1))).result.tpot_ms.median
    )


def test_router_cpu_per_request_delays_a_step_that_starts_behind_it():
    prof = with_costs(router_cpu_per_request_s=0.05)
    trace = [TraceRequest(0.0, 100, 2)]
    plain = simulate(with_costs(), trace, SimConfig(Split(0, 1), cpu_cores=1)).result
    taxed = simulate(prof, trace, SimConfig(Split(0, 1), cpu_cores=1)).result
    # The request's 50 ms of router work is still queued when its prefill starts (1 ms later).
    assert taxed.ttfts[0] == pytest.approx(plain.ttfts[0] + 0.05 - prof.router_overhead_s)


def test_two_runs_give_the_cost_per_request_and_per_token():
    from pdserve.bench.fidelity.measure_router import solve_costs

    idle, per_req, per_tok, stream = 0.01, 0.004, 3e-4, 1e-4
    # (cpu, fake worker cpu, wall, tokens) of 64 requests streaming 2 and 64 tokens each
    runs = [
        (idle * wall + 64 * per_req + tokens * per_tok, tokens * stream + 0.2, wall, tokens)
        for wall, tokens in ((1.0, 128), (5.0, 4096))
    ]
    got = solve_costs(*runs, requests=64, idle=idle)
    assert got.per_request_s == pytest.approx(per_req)
    assert got.per_token_s == pytest.approx(per_tok)
    assert got.worker_per_token_s == pytest.approx(stream)
    with pytest.raises(ValueError):
        solve_costs(runs[1], runs[0], 64, idle)


class _Tokenizer:
    """Counts words: enough to check which prompt each rebuilt request carries."""

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return " ".join(m["content"] for m in messages) + " <assistant>"

    def encode(self, text, add_special_tokens=False):
        return text.split()


def test_a_stored_run_is_rebuilt_with_its_seeded_sends_and_lengths():
    from pdserve.bench.fidelity.fidelity_replay import NONCE, rebuild_requests
    from pdserve.bench.loadgen.serve import poisson_schedule
    from pdserve.bench.loadgen.workloads import make_workload

    got = rebuild_requests("mixed", 20, 1.5, 0, _Tokenizer())
    want = make_workload("mixed", 20, 0, NONCE).requests
    assert [r.arrival_s for r in got] == pytest.approx(poisson_schedule(20, 1.5, 0).tolist())
    assert [r.output_tokens for r in got] == [r.max_tokens for r in want]
    words = [len(r.as_messages()[0]["content"].split()) + 1 for r in want]
    assert [r.prompt_tokens for r in got] == words
    assert max(words) > 500 > min(words)  # long documents among the chats


class _TemplateTokenizer(_Tokenizer):
    """A chat template with a 4-word system preamble, as SmolLM2's adds one."""

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "<system> be helpful </system> " + super().apply_chat_template(messages)


def test_a_runs_prompts_share_the_template_preamble_and_the_nonce_word():
    """Every prompt of a run begins with the template's preamble and "Session": the nonce
    word itself carries the request's index ("0000-3."), so the shared part ends before it."""
    from pdserve.bench.fidelity.fidelity_replay import shared_prefix_tokens

    assert shared_prefix_tokens("chat", _Tokenizer()) == 1
    assert shared_prefix_tokens("mixed", _TemplateTokenizer()) == 4 + 1


class _CharTokenizer(_Tokenizer):
    """One token a character: every digit of the request's index is a token of its own."""

    def encode(self, text, add_special_tokens=False):
        return list(text)


def test_the_shared_prefix_is_what_most_requests_find_cached_index_digits_included():
    """Requests 0 and 1 share the nonce line up to the index; requests 10-39, most of a run,
    share the index's first digit with an earlier request too: the median request's share."""
    from pdserve.bench.fidelity.fidelity_replay import NONCE, shared_prefix_tokens

    assert shared_prefix_tokens("chat", _CharTokenizer()) == len(f"Session {NONCE}-") + 1


def test_a_stored_run_replays_the_servers_token_counts_at_each_requests_own_send_offset():
    """A run stored with its requests' counts replays them, not the rebuilt ones: here the
    run's nonce tokenized to 2 tokens more than the placeholder (every prompt and the shared
    preamble 2 longer) and request 3 failed; a run stored before ``sent_index`` finds each
    request's send offset by matching the counts, one stored with it uses it."""
    from pdserve.bench.fidelity.fidelity_replay import (
        rebuild_requests,
        shared_prefix_tokens,
        stored_requests,
    )

    tok = _TemplateTokenizer()
    rebuilt = rebuild_requests("mixed", 8, 1.5, 0, tok)
    kept = [0, 1, 2, 4, 5, 6, 7]
    real = {
        "prompt_tokens": [rebuilt[i].prompt_tokens + 2 for i in kept],
        "output_tokens": [rebuilt[i].output_tokens for i in kept],
    }
    row = {"workload": "mixed", "requests": 8, "rate": 1.5, "per_request": {"real": real}}
    for stored in (row, {**row, "per_request": {"real": {**real, "sent_index": kept}}}):
        trace, shared = stored_requests(stored, 0, tok)
        assert [r.arrival_s for r in trace] == [rebuilt[i].arrival_s for i in kept]
        assert [r.prompt_tokens for r in trace] == real["prompt_tokens"]
        assert [r.output_tokens for r in trace] == real["output_tokens"]
        assert shared == shared_prefix_tokens("mixed", tok) + 2
    # A run that kept its send indices pairs the counts by them, even when request 0 was shed.
    late = [1, 2, 3, 4, 5, 6, 7]
    first_shed = {
        "prompt_tokens": [rebuilt[i].prompt_tokens + 2 for i in late],
        "output_tokens": [rebuilt[i].output_tokens for i in late],
        "sent_index": late,
    }
    trace, shared = stored_requests({**row, "per_request": {"real": first_shed}}, 0, tok)
    assert [r.arrival_s for r in trace] == [rebuilt[i].arrival_s for i in late]
    assert shared == shared_prefix_tokens("mixed", tok) + 2
    # Stored before per_request: the rebuilt requests, every one of them.
    old = {k: v for k, v in row.items() if k != "per_request"}
    assert stored_requests(old, 0, tok) == (rebuilt, shared_prefix_tokens("mixed", tok))
    wrong = {**row, "per_request": {"real": {**real, "output_tokens": [1] * len(kept)}}}
    with pytest.raises(ValueError, match="do not match its seeded workload"):
        stored_requests(wrong, 0, tok)


def test_resimulate_keeps_the_measured_side_and_scores_the_new_one():
    from pdserve.bench.fidelity.fidelity_replay import METRICS, resimulate
    from pdserve.metrics import SLO

    real = {"p50_ttft_ms": 100.0, "p90_ttft_ms": 200.0, "p50_tpot_ms": 50.0, "goodput": 1.0}
    row = {"split": "1P1D", "workload": "chat", "rate": 1.0, "requests": 20, "real": real}
    report = {"cpu_cores": 2, "fidelity": [row, {**row, "split": "colo2"}]}
    out = resimulate(report, toy_profile(), {"chat": SLO(2.0, 0.2)}, _Tokenizer())
    assert [r["real"] for r in out["fidelity"]] == [real, real]
    for r in out["fidelity"]:
        for m in METRICS:
            assert r["error"][m] == pytest.approx(abs(r["sim"][m] - real[m]) / real[m])
    assert out["mape"]["goodput"] == pytest.approx(
        sum(r["error"]["goodput"] for r in out["fidelity"]) / 2
    )


def test_resimulate_replays_each_run_at_its_probed_speed():
    """A run that a speed probe found 2x slower than the profile is simulated on the profile
    at that speed: the same as resimulating the unprobed run on ``at_speed(2, 2)``."""
    from pdserve.bench.fidelity.fidelity_replay import resimulate
    from pdserve.metrics import SLO

    real = {"p50_ttft_ms": 100.0, "p90_ttft_ms": 200.0, "p50_tpot_ms": 50.0, "goodput": 1.0}
    row = {"split": "1P1D", "workload": "chat", "rate": 1.0, "requests": 20, "real": real}
    slos, prof = {"chat": SLO(2.0, 0.2)}, toy_profile()
    probed = {
        "cpu_cores": 2,
        "fidelity": [{**row, "speed": {"used": {"decode": 2.0, "prefill": 2.0}}}],
    }
    got = resimulate(probed, prof, slos, _Tokenizer())["fidelity"][0]["sim"]
    plain = {"cpu_cores": 2, "fidelity": [row]}
    assert (
        got == resimulate(plain, prof.at_speed(2.0, 2.0), slos, _Tokenizer())["fidelity"][0]["sim"]
    )
    assert got != resimulate(plain, prof, slos, _Tokenizer())["fidelity"][0]["sim"]


def test_a_repeat_scores_the_real_cluster_against_itself():
    """Two runs of the same requests: each one's real side taken as the prediction of the
    other's, and each simulation scored on the other run; a different workload is refused."""
    from pdserve.bench.fidelity.fidelity_replay import repeat_spread

    def run(split, real, sim):
        keys = ("p50_ttft_ms", "p90_ttft_ms", "p50_tpot_ms", "goodput")
        return {
            "split": split, "workload": "chat", "rate": 1.0, "requests": 20,
            "real": dict(zip(keys, real, strict=True)), "sim": dict(zip(keys, sim, strict=True)),
        }  # fmt: skip

    first = {"fidelity": [run("1P1D", (100, 200, 50, 1.0), (110, 200, 50, 1.0)),
                          run("colo2", (100, 400, 40, 2.0), (100, 400, 40, 2.0))]}  # fmt: skip
    second = {"fidelity": [run("1P1D", (125, 200, 50, 1.0), (100, 200, 50, 1.0)),
                           run("colo2", (100, 400, 50, 2.0), (100, 400, 50, 2.0))]}  # fmt: skip
    got = repeat_spread(first, second)
    assert got["first_predicts_second"] == pytest.approx(
        {
            "p50_ttft_ms": (25 / 125) / 2,
            "p90_ttft_ms": 0,
            "p50_tpot_ms": (10 / 50) / 2,
            "goodput": 0,
        }
    )
    assert got["second_predicts_first"]["p50_ttft_ms"] == pytest.approx((25 / 100) / 2)
    assert got["first_sim_on_second"]["p50_ttft_ms"] == pytest.approx((15 / 125) / 2)
    assert got["second_sim_on_first"]["p50_tpot_ms"] == pytest.approx((10 / 40) / 2)
    assert [r["run"] for r in got["runs"]] == ["1P1D_chat_1.0", "colo2_chat_1.0"]
    other = {"fidelity": [second["fidelity"][0], {**second["fidelity"][1], "requests": 21}]}
    with pytest.raises(ValueError, match="not a repeat: colo2_chat_1.0"):
        repeat_spread(first, other)


def test_a_stored_report_that_cannot_be_used_is_named_in_the_error(tmp_path):
    from pdserve.bench.fidelity.fidelity_replay import load_report

    (tmp_path / "text.json").write_text("not json")
    (tmp_path / "profile.json").write_text('{"decode": {}}')
    (tmp_path / "ok.json").write_text('{"fidelity": []}')
    for name, says in (("missing.json", "cannot read"), ("text.json", "is not JSON"),
                       ("profile.json", "is not a fidelity report")):  # fmt: skip
        with pytest.raises(ValueError, match=name) as e:
            load_report(tmp_path / name)
        assert says in str(e.value)
    assert load_report(tmp_path / "ok.json") == {"fidelity": []}


def test_sampling_cost_measures_more_for_a_temperature_than_greedy(make_engine, tmp_path):
    from pdserve.planner.measure import measure_sample_cost
    from tests.conftest import tiny_llama_dir

    path, _ = tiny_llama_dir(tmp_path, vocab=4096)
    # A temperature row sorts the vocabulary and draws noise; a greedy one takes an argmax.
    assert 0 < measure_sample_cost(make_engine(path), batch=4, reps=3) < 0.1


@pytest.mark.slow
@needs_embedded
def test_router_cpu_is_measured_per_request_and_per_token():
    from pdserve.bench.fidelity.measure_router import measure_router_cpu
    from pdserve.planner.measure import engine_dir

    cpu = measure_router_cpu(str(engine_dir("embedded")), requests=24, tokens=32)
    # Per request: a tokenize, the chat template, a reservation, a prefill call; per token a
    # gRPC receive, a detokenize and an SSE line: tens of microseconds at the least.
    assert cpu.per_request_s > cpu.per_token_s > 1e-5
    assert 0 < cpu.worker_per_token_s < cpu.per_request_s


def test_a_real_runs_requests_replay_at_the_seeded_schedules_send_offsets():
    from pdserve.bench.fidelity.fidelity_replay import sent_requests
    from pdserve.bench.loadgen.serve import poisson_schedule
    from pdserve.metrics import SLO, RequestRecord, compute_result

    records = [
        RequestRecord(0.0, 1.0, [0.1, 0.2], prompt_tokens=p, success=True) for p in (7, 11, 13)
    ]
    got = sent_requests(compute_result(records, 1.0, SLO()), 2.0, 3, 3)
    assert [r.arrival_s for r in got] == pytest.approx(poisson_schedule(3, 2.0, 3).tolist())
    assert [(r.prompt_tokens, r.output_tokens) for r in got] == [(7, 2), (11, 2), (13, 2)]


def test_a_failed_request_leaves_the_later_requests_at_their_own_send_offsets():
    from pdserve.bench.fidelity.fidelity_replay import per_request, sent_requests
    from pdserve.bench.loadgen.serve import poisson_schedule
    from pdserve.metrics import SLO, RequestRecord, compute_result

    records = [
        RequestRecord(0.0, 1.0, [0.1, 0.2], prompt_tokens=7, success=True),
        RequestRecord(0.0, error="HTTP 503: overloaded"),
        RequestRecord(0.0, 0.5, [0.5], prompt_tokens=13, success=True),
        RequestRecord(0.0, 2.0, [0.2, 1.1, 2.0], prompt_tokens=17, success=True),
    ]
    res = compute_result(records, 2.0, SLO())
    got = sent_requests(res, 2.0, 3, 4)
    offsets = poisson_schedule(4, 2.0, 3).tolist()
    assert [r.arrival_s for r in got] == pytest.approx([offsets[0], offsets[2], offsets[3]])
    assert [r.prompt_tokens for r in got] == [7, 13, 17]
    rows = per_request(res)
    # One TPOT per completed request, None for the one-token answer, lined up with the lengths.
    assert rows["tpot_s"] == pytest.approx([0.9, None, 0.9])
    assert rows["sent_index"] == [0, 2, 3]


def test_the_live_prefill_worker_runs_the_threads_of_the_profile_it_is_compared_with(
    monkeypatch,
):
    """The live pair's prefill worker and the bare engine both run the profile's threads, not
    this process's count: measured with every core against a one-thread table, the live worker
    read 0.73x the bare engine's time, and the plan's prefill ran a third too fast."""
    import torch

    import engine.llm_engine
    from pdserve.bench.fidelity import measure_live
    from pdserve.bench.fidelity.cpu_costs import live_prefill_slowdown
    from pdserve.planner import measure

    asked = []

    def live(cfg, threads, **_):
        asked.append(threads)
        return {64: 0.2}

    class Timer:
        def __init__(self, engine, grid):
            pass

        def prefill(self, n, offset):
            return 0.1

    monkeypatch.setattr(measure_live, "live_prefill_seconds", live)
    monkeypatch.setattr(engine.llm_engine, "build_engine", lambda settings: None)
    monkeypatch.setattr(measure, "WorkerTimer", Timer)
    profile = toy_profile(EngineSettings(threads=1))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        slowdown, pairs = live_prefill_slowdown(None, profile)
    finally:
        torch.set_num_threads(before)
    assert asked == [1]
    assert slowdown == pytest.approx(2.0) and pairs == {64: {"live_s": 0.2, "bare_s": 0.1}}
