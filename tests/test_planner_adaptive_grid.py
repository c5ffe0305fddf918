"""`pdserve profile --time-budget`: a coarse grid first, refined where the curve bends, and
never a row past the budget (a fake clock: each row costs what its latency says)."""

from __future__ import annotations

from pdserve.planner.adaptive_grid import coarse, measure_rows, next_row

ROWS = (1, 8, 16, 32, 64, 96, 128, 192, 256)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def knee(x: float) -> float:
    """Flat (memory bound) up to 96 rows, then linear (compute bound): the bend falls between
    two coarse rows (64 and 128)."""
    return 0.01 if x <= 96 else 0.01 + (x - 96) * 1e-3


def _measure(clock: FakeClock, cost_s: float = 1.0):
    def row(x: int) -> list[float]:
        clock.now += cost_s * (1 + x / 256)  # larger rows take longer to time
        return [knee(x), 2 * knee(x)]

    return row


def test_the_coarse_grid_is_every_other_row_and_the_last():
    assert coarse(ROWS) == [1, 16, 64, 128, 256]
    assert coarse((1, 2, 4, 8)) == [1, 4, 8]


def test_refinement_goes_where_the_curve_bends():
    done = {x: knee(x) for x in coarse(ROWS)}
    # 16..64 flat, 128..256 straight: their lines meet inside 64..128, at 96.
    assert next_row(ROWS, done) == 96
    done[96] = knee(96)
    # Every interval is now straight: the widest (1..16) next.
    assert next_row(ROWS, done) == 8


def test_a_time_budget_measures_the_coarse_grid_then_refines_until_it_is_spent():
    clock = FakeClock()
    rows, values, record = measure_rows(ROWS, _measure(clock), budget_s=9.0, clock=clock)
    assert set(coarse(ROWS)) <= set(rows)
    assert record.measured[: len(coarse(ROWS))] == coarse(ROWS)
    assert record.measured[len(coarse(ROWS))] == 96  # the first refinement: at the knee
    assert clock.now <= 9.0 and record.seconds == clock.now
    assert record.skipped and set(record.skipped) | set(rows) == set(ROWS)
    assert rows == sorted(rows) and values[rows.index(64)] == [knee(64), 2 * knee(64)]


def test_enough_time_measures_every_row_and_none_is_skipped():
    clock = FakeClock()
    rows, _, record = measure_rows(ROWS, _measure(clock), budget_s=1e6, clock=clock)
    assert rows == list(ROWS) and record.skipped == []


def test_a_budget_shorter_than_the_coarse_grid_still_measures_it_and_nothing_more():
    clock = FakeClock()
    rows, _, record = measure_rows(ROWS, _measure(clock), budget_s=1.0, clock=clock)
    assert rows == coarse(ROWS) and len(record.skipped) == len(ROWS) - len(coarse(ROWS))


def test_a_budgeted_profile_records_what_it_measured(tmp_path):
    from pdserve.cli import main
    from pdserve.planner.profile import load_profile
    from tests.conftest import tiny_llama_dir

    model, _ = tiny_llama_dir(tmp_path, seed=31)
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(f"model: {model}\nmax_model_len: 256\nnum_blocks: 256\n")
    out = tmp_path / "p.json"
    argv = ["profile", "--config", str(cfg), "--out", str(out), "--quick", "--no-progress"]
    assert main([*argv, "--time-budget", "60"]) == 0
    grid = load_profile(out).meta["grid"]
    assert grid["budget_s"] == 60
    assert grid["prefill"]["measured"] == [8, 32] and grid["prefill"]["skipped"] == []
    assert grid["decode"]["measured"] == [1, 4] and grid["decode"]["seconds"] <= 60
