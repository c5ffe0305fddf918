"""Step traces (engine/step_trace.py) and pricing them against a profile
(pdserve/planner/step_residuals.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.step_trace import ENV_VAR, PlanShape, read_trace
from pdserve.bench.fidelity.step_residuals import overlap_share, priced_steps, summarise
from pdserve.planner.profile import Profile, Table2D
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


def test_the_co_run_fit_recovers_a_factor_and_a_per_step_cost():
    """Steps that cost 1.2 x (price + 5 ms) beside a busy neighbour give back (1.2, 5 ms); the
    steps run alone or only partly beside one are not fitted."""
    from pdserve.bench.fidelity.step_residuals import co_run_affine

    rows = [
        {"kind": k, "co_run": 1.0, "priced_s": p, "real_s": 1.2 * (p + 0.005)}
        for k, p in (("prefill", 0.05), ("mixed", 0.2), ("prefill", 0.8))
    ]
    rows += [{"kind": "decode", "co_run": 0.95, "priced_s": p, "real_s": 1.3 * p}
             for p in (0.01, 0.02, 0.04)]  # fmt: skip
    rows += [{"kind": "prefill", "co_run": c, "priced_s": 0.1, "real_s": 9.0} for c in (0, 0.5)]
    fit = co_run_affine(rows)
    assert fit["prefill"] == pytest.approx((1.2, 0.005))
    assert fit["decode"] == pytest.approx((1.3, 0.0), abs=1e-9)


def test_the_co_run_fit_keeps_the_factor_at_least_1_and_the_per_step_cost_at_least_0():
    from pdserve.bench.fidelity.step_residuals import affine_fit

    priced = np.array([0.1, 0.2, 0.4])
    # Faster than priced on long steps: slope < 1 -> slope 1, the mean excess per step.
    a, c = affine_fit(priced * 0.5 + 0.2, priced)
    assert a == 1.0 and c == pytest.approx(float(np.mean(priced * 0.5 + 0.2 - priced)))
    # Intercept < 0 -> none, the least-squares factor through the origin.
    a, c = affine_fit(1.5 * priced - 0.01, priced)
    assert c == 0.0 and a == pytest.approx(
        float((1.5 * priced - 0.01) @ priced / (priced @ priced))
    )
    assert affine_fit(np.array([0.3]), np.array([0.2])) == (pytest.approx(1.5), 0.0)


def test_the_calibration_takes_each_roles_alone_slowdown_then_the_co_run_cost_on_top():
    """Decode steps alone run 1.1 x price, and beside a busy prefill 1.1 x 1.3 x price: the
    decode worker's slowdown 1.1, the co-run factor 1.3 over it; the prefill worker's steps
    alone 1.05 x, beside decodes 1.05 x 1.2 x (price + 10 ms)."""
    from pdserve.bench.fidelity.step_residuals import calibrated_costs

    def row(worker, kind, co_run, priced, real):
        return {"worker": worker, "kind": kind, "co_run": co_run, "priced_s": priced,
                "real_s": real}  # fmt: skip

    rows = [row("decode-a", "decode", 0.0, p, 1.1 * p) for p in (0.01, 0.03)]
    rows += [row("decode-a", "decode", 1.0, p, 1.1 * 1.3 * p) for p in (0.01, 0.02, 0.04)]
    rows += [row("prefill-b", "prefill", 0.0, p, 1.05 * p) for p in (0.1, 0.5)]
    rows += [row("prefill-b", "prefill", 1.0, p, 1.05 * 1.2 * (p + 0.01)) for p in (0.1, 0.3, 0.6)]
    costs = calibrated_costs(rows)
    assert costs["decode_worker_slowdown"] == pytest.approx(1.1)
    assert costs["prefill_worker_slowdown"] == pytest.approx(1.05)
    assert costs["co_run_slowdown"] == pytest.approx(1.3)
    assert costs["co_run_fixed_s"] == pytest.approx(0.0, abs=1e-9)
    assert costs["co_run_slowdown_prefill"] == pytest.approx(1.2)
    assert costs["co_run_fixed_s_prefill"] == pytest.approx(0.01 * 1.05)  # seconds alone


def _decode_trace(folder, ratio: float, price_s: float = 0.010):
    """A decode worker's trace of three decode steps alone, each ``ratio`` x its flat price."""
    folder.mkdir(parents=True)
    line = {"decode_rows": 2, "decode_context": 40, "prompt_tokens": 0, "prompt_work": 0}
    steps = [{**line, "t": float(i), "s": ratio * price_s, "sampled": 0} for i in range(3)]
    (folder / "decode-0.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    return folder


def test_leave_one_out_calibrates_each_run_on_the_other_runs_steps_at_their_speeds(tmp_path):
    """Run x's decode steps ran 2x their price, y's and z's 1.5x, but z's probe found the
    machine 1.5x slow then: each run's costs come from the others alone, each of those read
    against its own speed."""
    from pdserve.bench.fidelity.stored_runs import leave_one_out_costs

    prof = flat_profile(decode_s=0.010, prefill_s=0.100)
    runs = {
        "x": (_decode_trace(tmp_path / "x", 2.0), 1.0, 1.0),
        "y": (_decode_trace(tmp_path / "y", 1.5), 1.0, 1.0),
        "z": (_decode_trace(tmp_path / "z", 1.5), 1.5, 1.0),  # 1x at its probed speed
    }
    costs = leave_one_out_costs(prof, runs)
    # x: y's 1.5x over 0.03 priced s and z's 1x over 0.045 -> (0.045 + 0.045) / 0.075.
    assert costs["x"]["decode_worker_slowdown"] == pytest.approx(0.09 / 0.075)
    assert costs["y"]["decode_worker_slowdown"] == pytest.approx((0.06 + 0.045) / 0.075)
    assert costs["z"]["decode_worker_slowdown"] == pytest.approx((0.06 + 0.045) / 0.06)
    assert all(c["prefill_worker_slowdown"] == 1.0 for c in costs.values())  # no prefill steps


def test_a_run_is_resimulated_on_its_own_leave_one_out_costs():
    from pdserve.bench.fidelity.fidelity_replay import resimulate
    from pdserve.metrics import SLO
    from tests.test_planner_cpu_costs import _Tokenizer, toy_profile

    real = {"p50_ttft_ms": 100.0, "p90_ttft_ms": 200.0, "p50_tpot_ms": 50.0, "goodput": 1.0}
    row = {"split": "1P1D", "workload": "chat", "rate": 1.0, "requests": 20, "real": real}
    report = {"cpu_cores": 2, "fidelity": [row]}
    slos, prof = {"chat": SLO(2.0, 0.2)}, toy_profile()
    slow = {"1P1D_chat_1.0": {"decode_worker_slowdown": 2.0}}
    got = resimulate(report, prof, slos, _Tokenizer(), costs=slow)["fidelity"][0]
    plain = resimulate(report, prof, slos, _Tokenizer())["fidelity"][0]
    assert got["costs"] == {"decode_worker_slowdown": 2.0}
    assert got["sim"]["p50_tpot_ms"] > 1.5 * plain["sim"]["p50_tpot_ms"]


def test_busy_others_counts_each_other_worker_for_the_part_of_the_step_it_computed():
    from pdserve.bench.fidelity.step_residuals import busy_others

    others = [([0.0], [4.0]), ([1.0, 3.0], [2.0, 4.0])]  # one busy throughout, one half
    assert busy_others(0.0, 4.0, others) == pytest.approx(1.5)
    assert busy_others(1.0, 2.0, others) == pytest.approx(2.0)
    assert busy_others(5.0, 6.0, others) == 0.0


def _row(kind, priced, real, busy=1.0, beside_prefill=0.0, worker="decode-a"):
    return {"worker": worker, "kind": kind, "co_run": 1.0, "priced_s": priced, "real_s": real,
            "busy_others": busy, "beside_prefill": beside_prefill}  # fmt: skip


def test_the_cores_share_is_taken_off_before_the_fit_and_each_pair_of_kinds_fits_its_own():
    """On 2 cores: decode steps beside a prompt step ran 1.1x their price; beside another
    decode worker only, 1.25x (the memory bandwidth both are bound by); with two others busy,
    1.5 (the fair share the simulator applies itself) x 1.25x. The fit reads 1.1 for
    decode-beside-prefill, 1.25 for decode-beside-decode, and the oversubscribed steps are
    not counted twice."""
    from pdserve.bench.fidelity.step_residuals import calibrated_costs

    prices = (0.01, 0.02, 0.04)
    rows = [_row("decode", p, 1.1 * p, beside_prefill=1.0) for p in prices]
    rows += [_row("decode", p, 1.25 * p) for p in prices]
    rows += [_row("decode", p, 1.5 * 1.25 * p, busy=2.0) for p in prices]
    costs = calibrated_costs(rows, cores=2)
    assert costs["co_run_slowdown"] == pytest.approx(1.1)
    assert costs["co_run_slowdown_decode_pair"] == pytest.approx(1.25)
    assert "co_run_slowdown_prefill_pair" not in costs  # no prompt step beside a prompt step
    # Without the cores, the oversubscribed steps read as a larger pair factor.
    assert calibrated_costs(rows)["co_run_slowdown_decode_pair"] > 1.4


def test_the_decode_pair_fits_as_fixed_work_where_it_costs_the_same_at_every_batch():
    """Decode steps beside another decode worker ran their price + 6 ms at every size (Zen 4:
    1.29x at one row, 1.10x at eight): the pair reads factor 1 and 6 ms of fixed work, not one
    factor that overcharges the large batches."""
    from pdserve.bench.fidelity.step_residuals import calibrated_costs

    rows = [_row("decode", p, p + 0.006) for p in (0.02, 0.03, 0.045, 0.06)]
    costs = calibrated_costs(rows, cores=2)
    assert costs["co_run_slowdown_decode_pair"] == pytest.approx(1.0)
    assert costs["co_run_fixed_s_decode_pair"] == pytest.approx(0.006)


@pytest.mark.parametrize("weight", [0.5, 0.8, 1.0])
def test_the_prefill_weight_fitted_makes_the_simulators_share_what_the_prompt_steps_lost(weight):
    """Prompt steps beside two decoding workers on 2 cores ran ``CpuShare.shares``' slowdown
    at ``weight`` x their co-run cost: the fit gives ``weight`` back."""
    from pdserve.bench.fidelity.step_residuals import prefill_share_weight
    from pdserve.planner.cpu_share import CpuShare

    share = CpuShare(cores=2, weights={"prefill": weight})
    slowdown = share.shares(["prefill", "decode", "decode"], False)[0][0]
    factor, fixed = 1.05, 0.03
    rows = [
        _row("prefill", p, slowdown * factor * (p + fixed), busy=2.0, worker="prefill-b")
        for p in (0.06, 0.1, 0.5)
    ]
    assert prefill_share_weight(rows, 2, factor, fixed) == pytest.approx(weight)
    assert prefill_share_weight(rows, None, factor, fixed) is None  # no shared cores


def test_stored_runs_find_each_runs_traces_and_speed_and_pool_them_into_a_profile(tmp_path):
    """A stored fidelity JSON's runs map to their trace folders (by run name) and probed
    speeds; a run whose folder holds no trace is named; the pooled profile carries the costs
    fitted on all of them (here: decode steps 1.5x their price -> decode_worker_slowdown 1.5)."""
    from pdserve.bench.fidelity.stored_runs import pooled_profile, traced_runs

    rows = [
        {"split": "1P1D", "workload": "chat", "rate": r, "speed": {"used": sp}}
        for r, sp in ((0.5, {"decode": 1.0, "prefill": 1.0, "prefill_small": 1.2}), (1.0, None))
    ]
    stored = tmp_path / "fidelity.json"
    stored.write_text(json.dumps({"fidelity": rows}))
    traces = tmp_path / "traces"
    _decode_trace(traces / "1P1D_chat_0.5", 1.5)
    with pytest.raises(FileNotFoundError, match="1P1D_chat_1.0"):
        traced_runs({"fidelity": rows}, traces)
    _decode_trace(traces / "1P1D_chat_1.0", 1.5)
    runs = traced_runs({"fidelity": rows}, traces)
    assert runs["1P1D_chat_0.5"] == (traces / "1P1D_chat_0.5", 1.0, 1.0, 1.2)
    assert runs["1P1D_chat_1.0"] == (traces / "1P1D_chat_1.0", 1.0, 1.0, None)  # no probe
    prof = flat_profile(decode_s=0.010, prefill_s=0.100)
    pooled, costs = pooled_profile(prof, [(str(stored), str(traces))], cores=2)
    assert costs["decode_worker_slowdown"] == pytest.approx(1.5)
    assert pooled.cpu.decode_worker_slowdown == pytest.approx(1.5)
    assert len(pooled.meta["co_run"]["runs"]) == 2


def test_leave_one_out_pools_earlier_sets_of_runs_and_scores_only_the_stored_ones(tmp_path):
    """Scoring set B's runs with set A's runs in the pool: each B run is fitted on the other B
    run and on every A run (never on itself), and A's runs are not scored."""
    from pdserve.bench.fidelity.stored_runs import leave_one_out

    def stored_set(name: str, ratios: dict[float, float]):
        rows = [{"split": "1P1D", "workload": "chat", "rate": r} for r in ratios]
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"fidelity": rows}))
        for rate, ratio in ratios.items():
            _decode_trace(tmp_path / name / f"1P1D_chat_{rate}", ratio)
        return {"fidelity": rows}, path, tmp_path / name

    prof = flat_profile(decode_s=0.010, prefill_s=0.100)
    _, a_path, a_traces = stored_set("a", {0.5: 3.0})
    b, _, b_traces = stored_set("b", {0.5: 1.0, 1.0: 2.0})
    alone = leave_one_out(b, prof, b_traces, cores=2)
    pooled = leave_one_out(b, prof, b_traces, cores=2, more=[(str(a_path), str(a_traces))])
    assert sorted(pooled) == ["1P1D_chat_0.5", "1P1D_chat_1.0"]
    assert alone["1P1D_chat_0.5"]["decode_worker_slowdown"] == pytest.approx(2.0)
    # B's 0.5 run: B's 1.0 run (2x) and A's run (3x), equal priced seconds -> 2.5x.
    assert pooled["1P1D_chat_0.5"]["decode_worker_slowdown"] == pytest.approx(2.5)
    assert pooled["1P1D_chat_1.0"]["decode_worker_slowdown"] == pytest.approx(2.0)


def test_a_prefill_workers_prompt_steps_and_a_colocated_workers_fit_their_own_fixed_work():
    """Beside decode steps, the prefill worker's prompt steps ran 1.1 x (price + 40 ms) (its
    KV frames stream out through its threads) and a decode worker's own prompt steps 1.1 x
    (price + 15 ms): each kind of worker gets its own fixed work back."""
    from pdserve.bench.fidelity.step_residuals import calibrated_costs

    rows = [_row(k, p, 1.1 * (p + 0.040), worker="prefill-a") for k, p in
            (("prefill", 0.05), ("mixed", 0.2), ("prefill", 0.6))]  # fmt: skip
    rows += [_row(k, p, 1.1 * (p + 0.015), worker="decode-b") for k, p in
             (("prefill", 0.08), ("mixed", 0.3), ("prefill", 0.5))]  # fmt: skip
    rows += [_row("decode", 0.03, 0.03, busy=0.0, worker="decode-b") for _ in range(3)]
    costs = calibrated_costs(rows, cores=2)
    assert costs["co_run_slowdown_prefill"] == pytest.approx(1.1)
    assert costs["co_run_fixed_s_prefill"] == pytest.approx(0.040)
    assert costs["co_run_fixed_s_local_prefill"] == pytest.approx(0.015)


def test_the_local_fixed_work_falls_back_round_trips_and_scales_with_speed():
    """A colocated (decode) worker's prompt step beside a busy neighbour pays
    co_run_fixed_s_local_prefill once, a prefill worker's the prefill figure; a profile
    without the local figure gives both the prefill one."""

    prof = flat_profile(decode_s=0.010, prefill_s=0.100).with_cpu(
        co_run_fixed_s_prefill=0.040,
        co_run_fixed_s_local_prefill=0.015,
    )
    assert prof.cpu.local_prefill_fixed_s == 0.015
    assert prof.with_cpu(co_run_fixed_s_local_prefill=None).cpu.local_prefill_fixed_s == 0.040
    again = Profile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert again.cpu.co_run_fixed_s_local_prefill == 0.015
    assert prof.at_speed(prefill=2.0).cpu.co_run_fixed_s_local_prefill == pytest.approx(0.030)


def test_the_runs_background_cpu_is_what_the_simulator_would_charge_over_its_span():
    """The router's CPU over a live run, as CpuShare.charge gets it: per request (a prompt
    finished: sampled past the decode rows) and per token (first and decoded), over the span."""

    from pdserve.bench.fidelity.step_residuals import background_share

    prof = flat_profile(0.01, 0.1).with_cpu(
        router_cpu_per_request_s=0.5,
        router_cpu_per_token_s=0.01,
        stream_cpu_per_token_s=0.02,
    )
    line = {"decode_context": 10, "prompt_tokens": 0, "prompt_work": 0}
    steps = {
        "prefill-x": [
            {**line, "t": 0.0, "s": 1.0, "decode_rows": 0, "prompt_tokens": 50, "sampled": 2}
        ],
        "decode-y": [
            {**line, "t": 5.0 + i, "s": 0.5, "decode_rows": 4, "sampled": 4} for i in range(5)
        ],
    }
    cpu = 2 * 0.5 + (2 + 20) * 0.03
    assert background_share(prof, steps) == pytest.approx(cpu / 9.5)
    rows = priced_steps(prof, steps)
    assert all(r["background"] == pytest.approx(cpu / 9.5) for r in rows)
    assert background_share(prof, {}) == 0.0


def test_the_background_share_is_taken_off_with_the_workers_before_the_fit():
    """On 2 cores, with the router busy 20% of the time: decode steps beside one decode
    neighbour ran 1.25 x (1 + 0.2 / 2) their price, 1.1 of it the simulator's own share of the
    cores with the router in (CpuShare charges that itself), so the pair fit reads 1.25."""
    from pdserve.bench.fidelity.step_residuals import calibrated_costs, unshared

    rows = [{**_row("decode", p, 1.25 * 1.1 * p), "background": 0.2} for p in (0.01, 0.02, 0.04)]
    assert [r["real_s"] for r in unshared(rows, 2)] == pytest.approx([0.0125, 0.025, 0.05])
    assert calibrated_costs(rows, cores=2)["co_run_slowdown_decode_pair"] == pytest.approx(1.25)
    alone = {**_row("decode", 0.01, 0.01, busy=0.0), "background": 0.2}
    assert unshared([alone], 2)[0]["real_s"] == pytest.approx(0.01)  # 1.2 threads fit 2 cores


def test_prompt_steps_beside_a_prompt_step_fit_their_own_factor_on_top_of_the_fixed_work():
    """On 2 cores, prompt steps beside decode steps only ran 1.1 x (price + 30 ms); a second
    prefill worker's prompt steps beside another prompt step ran 1.4 x (price + 30 ms): the
    pair reads 1.4, with the fixed work held, not folded into the factor."""
    from pdserve.bench.fidelity.step_residuals import calibrated_costs

    prices = (0.05, 0.1, 0.2)
    rows = [_row("prefill", p, 1.1 * (p + 0.03), worker="prefill-a") for p in prices]
    rows += [
        _row("prefill", p, 1.4 * (p + 0.03), beside_prefill=1.0, worker="prefill-b") for p in prices
    ]
    costs = calibrated_costs(rows, cores=2)
    assert costs["co_run_slowdown_prefill"] == pytest.approx(1.1)
    assert costs["co_run_fixed_s_prefill"] == pytest.approx(0.03)
    assert costs["co_run_slowdown_prefill_pair"] == pytest.approx(1.4)
