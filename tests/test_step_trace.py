"""Step traces (engine/step_trace.py) and pricing them against a profile
(pdserve/planner/step_residuals.py)."""

from __future__ import annotations

import json

import pytest

from engine.step_trace import ENV_VAR, PlanShape, read_trace
from pdserve.planner.profile import Profile, Table2D
from pdserve.planner.step_residuals import overlap_share, priced_steps, summarise
from protos import pdserve_pb2 as pb
from tests.conftest import tiny_llama_dir


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("trace"), seed=3)
    return path


def test_a_worker_with_the_variable_set_records_each_steps_shape(
    tiny_path, make_engine, tmp_path, monkeypatch
):
    from decode_worker.worker import DecodeWorker

    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    worker = DecodeWorker(make_engine(tiny_path, block_size=16, num_blocks=64))
    prompt = [5, 6, 7, 8, 9]
    params = pb.SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    worker.submit_local("a", prompt, [], params)
    while worker.step_loop.step():
        pass
    worker.step_loop.trace.close()
    steps = read_trace(tmp_path / f"{worker.worker_id}.jsonl")
    shapes = [PlanShape(**{k: s[k] for k in PlanShape.__dataclass_fields__}) for s in steps]
    # The prompt in one step (sampled: it reaches the prompt's end), then one decode row a step
    # over a context that grows by one token.
    assert shapes == [
        PlanShape(prompt_tokens=5, sampled=1),
        PlanShape(decode_rows=1, decode_context=6, sampled=1),
        PlanShape(decode_rows=1, decode_context=7, sampled=1),
    ]
    assert all(s["s"] > 0 for s in steps) and steps[0]["t"] <= steps[1]["t"] <= steps[2]["t"]
    assert worker.blocks.num_free == worker.blocks.num_total


def test_without_the_variable_nothing_is_traced(tiny_path, make_engine, monkeypatch):
    from decode_worker.worker import DecodeWorker

    monkeypatch.delenv(ENV_VAR, raising=False)
    worker = DecodeWorker(make_engine(tiny_path, block_size=16, num_blocks=64))
    assert worker.step_loop.trace is None


def test_overlap_share_is_the_union_of_the_other_workers_steps():
    others = [([0.0, 2.0], [1.0, 3.0]), ([0.5], [2.5])]  # [0,1) [2,3) and [0.5,2.5)
    assert overlap_share(0.0, 4.0, others) == pytest.approx(3.0 / 4.0)
    assert overlap_share(3.0, 4.0, others) == 0.0
    assert overlap_share(1.0, 2.0, others) == pytest.approx(1.0)


def flat_profile(decode_s: float, prefill_s: float) -> Profile:
    return Profile(
        prefill=Table2D((1.0, 512.0), (0.0, 64.0), ((prefill_s,) * 2,) * 2),
        decode=Table2D((1.0, 32.0), (16.0, 1024.0), ((decode_s,) * 2,) * 2),
        transfer_bytes=(1.0,),
        transfer_seconds=(0.0,),
        router_overhead_s=0.0,
        kv_bytes_per_token=1,
        num_layers=1,
    )


def test_each_step_is_priced_as_the_simulator_prices_it_and_summarised_by_kind(tmp_path):
    prof = flat_profile(decode_s=0.010, prefill_s=0.100)
    line = {"decode_rows": 0, "decode_context": 0, "prompt_tokens": 0, "prompt_work": 0}
    a = [  # worker a: two decode steps, one alone (1.5x its price), one beside b's prefill
        {**line, "t": 0.0, "s": 0.015, "decode_rows": 2, "decode_context": 40, "sampled": 0},
        {**line, "t": 1.0, "s": 0.020, "decode_rows": 2, "decode_context": 42, "sampled": 0},
    ]
    b = [{**line, "t": 0.9, "s": 0.2, "prompt_tokens": 100, "sampled": 1}]
    for name, steps in (("a", a), ("b", b)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    rows = priced_steps(prof, {"a": read_trace(tmp_path / "a.jsonl"), "b": b})
    assert [r["priced_s"] for r in rows] == pytest.approx([0.010, 0.010, 0.100])
    cells = summarise(rows)
    assert cells["decode/alone"]["median_ratio"] == pytest.approx(1.5)
    assert cells["decode/co-run"]["median_ratio"] == pytest.approx(2.0)
    assert cells["decode/all"]["time_ratio"] == pytest.approx(0.035 / 0.020)
    assert cells["prefill/part"]["steps"] == 1  # a runs beside it for 0.02 s of its 0.2


def test_the_co_run_factors_are_the_co_running_steps_measured_over_priced_seconds():
    from pdserve.planner.step_residuals import co_run_factors

    cells = {
        "decode/co-run": {"steps": 2, "time_ratio": 1.25, "real_s": 5.0, "priced_s": 4.0},
        "decode/alone": {"steps": 9, "time_ratio": 1.0, "real_s": 9.0, "priced_s": 9.0},
        "prefill/co-run": {"steps": 1, "time_ratio": 1.5, "real_s": 3.0, "priced_s": 2.0},
        "mixed/co-run": {"steps": 1, "time_ratio": 1.0, "real_s": 1.0, "priced_s": 1.0},
    }
    decode, prefill = co_run_factors(cells)
    assert decode == pytest.approx(1.25)
    assert prefill == pytest.approx(4.0 / 3.0)  # 4 s measured over 2 + 1 s priced
    assert co_run_factors({}) == (1.0, 1.0)  # no co-running step: no slowdown
