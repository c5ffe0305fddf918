"""The lab's former scripts as ``pdserve bench`` subcommands: each one's flags parse, and the one
timing helper they share counts calls and picks the median or the fastest as asked."""

from __future__ import annotations

import pytest

from pdserve.bench import main as bench_main
from pdserve.measure.timing import timed

SUBCOMMANDS = [
    "attention",
    "triton-quant",
    "quant-matmul",
    "cpu-variants",
    "quant",
    "isa-table",
    "report",
    "goodput-ratios",
    "goodput-ceiling",
    "cluster",
    "overload-soak",
]


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_help_renders(name, capsys):
    # --help builds the subcommand's parser only: no model, no Triton, no cluster is touched.
    with pytest.raises(SystemExit) as exit_info:
        bench_main([name, "--help"])
    assert exit_info.value.code == 0 and "usage:" in capsys.readouterr().out


def test_flags_each_script_had_are_kept():
    import argparse

    from pdserve.bench import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "cluster", "--num-prefill", "0", "--threads", "2",
                              "--weights", "q4", "--kv-dtype", "int8", "--in-process"])  # fmt: skip
    assert (args.num_prefill, args.threads, args.weights, args.in_process) == (0, 2, "q4", True)
    args = parser.parse_args(["bench", "overload-soak", "--seconds", "30", "--out", "x.json"])
    assert (args.seconds, args.factor, args.out) == (30.0, 2.0, "x.json")
    args = parser.parse_args(["bench", "quant", "--child", "--llama-bin", "avx2=/b"])
    assert args.child and args.llama_bin == ["avx2=/b"]


def test_timed_warms_up_then_takes_the_median_or_the_fastest(monkeypatch):
    from pdserve.measure import timing

    ticks = iter([0.0, 3.0, 10.0, 11.0, 20.0, 22.0])  # three calls: 3 s, 1 s, 2 s
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks))
    calls = []
    assert timed(lambda: calls.append(1), 3, warmup=2) == 2.0
    assert len(calls) == 5  # two untimed warm-up calls, then three timed ones
    ticks = iter([0.0, 3.0, 10.0, 11.0, 20.0, 22.0])
    assert timed(lambda: None, 3, best=True, warmup=0) == 1.0
