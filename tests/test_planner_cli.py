"""`pdserve profile --quick` on a tiny random model, then `pdserve plan` on it: a table, JSON
and PNG plots; bad arguments are named."""

from __future__ import annotations

import json

import pytest

from pdserve.cli import main
from pdserve.planner.machine_meta import ISA_FLAGS
from pdserve.planner.profile import load_profile
from pdserve.planner.workload import synthetic, write_trace
from tests.conftest import tiny_llama_dir


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("planner")
    model, _ = tiny_llama_dir(tmp, seed=31)
    cfg = tmp / "tiny.yaml"
    cfg.write_text(f"model: {model}\nmax_model_len: 256\nnum_blocks: 256\n")
    out = tmp / "profile.json"
    assert (
        main(["profile", "--config", str(cfg), "--out", str(out), "--quick", "--no-progress"]) == 0
    )
    return out


def test_quick_profile_records_hardware_model_dtype_and_versions(tiny_profile):
    prof = load_profile(tiny_profile)
    for key in ("cpu", "device", "dtype", "versions", "model", "threads"):
        assert key in prof.meta
    identity = prof.meta["cpu_identity"]  # family / model and ISA: the name can be bare on a VM
    assert set(identity) == {"name", "family", "model", "isa"}
    assert set(identity["isa"]) <= set(ISA_FLAGS)
    assert prof.prefill_seconds(32, 0) > 0
    assert prof.decode_seconds(4, 64) > 0
    assert prof.transfer_seconds_for(128) > 0
    assert prof.engine.max_model_len == 256
    assert prof.sample_seconds_per_row > 0  # measured even on the quick grid
    assert prof.cpu.router_cpu_per_token_s == 0  # --quick starts no router


def test_cpu_costs_only_remeasures_sampling_and_keeps_the_tables(tiny_profile, tmp_path):
    import dataclasses

    copy = tmp_path / "p.json"
    before = dataclasses.replace(load_profile(tiny_profile), sample_seconds_per_row=9.0)
    before.save(copy)
    argv = ["profile", "--config", str(tiny_profile.parent / "tiny.yaml"), "--out", str(copy)]
    assert main([*argv, "--cpu-costs-only", "--skip-router"]) == 0
    after = load_profile(copy)
    assert 0 < after.sample_seconds_per_row < 9.0
    assert after.decode == before.decode and after.prefill == before.prefill
    assert "load_average" in after.meta["cpu_costs"]


def _plan_argv(profile, out, rate: float, duration: float, max_requests: int) -> list[str]:
    """``pdserve plan`` on the tiny profile's short workload with a 50 ms TTFT SLO."""
    return [
        "plan",
        "--profile",
        str(profile),
        "--workload",
        "20-60/4-16",
        "--rate",
        str(rate),
        "--slo-ttft",
        "0.05",
        "--out",
        str(out),
        "--duration",
        str(duration),
        "--max-requests",
        str(max_requests),
    ]


def test_plan_writes_table_json_and_plots(tiny_profile, tmp_path, capsys):
    out = tmp_path / "plan"
    argv = _plan_argv(tiny_profile, out, rate=50, duration=5, max_requests=300)
    argv += ["--slo-tpot", "0.01", "--max-workers", "2"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "recommended:" in text and "1P1D" in text and "colo2" in text
    data = json.loads((out / "plan.json").read_text())
    assert {s["split"] for s in data["splits"]} == {"1P1D", "colo1", "colo2"}
    for png in ("goodput_vs_rate.png", "attainment_vs_ratio.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_plan_replays_a_trace_at_its_own_rate(tiny_profile, tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    rows = synthetic("20-60/4-16", 100, 40.0, seed=2)
    write_trace(trace, rows)
    own_rate = (len(rows) - 1) / (rows[-1].arrival_s - rows[0].arrival_s)
    argv = [
        "plan",
        "--profile",
        str(tiny_profile),
        "--trace",
        str(trace),
        "--slo-ttft",
        "0.05",
        "--max-workers",
        "2",
        "--duration",
        "3",
    ]
    assert main(argv) == 0
    assert f"at {own_rate:g} req/s" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--rate", "0"], "--rate"),
        (["--rate", "x"], "--rate"),
        (["--rate", "1", "--max-workers", "0"], "--max-workers"),
        (["--rate", "1", "--workload", "nope"], "--workload"),
        (["--rate", "1", "--prefill-policy", "best"], "--prefill-policy"),
        (["--rate", "1", "--profile", "/no/such.json"], "--profile"),
        (["--rate", "1", "--slo-ttft", "-2"], "--slo-ttft"),
        (["--rate", "1", "--temperature", "-1"], "--temperature"),
        (["--rate", "1", "--shared-prefix-tokens", "-1"], "--shared-prefix-tokens"),
    ],
)
def test_plan_names_a_bad_argument(tiny_profile, extra, named, capsys):
    argv = [
        "plan",
        "--profile",
        str(tiny_profile),
        "--workload",
        "chat",
        "--slo-ttft",
        "1",
        "--max-workers",
        "2",
    ]
    # Later flags win in argparse: each case overrides one of the good ones.
    with pytest.raises(SystemExit) as e:
        main(argv + extra)
    assert e.value.code == 2
    assert named in capsys.readouterr().err


def test_plan_needs_an_slo(tiny_profile, capsys):
    with pytest.raises(SystemExit):
        main(
            [
                "plan",
                "--profile",
                str(tiny_profile),
                "--workload",
                "chat",
                "--rate",
                "1",
                "--max-workers",
                "2",
            ]
        )
    assert "--slo-ttft" in capsys.readouterr().err


def test_plan_past_unit_max_replicates_units(tiny_profile, tmp_path):
    out = tmp_path / "plan"
    argv = _plan_argv(tiny_profile, out, rate=80, duration=3, max_requests=200)
    argv += ["--max-workers", "4", "--unit-max", "2"]
    assert main(argv) == 0
    data = json.loads((out / "plan.json").read_text())
    assert {s["split"] for s in data["splits"]} == {"1P1D", "colo1", "colo2"}
    assert {s["split"]: s["replicas"] for s in data["splits"]} == {
        "1P1D": 2,
        "colo1": 4,
        "colo2": 2,
    }


def test_at_speed_scales_each_kinds_prices_and_its_once_per_step_work(tiny_profile):

    prof = load_profile(tiny_profile).with_cpu(co_run_fixed_s=0.01, co_run_fixed_s_prefill=0.02)
    slow = prof.at_speed(decode=2.0, prefill=3.0)
    assert slow.decode_seconds(4, 64) == pytest.approx(2 * prof.decode_seconds(4, 64))
    assert slow.prefill_seconds(32, 32) == pytest.approx(3 * prof.prefill_seconds(32, 32))
    assert (slow.cpu.co_run_fixed_s, slow.cpu.co_run_fixed_s_prefill) == pytest.approx((0.02, 0.06))
    assert slow.cpu.co_run_slowdown == prof.cpu.co_run_slowdown  # ratios are not speeds
    assert slow.transfer_seconds == prof.transfer_seconds


def test_the_speed_probe_reads_its_steps_against_the_profiles_prices(tiny_profile):
    """The ratios are the geometric mean over the probe's grid points of seconds now over the
    profile's seconds; on the real engine they are finite and positive."""
    from pdserve.bench.fidelity.speed_probe import SpeedProbe

    prof = load_profile(tiny_profile)
    probe = SpeedProbe(prof, reps=1)
    speed = probe.measure()
    assert all(0 < v < float("inf") for v in (speed.decode, speed.prefill, speed.prefill_small))
    assert probe.decode_points == [(1, 16), (4, 64)]  # the quick grid's corner and middle
    small, large = prof.prefill_probe_tokens()
    assert probe.prefill_points == [(large, 0), (small, 0)] and small < large
    factors = iter([2.0, 8.0])  # per decode point: mean 4

    class Timer:
        def decode(self, b, c):
            return next(factors) * prof.decode_seconds(b, c)

        def prefill(self, n, c):
            return (1.5 if n == large else 1.8) * prof.prefill_seconds(n, c)

    probe.timer = Timer()
    speed = probe.measure()
    assert (speed.decode, speed.prefill, speed.prefill_small) == pytest.approx((4.0, 1.5, 1.8))
    assert speed.to_dict() == {"decode": 4.0, "prefill": 1.5, "prefill_small": 1.8}


def test_a_small_prompts_speed_scales_the_short_rows_and_fades_to_the_large_ones(tiny_profile):
    """The small probe's ratio holds at its prompt and below, the large one's at its prompt
    and above, and rows between take the log-linear blend (the geometric mean halfway)."""
    import math

    from pdserve.bench.fidelity.speed_probe import Speed

    prof = load_profile(tiny_profile)
    small, large = prof.prefill_probe_tokens()
    slow = prof.at_speed(1.0, 2.0, 4.0)
    rows = prof.prefill.rows
    ratios = [slow.prefill.at(n, 0) / prof.prefill.at(n, 0) for n in rows]
    for n, ratio in zip(rows, ratios, strict=True):
        share = min(1.0, max(0.0, math.log(n / small) / math.log(large / small)))
        assert ratio == pytest.approx(4.0 ** (1 - share) * 2.0**share)
    assert ratios[0] == pytest.approx(4.0) and ratios[-1] == pytest.approx(2.0)
    # Without the small probe (runs stored before it), the whole table scales as one.
    assert prof.at_speed(1.0, 2.0).prefill == prof.prefill.scaled(2.0)
    both = Speed.mean([Speed(1.0, 2.0, 4.0), Speed(1.0, 2.0, None), Speed(3.0, 4.0, 2.0)])
    assert (both.decode, both.prefill, both.prefill_small) == pytest.approx((5 / 3, 8 / 3, 3.0))
