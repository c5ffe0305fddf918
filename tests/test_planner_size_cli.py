"""`pdserve plan` without --max-workers: the fewest devices for a rate, each figure beside the
error its profile's validation measured; bad sizing arguments are named."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pdserve.cli import main
from tests.test_planner_sim import toy_profile

ARGS = [
    "--workload", "100-300/20-60", "--slo-ttft", "2", "--slo-tpot", "0.1",
    "--duration", "30", "--max-requests", "200", "--jobs", "1",
]  # fmt: skip


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sizing")
    roofline = tmp / "roofline.json"
    toy_profile().save(roofline)
    checked = tmp / "checked.json"
    validation = {"p50_ttft": 0.074, "p90_ttft": 0.073, "p50_tpot": 0.073, "goodput": 0.005}
    prof = toy_profile()
    replace(prof, meta={**prof.meta, "validation": validation}).save(checked)
    return roofline, checked


def test_plan_names_the_fewest_devices_and_the_trust_in_each_figure(profiles, tmp_path, capsys):
    roofline, checked = profiles
    out = tmp_path / "plan"
    argv = ["plan", "--profile", str(roofline), "--rate", "3", "--out", str(out), *ARGS]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "fewest devices for 3 req/s" in text and "recommended:" in text
    assert "p90 TTFT" in text and "error unknown: roofline" in text
    plan = json.loads((out / "plan.json").read_text())
    best = plan["candidates"][0]
    assert best["holds"] and best["devices"] == min(c["devices"] for c in plan["candidates"])

    argv = ["plan", "--prefill-profile", str(checked), "--decode-profile", str(checked)]
    assert main([*argv, "--rate", "3", "--headroom", "1.5", *ARGS]) == 0
    text = capsys.readouterr().out
    assert "with headroom: 4.5 req/s" in text
    assert "±7.3%" in text and "±0.5%" in text and "roofline" not in text


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--slo", "ttft:p200=1"], "argument --slo"),
        (["--attainment", "1.5"], "argument --attainment"),
        (["--max-workers", "2", "--budget", "4"], "argument --budget"),
    ],
)
def test_bad_sizing_arguments_are_named(profiles, extra, named, capsys):
    argv = ["plan", "--profile", str(profiles[0]), "--rate", "1", *ARGS, *extra]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def test_a_rescoring_records_its_error_in_the_profile_and_the_split_search_prints_it(
    profiles, tmp_path, capsys
):
    from pdserve.bench.fidelity.stored import record_validation
    from pdserve.planner.profile import load_profile

    path = tmp_path / "p.json"
    toy_profile().save(path)
    mape = {"p50_ttft_ms": 0.083, "p90_ttft_ms": 0.062, "p50_tpot_ms": 0.07, "goodput": 0.005}
    report = {"fidelity": [{}] * 48, "mape": mape, "leave_one_out": None, "resimulated": "now"}
    record_validation(str(path), load_profile(path), report)
    v = load_profile(path).validation
    assert (v["p90_ttft"], v["goodput"]) == (0.062, 0.005) and "48 live runs" in v["how"]
    argv = ["plan", "--profile", str(path), "--rate", "1", "--max-workers", "2", *ARGS]
    assert main(argv) == 0
    assert "p90 TTFT ±6.2%, p50 TPOT ±7.0%, goodput ±0.5% (MAPE over 48" in capsys.readouterr().out
