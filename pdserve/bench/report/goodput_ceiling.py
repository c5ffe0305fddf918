"""The compute ceiling of a ``bench compare`` run: the highest request rate at which this
machine's cores could even do the prompts' arithmetic, and each system's goodput against it.

    pdserve bench goodput-ceiling /tmp/pdserve-bench/compare.json --peer vllm --factor 2

Every engine has to prefill each prompt: its matmuls (2 x non-embedding parameters a token),
its causal attention (QK^T and PV) and one LM-head row, ``prefill_flops`` in
pdserve/bench/micro/engine.py. Done at the machine's GEMM peak, measured here on every core in
this run (square 2048 matmuls in fp32 and in bf16, the better counts), a request's prompt takes
at least ``flops / peak`` seconds of the whole machine, so no system sustains more than

    ceiling = peak / mean prefill FLOPs per request  (requests/s)

on the run's own prompt lengths (each system's usage counts). The bound leaves out decode, the
SLOs and queueing, so every real goodput sits well under it. A target such as "2x the peer's
goodput" that lands near or above the ceiling cannot be met by any engine on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from pdserve.bench.micro.engine import prefill_flops
from pdserve.bench.micro.limits import gemm_peak


def mean_prefill_flops(cfg, input_lens: list[int]) -> float:
    """Mean prefill FLOPs of one request over the prompt lengths ``input_lens``."""
    return sum(prefill_flops(cfg, n) for n in input_lens) / len(input_lens)


def system_input_lens(system: dict) -> list[int]:
    """Every finished request's prompt length over a system's runs (the server's usage)."""
    return [int(n) for run in system.get("runs", []) for n in run.get("input_lens", [])]


def measure_peak(threads: int) -> dict[str, float]:
    """GEMM FLOP/s on ``threads`` threads, fp32 and bf16."""
    torch.set_num_threads(threads)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    return {name: gemm_peak(dtype=dtype) for name, dtype in dtypes.items()}


def ceiling_rows(result: dict, cfg, peak: float) -> list[dict]:
    rows = []
    for name, system in result.items():
        lens = system_input_lens(system)
        if not lens:
            raise ValueError(f"system {name!r}: no prompt lengths (no finished request)")
        flops = mean_prefill_flops(cfg, lens)
        ceiling = peak / flops
        goodput = float(system["goodput"])
        rows.append({"system": name, "goodput": goodput, "mean_prefill_gflop": flops / 1e9,
                     "ceiling": ceiling, "of_ceiling": goodput / ceiling})  # fmt: skip
    return rows


def report(rows: list[dict], peaks: dict[str, float], threads: int, peer: str | None,
           factor: float) -> list[str]:  # fmt: skip
    peak_text = ", ".join(f"{k} {v / 1e9:.0f}" for k, v in peaks.items())
    lines = [f"GEMM peak on {threads} threads (GFLOP/s): {peak_text}; the ceiling uses the best",
             f"{'system':<24} {'goodput':>8} {'GFLOP/req':>10} {'ceiling':>9} {'of it':>7}"]  # fmt: skip
    for r in rows:
        lines.append(f"{r['system']:<24} {r['goodput']:>6.3g}/s {r['mean_prefill_gflop']:>10.1f} "
                     f"{r['ceiling']:>7.2f}/s {r['of_ceiling']:>6.1%}")  # fmt: skip
    by_name = {r["system"]: r for r in rows}
    if peer in by_name:
        p = by_name[peer]
        target = factor * p["goodput"]
        lines.append(f"{factor:g}x {peer}'s goodput = {target:.3g} req/s = "
                     f"{target / p['ceiling']:.0%} of the compute ceiling ({p['ceiling']:.2f}/s)")  # fmt: skip
    return lines


def _threads(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return n


def add_parser(sub) -> None:
    p = sub.add_parser(
        "goodput-ceiling",
        help="the compute ceiling of a `bench compare` run, each goodput against it",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("compare_json")
    p.add_argument("--model", default="embedded", help="the model the systems served")
    p.add_argument(
        "--threads", type=_threads, default=os.cpu_count() or 1, help="cores for the peak"
    )
    p.add_argument("--peer", default=None, help="the system a target is a multiple of")
    p.add_argument("--factor", type=float, default=2.0, help="the target's multiple of the peer")
    p.add_argument("--peak-gflops", type=float, default=None,
                   help="use this GEMM peak instead of measuring one (GFLOP/s)")  # fmt: skip
    p.add_argument("--json", default=None, help="write the rows and peaks here")
    p.set_defaults(func=run)


def run(args) -> int:
    result = json.loads(Path(args.compare_json).read_text())
    from engine.loader import load_config
    from engine.model_files import resolve_model_dir

    cfg = load_config(resolve_model_dir(args.model))
    given = args.peak_gflops
    peaks = {"given": given * 1e9} if given else measure_peak(args.threads)
    try:
        rows = ceiling_rows(result, cfg, max(peaks.values()))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(report(rows, peaks, args.threads, args.peer, args.factor)))
    if args.json:
        Path(args.json).write_text(json.dumps({"peaks": peaks, "threads": args.threads,
                                               "rows": rows}, indent=1))  # fmt: skip
    return 0
