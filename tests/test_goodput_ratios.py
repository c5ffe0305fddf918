"""`pdserve bench goodput-ratios`: each system's goodput from a ``bench compare`` JSON, divided
by the base system's and the peer's (what scripts/bench_compare.sh prints last)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pdserve.bench import main as bench_main


@pytest.fixture
def run(capsys):
    """Runs the subcommand in this process; its exit status, stdout and stderr."""

    def run(tmp_path, result: dict, *args: str) -> SimpleNamespace:
        path = tmp_path / "compare.json"
        path.write_text(json.dumps(result))
        code = bench_main(["goodput-ratios", str(path), *args])
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return run


def test_ratios_to_the_base_and_the_peer(tmp_path, run):
    result = {
        "disaggregated": {"goodput": 2.0},
        "disaggregated_q4": {"goodput": 3.0},
        "vllm": {"goodput": 1.0},
        "disaggregated_int8": {"goodput": 0.0},
    }
    out = run(tmp_path, result, "--base", "disaggregated", "--peer", "vllm")
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()[1:]}
    assert rows["disaggregated_q4"] == ["3/s", "1.50x", "3.00x"]
    assert rows["vllm"] == ["1/s", "0.50x", "1.00x"]
    assert rows["disaggregated_int8"] == ["0/s", "0.00x", "0.00x"]


def test_a_base_of_zero_gives_no_ratio_and_a_missing_base_is_an_error(tmp_path, run):
    out = run(tmp_path, {"disaggregated": {"goodput": 0.0}, "q4": {"goodput": 1.0}})
    assert out.returncode == 0 and out.stdout.splitlines()[2].split() == ["q4", "1/s", "-"]
    out = run(tmp_path, {"q4": {"goodput": 1.0}}, "--base", "disaggregated")
    assert out.returncode == 2 and "disaggregated" in out.stderr
