"""The decode costs the live step traces calibrate: the decode table's per-row scale and the
decode-beside-decode pair's fixed work (pdserve/planner/decode_rows.py, step_residuals.py,
cpu_share.py)."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.planner.decode_rows import decode_row_scale, row_scaled
from pdserve.planner.profile import Profile, Table2D, load_profile
from pdserve.planner.sim import SimCluster, SimConfig, Split
from pdserve.planner.step_residuals import calibrated_costs
from tests.test_planner_sim import _steps_on_shared_cores

GRID = (1.0, 2.0, 4.0, 8.0)


def _alone(rows: int, price: float, ratio: float, n: int = 30) -> list[dict]:
    """``n`` decode-only steps of a decode worker at ``rows`` rows, alone, ``ratio`` x price."""
    step = {"worker": "decode-a", "kind": "decode", "co_run": 0.0, "busy_others": 0.0,
            "beside_prefill": 0.0, "decode_rows": rows, "priced_s": price,
            "real_s": ratio * price}  # fmt: skip
    return [dict(step) for _ in range(n)]


def test_each_table_row_reads_the_steps_interpolated_from_it_and_empty_rows_the_nearest():
    """Steps at 1, 2 and 4 rows ran 0.9, 0.8 and 1.1x their price; 40 steps at 3 rows (1.0x)
    count half to row 2 and half to row 4; row 8 saw none and takes row 4's factor."""
    steps = _alone(1, 0.02, 0.9) + _alone(2, 0.03, 0.8) + _alone(4, 0.04, 1.1)
    steps += _alone(3, 0.035, 1.0, n=40)
    scale = decode_row_scale(steps, GRID)
    row2 = (30 * 0.8 * 0.03 + 20 * 0.035) / (30 * 0.03 + 20 * 0.035)
    row4 = (30 * 1.1 * 0.04 + 20 * 0.035) / (30 * 0.04 + 20 * 0.035)
    assert scale == pytest.approx((0.9, row2, row4, row4))
    # Steps on the table's rows, priced on the scaled rows, sum to what they really took.
    on_rows = _alone(1, 0.02, 0.9) + _alone(2, 0.03, 0.8) + _alone(4, 0.04, 1.1)
    fitted = decode_row_scale(on_rows, GRID)
    assert fitted == pytest.approx((0.9, 0.8, 1.1, 1.1))
    assert decode_row_scale(row_scaled(on_rows, GRID, fitted), GRID) == pytest.approx((1.0,) * 4)


def test_too_few_steps_fit_no_row():
    assert decode_row_scale(_alone(2, 0.03, 0.8, n=19), GRID) is None
    assert decode_row_scale([], GRID) is None


def _profile(**kw) -> Profile:
    decode = ((0.02, 0.03), (0.04, 0.05), (0.05, 0.06))
    return Profile(
        prefill=Table2D((1.0, 512.0), (0.0, 64.0), ((0.1, 0.1), (0.2, 0.2))),
        decode=Table2D((1.0, 2.0, 4.0), (16.0, 1024.0), decode),
        transfer_bytes=(1.0,),
        transfer_seconds=(0.0,),
        router_overhead_s=0.0,
        kv_bytes_per_token=1,
        num_layers=1,
        **kw,
    )


def test_the_profile_prices_decode_steps_on_the_scaled_table_never_faster_with_more_rows(
    tmp_path,
):
    """Row 2 (0.04 s) halved falls under row 1 (0.02 x 1.5 = 0.03): the running maximum holds
    it at row 1's price; row 4 doubles. The scale round-trips and survives a speed change."""
    prof = _profile(decode_row_scale=(1.5, 0.5, 2.0))
    assert prof.decode_seconds(1, 16) == pytest.approx(0.03)
    assert prof.decode_seconds(2, 16) == pytest.approx(0.03)  # 0.02 scaled, lifted to row 1's
    assert prof.decode_seconds(4, 1024) == pytest.approx(0.12)
    assert _profile().decode_seconds(4, 1024) == pytest.approx(0.06)  # no scale: the table
    prof.save(tmp_path / "p.json")
    back = load_profile(tmp_path / "p.json")
    assert back.decode_row_scale == (1.5, 0.5, 2.0)
    assert back.at_speed(decode=2.0).decode_seconds(4, 1024) == pytest.approx(0.24)
    with pytest.raises(ValueError, match="one factor per decode table row"):
        _profile(decode_row_scale=(1.0, 1.0)).decode_seconds(1, 16)


def test_a_decode_step_beside_decode_steps_only_pays_its_pairs_fixed_work():
    """Decode fixed work 0.1 s, the decode pair's 0.3 s (factors 1): two decode steps side by
    side each pay the pair's; a decode step beside a prompt step pays its kind's."""
    kw = {"cores": 2, "fixed": {"decode": 0.1}, "fixed_pairs": {("decode", "decode"): 0.3}}
    two = _steps_on_shared_cores(kw, [(0.0, "decode", 1.0)] * 2)
    assert two == pytest.approx([1.3, 1.3])
    mixed = _steps_on_shared_cores(kw, [(0.0, "decode", 1.0), (0.0, "prefill", 2.0)])
    assert mixed[0] == pytest.approx(1.1)
    unset = {**kw, "fixed_pairs": {("decode", "decode"): None}}  # an older profile's
    assert _steps_on_shared_cores(unset, [(0.0, "decode", 1.0)] * 2) == pytest.approx([1.1] * 2)


def test_the_calibration_scales_the_table_then_fits_the_decode_pair_on_top_of_it():
    """Alone, 1-row steps ran 0.9x their price and 4-row ones 1.1x; beside another decode
    worker each took 8 ms more than alone. The table's rows come back as 0.9 and 1.1, the
    decode worker's own slowdown as 1 (the scale holds it), and the pair as factor 1 plus
    8 ms a step: not the single factor (1.21 here) that would charge a 4-row step 7 ms more
    than it lost."""
    rows = _alone(1, 0.02, 0.9) + _alone(4, 0.04, 1.1)
    for n, price, ratio in ((1, 0.02, 0.9), (4, 0.04, 1.1), (2, 0.03, 0.9 + 0.2 / 3)):
        rows += [
            {**r, "co_run": 1.0, "busy_others": 1.0, "real_s": ratio * price + 0.008}
            for r in _alone(n, price, ratio, n=5)
        ]
    costs = calibrated_costs(rows, cores=2, grid=(1.0, 4.0))
    assert costs["decode_row_scale"] == pytest.approx((0.9, 1.1))
    assert costs["decode_worker_slowdown"] == pytest.approx(1.0)
    assert costs["co_run_slowdown_decode_pair"] == pytest.approx(1.0, abs=1e-6)
    assert costs["co_run_fixed_s_decode_pair"] == pytest.approx(0.008, rel=1e-3)
    assert "decode_row_scale" not in calibrated_costs(rows, cores=2)  # no grid: the table as is


def test_the_simulator_hands_the_decode_pairs_fixed_work_to_its_cores():
    prof = dataclasses.replace(_profile(), co_run_fixed_s_decode_pair=0.004)
    cluster = SimCluster(prof, SimConfig(Split.parse("colo2"), cpu_cores=2))
    assert cluster.cpu.fixed_pairs == {("decode", "decode"): 0.004}
    assert (
        SimCluster(_profile(), SimConfig(Split.parse("colo2"), cpu_cores=2)).cpu.fixed_pairs == {}
    )
