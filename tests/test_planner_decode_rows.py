"""The decode table's live factor per batch size (Profile.decode_row_factors), fitted from the
alone decode steps of live step traces (step_residuals.decode_row_factors, stored_runs.pooled_costs)."""

from __future__ import annotations

import json

import pytest

from engine.step_trace import PlanShape
from pdserve.bench.fidelity.step_residuals import decode_row_factors
from pdserve.bench.fidelity.stored_runs import pooled_costs
from pdserve.planner.profile import Profile, Table2D

BATCHES = (1.0, 2.0, 4.0, 8.0)


def table_profile() -> Profile:
    """Decode 10 ms + 1 ms a row at any context; prefill 100 ms."""
    decode = tuple((0.010 + 0.001 * b,) * 2 for b in BATCHES)
    return Profile(
        prefill=Table2D((1.0, 512.0), (0.0, 64.0), ((0.1,) * 2,) * 2),
        decode=Table2D(BATCHES, (16.0, 1024.0), decode),
        transfer_bytes=(1.0,),
        transfer_seconds=(0.0,),
        router_overhead_s=0.0,
        kv_bytes_per_token=1,
        num_layers=1,
    )


def row(rows: int, ratio: float, co_run: float = 0.0, worker: str = "decode-a", kind="decode"):
    priced = 0.010 + 0.001 * rows
    return {"worker": worker, "kind": kind, "rows": rows, "co_run": co_run,
            "priced_s": priced, "real_s": ratio * priced}  # fmt: skip


def test_each_table_row_reads_its_alone_steps_real_over_priced():
    """Alone decode steps: 0.9x their price at one row, 1.2x at four. Batch 3 lies halfway
    between the table's 2 and 4 and counts half toward each; batch 2 has only that half-weight,
    so it is interpolated between batches 1 and 4, and batch 8, with nothing, takes batch 4's. Steps beside a busy
    worker, prompt steps and a prefill worker's steps are not read."""
    rows = [row(1, 0.9) for _ in range(40)]
    rows += [row(4, 1.2) for _ in range(40)]
    rows += [row(3, 1.2) for _ in range(20)]
    rows += [row(1, 3.0, co_run=1.0) for _ in range(40)]
    rows += [row(1, 3.0, worker="prefill-b") for _ in range(40)]
    rows += [row(4, 3.0, kind="mixed") for _ in range(40)]
    factors = decode_row_factors(rows, BATCHES)
    assert factors == pytest.approx((0.9, 1.0, 1.2, 1.2))
    assert decode_row_factors([row(1, 3.0, co_run=1.0)] * 40, BATCHES) == ()


def test_the_profile_charges_the_factor_on_decode_only_steps_between_and_past_the_rows():
    prof = table_profile().with_cpu(decode_row_factors=(0.9, 1.0, 1.2, 1.4))
    base = table_profile()

    def shape(rows: int, prompt: int = 0) -> PlanShape:
        return PlanShape(decode_rows=rows, decode_context=64 * rows, prompt_tokens=prompt)

    for rows, factor in ((1, 0.9), (3, 1.1), (8, 1.4), (20, 1.4)):
        assert prof.shape_seconds(shape(rows)) == pytest.approx(
            factor * base.shape_seconds(shape(rows))
        )
    mixed = shape(2, prompt=30)  # a prompt step's price is the prefill table's
    assert prof.shape_seconds(mixed) == base.shape_seconds(mixed)
    assert prof.decode_seconds(4, 64) == base.decode_seconds(4, 64)  # the bare table, probed


def test_the_factors_survive_the_file_and_a_wrong_count_is_refused():
    prof = table_profile().with_cpu(decode_row_factors=(0.9, 1.0, 1.2, 1.4))
    again = Profile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert again.cpu.decode_row_factors == (0.9, 1.0, 1.2, 1.4)
    assert Profile.from_dict(table_profile().to_dict()).cpu.decode_row_factors == ()
    bad = {**prof.to_dict(), "decode_row_factors": [1.0, 1.1]}
    with pytest.raises(ValueError, match="decode_row_factors"):
        Profile.from_dict(bad)


def _trace(folder, name: str, steps: list[tuple[float, float, int]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    lines = [
        {"t": t, "s": s, "decode_rows": n, "decode_context": 64 * n, "prompt_tokens": 0,
         "prompt_work": 0, "sampled": 0}
        for t, s, n in steps
    ]  # fmt: skip
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_pooled_costs_fit_the_factors_before_the_roles_and_refit_them_from_scratch(tmp_path):
    """A live decode worker alone: one-row steps at 0.9x the table, four-row steps at 1.2x.
    The pooled fit reads those factors and, on prices carrying them, the decode worker's
    alone slowdown 1. Calibrating again from a profile that already has factors gives the same
    factors, not their square."""
    prof = table_profile()
    steps = [(0.1 * i, 0.9 * 0.011, 1) for i in range(40)]
    steps += [(10 + 0.1 * i, 1.2 * 0.014, 4) for i in range(40)]
    _trace(tmp_path / "run", "decode-a", steps)
    costs = pooled_costs(prof, [(tmp_path / "run", 1.0, 1.0)], cores=2)
    assert costs["decode_row_factors"] == pytest.approx((0.9, 1.0, 1.2, 1.2))
    assert costs["decode_worker_slowdown"] == pytest.approx(1.0)
    fitted = prof.with_cpu(decode_row_factors=costs["decode_row_factors"])
    again = pooled_costs(fitted, [(tmp_path / "run", 1.0, 1.0)], cores=2)
    assert again["decode_row_factors"] == pytest.approx(costs["decode_row_factors"])


def test_a_decode_steps_co_run_fit_may_slope_under_1_and_a_prompt_steps_may_not():
    """Beside a busy neighbour, decode steps ran 0.9 x (price + 6 ms): the fit reads it back.
    Prompt steps of the same shape keep the slope at 1, the excess per step."""
    from pdserve.bench.fidelity.step_residuals import DECODE_SLOPE_FLOOR, co_run_affine

    prices = (0.02, 0.04, 0.08)
    rows = [{"kind": "decode", "co_run": 1.0, "beside_prefill": 1.0, "priced_s": p,
             "real_s": 0.9 * (p + 0.006)} for p in prices]  # fmt: skip
    rows += [{"kind": "prefill", "co_run": 1.0, "beside_prefill": 0.0, "priced_s": p,
              "real_s": 0.9 * (p + 0.006)} for p in prices]  # fmt: skip
    fit = co_run_affine(rows)
    assert DECODE_SLOPE_FLOOR < 0.9
    assert fit["decode"] == pytest.approx((0.9, 0.006))
    excess = sum(0.9 * (p + 0.006) - p for p in prices) / len(prices)
    assert fit["prefill"] == pytest.approx((1.0, excess))
