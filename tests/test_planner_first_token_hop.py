"""The disaggregated first token's path, read from a live run's sends, TTFTs and prefill-worker
steps (pdserve/planner/first_token_hop.py), and charged by the simulator."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pdserve.bench.fidelity.first_token_hop import hop_beyond_router, request_hops
from pdserve.planner.sim import Split, simulate
from pdserve.planner.workload import TraceRequest
from tests.test_planner_sim import toy_profile

WALL = 1_796_000_000.0  # the workers' wall clock at send offset 0


def _run(sends, prompts, pre=0.004, post=0.006, step_s=0.100):
    """Each request's prompt step starts ``pre`` after its send and takes ``step_s``; its
    first token comes ``post`` after the step ends."""
    steps = [(WALL + s + pre, step_s, p) for s, p in zip(sends, prompts, strict=True)]
    ttfts = [pre + step_s + post] * len(sends)
    return steps, ttfts


def test_each_clean_requests_ttft_less_its_prompt_step_is_the_path():
    sends, prompts = [0.0, 0.7, 1.9, 3.2, 4.0], [40, 52, 38, 45, 50]
    steps, ttfts = _run(sends, prompts)
    hops = request_hops(sends, ttfts, prompts, steps)
    assert hops == pytest.approx([0.010] * 5)


def test_a_request_that_waited_joined_another_or_was_chunked_does_not_count():
    sends, prompts = [0.0, 0.05, 1.0, 2.0, 3.0, 4.0], [40, 40, 600, 40, 40, 40]
    steps, ttfts = _run(sends, prompts)
    # Request 1 came while request 0's step ran (the worker was busy): its own step later.
    steps[1] = (WALL + 0.104 + 0.001, 0.100, 40)
    ttfts[1] = 0.105 + 0.100 + 0.006 - 0.05
    # Request 2's 600 tokens ran in two chunks: the first step computed 512 of them.
    steps[2] = (WALL + 1.004, 0.100, 512)
    steps.insert(3, (WALL + 1.104, 0.030, 88))
    ttfts[2] = 0.004 + 0.130 + 0.006
    hops = request_hops(sends, ttfts, prompts, sorted(steps))
    assert hops == pytest.approx([0.010] * 4)  # requests 0, 3, 4, 5


def test_the_path_beyond_the_router_is_the_median_less_its_overhead_and_never_below_0():
    assert hop_beyond_router([0.008, 0.010, 0.030], 0.004) == pytest.approx(0.006)
    assert hop_beyond_router([0.002, 0.003], 0.004) == 0.0
    assert hop_beyond_router([], 0.004) == 0.0


def test_a_disaggregated_first_token_takes_the_path_and_a_colocated_one_does_not():
    prof = toy_profile(router_s=0.004).with_cpu(disaggregated_hop_s=0.007)
    n = 300
    router, prefill = prof.router_overhead_s, prof.prefill_seconds(n, 0)
    [disagg] = simulate(prof, [TraceRequest(0.0, n, 1)], Split(1, 1)).result.ttfts
    assert disagg == pytest.approx(router + prefill + 0.007)
    [colocated] = simulate(prof, [TraceRequest(0.0, n, 1)], Split(0, 1)).result.ttfts
    assert colocated == pytest.approx(router + prefill)


def test_the_path_round_trips_through_the_profile_file_and_older_files_read_0(tmp_path):
    from pdserve.planner.profile import load_profile

    prof = toy_profile(router_s=0.004).with_cpu(disaggregated_hop_s=0.007)
    prof.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").cpu.disaggregated_hop_s == 0.007
    d = json.loads((tmp_path / "p.json").read_text())
    del d["disaggregated_hop_s"]
    (tmp_path / "old.json").write_text(json.dumps(d))
    assert load_profile(tmp_path / "old.json").cpu.disaggregated_hop_s == 0.0


def _stored_run(tmp_path, name: str, hop_s: float, rate: float = 0.5):
    """A stored 1P1D chat run of 6 requests whose first tokens each took ``hop_s`` beyond
    their prompt step, with its prefill worker's step trace."""
    from pdserve.bench.fidelity.fidelity_replay import rebuild_requests
    from tests.test_planner_cpu_costs import _TemplateTokenizer

    reqs = rebuild_requests("chat", 6, rate, 0, _TemplateTokenizer())
    pre, step_s = 0.003, 0.100
    real = {
        "ttft_s": [hop_s + step_s] * len(reqs),
        "prompt_tokens": [r.prompt_tokens for r in reqs],
        "output_tokens": [r.output_tokens for r in reqs],
        "sent_index": list(range(len(reqs))),
    }
    row = {"split": "1P1D", "workload": "chat", "rate": rate, "requests": len(reqs)}
    row["per_request"] = {"real": real}
    folder = tmp_path / name / f"1P1D_chat_{rate}"
    folder.mkdir(parents=True)
    line = {"decode_rows": 0, "decode_context": 0, "prompt_work": 0, "sampled": 1}
    steps = [
        {**line, "t": WALL + r.arrival_s + pre, "s": step_s, "prompt_tokens": r.prompt_tokens}
        for r in reqs
    ]
    (folder / "prefill-0.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"seed": 0, "fidelity": [row]}))
    return {"seed": 0, "fidelity": [row]}, path, tmp_path / name


def test_a_stored_run_is_scored_on_the_path_the_other_runs_took(tmp_path):
    from pdserve.bench.fidelity.stored_runs import leave_one_out, pooled_profile
    from tests.test_planner_cpu_costs import _TemplateTokenizer
    from tests.test_step_trace import flat_profile

    tok = _TemplateTokenizer()
    prof = dataclasses.replace(
        flat_profile(decode_s=0.010, prefill_s=0.100), router_overhead_s=0.004
    )
    _, a_path, a_traces = _stored_run(tmp_path, "a", hop_s=0.013)
    b, b_path, b_traces = _stored_run(tmp_path, "b", hop_s=0.030)
    costs = leave_one_out(b, prof, b_traces, 2, [(str(a_path), str(a_traces))], tok)
    assert costs["1P1D_chat_0.5"]["disaggregated_hop_s"] == pytest.approx(0.013 - 0.004)
    assert "disaggregated_hop_s" not in leave_one_out(b, prof, b_traces, 2)["1P1D_chat_0.5"]
    sources = [(str(a_path), str(a_traces)), (str(b_path), str(b_traces))]
    pooled, _ = pooled_profile(prof, sources, 2, tok)
    # Six requests each way: the median of the twelve is halfway between the two paths.
    assert pooled.cpu.disaggregated_hop_s == pytest.approx((0.013 + 0.030) / 2 - 0.004)
