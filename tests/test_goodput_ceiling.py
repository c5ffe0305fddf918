"""`pdserve bench goodput-ceiling`: the highest request rate the machine's GEMM peak allows for a
run's own prompt lengths, and each system's goodput against it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pdserve.bench import main as bench_main

# SmolLM2-135M (the embedded model), counted by hand: per layer QKV 576 x (576 + 2 x 192), O
# 576 x 576, gate/up/down 3 x 576 x 1536 and two norms; 30 layers and the final norm.
NON_EMBEDDING = 30 * (576 * 960 + 576 * 576 + 3 * 576 * 1536 + 2 * 576) + 576
LM_HEAD_ROW = 2 * 49152 * 576


def prompt_flops(n: int) -> float:
    attention = 2 * 2 * (n * (n + 1) / 2) * 576 * 30  # QK^T and PV over the causal triangle
    return 2 * NON_EMBEDDING * n + attention + LM_HEAD_ROW


@pytest.fixture
def run(capsys):
    """Runs the subcommand in this process; its exit status (argparse's too), stdout, stderr."""

    def run(tmp_path, result: dict, *args: str) -> SimpleNamespace:
        path = tmp_path / "compare.json"
        path.write_text(json.dumps(result))
        try:
            code = bench_main(["goodput-ceiling", str(path), *args])
        except SystemExit as e:  # a bad argument: argparse exits 2 after naming it
            code = e.code
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return run


def system(goodput: float, *runs: list[int]) -> dict:
    return {"goodput": goodput, "runs": [{"input_lens": lens} for lens in runs]}


def test_the_ceiling_is_the_peak_over_the_mean_prefill_flops_of_the_run(tmp_path, run):
    result = {"pdserve": system(1.5, [100, 300], [1000]), "vllm": system(1.0, [200])}
    out = run(tmp_path, result, "--peak-gflops", "250", "--peer", "vllm", "--factor", "2",
              "--json", str(tmp_path / "ceiling.json"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = {r["system"]: r for r in json.loads((tmp_path / "ceiling.json").read_text())["rows"]}
    mean = (prompt_flops(100) + prompt_flops(300) + prompt_flops(1000)) / 3
    assert rows["pdserve"]["ceiling"] == pytest.approx(250e9 / mean)
    assert rows["pdserve"]["of_ceiling"] == pytest.approx(1.5 * mean / 250e9)
    assert rows["vllm"]["ceiling"] == pytest.approx(250e9 / prompt_flops(200))
    share = 2 * 1.0 * prompt_flops(200) / 250e9
    assert f"2x vllm's goodput = 2 req/s = {share:.0%} of the compute ceiling" in out.stdout


def test_a_system_without_prompt_lengths_and_a_bad_thread_count_are_named(tmp_path, run):
    out = run(tmp_path, {"pdserve": {"goodput": 1.0, "runs": []}}, "--peak-gflops", "100")
    assert out.returncode != 0 and "no prompt lengths" in out.stderr
    assert "Traceback" not in out.stderr
    out = run(tmp_path, {"pdserve": system(1.0, [10])}, "--threads", "0")
    assert out.returncode == 2 and "--threads" in out.stderr
