"""`pdserve bench sweep`: SLO attainment per Poisson rate, and the system's goodput.

DistServe's goodput of a system is the highest request rate at which at least 90% of requests
meet both SLOs. Each rate runs the same workload shape (same seed) with a fresh nonce, so no
rate benefits from a prefix cache warmed by the one before it.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass

from pdserve.bench.loadgen.serve import (
    BenchError,
    ServeConfig,
    add_load_args,
    config_from_args,
    run_benchmark,
    with_rate,
    write_json,
)
from pdserve.bench.loadgen.workloads import new_nonce
from pdserve.metrics import ATTAINMENT_TARGET, BenchResult


@dataclass
class SweepPoint:
    rate: float
    slo_attainment: float
    request_goodput: float
    request_throughput: float
    p90_ttft_ms: float
    p90_tpot_ms: float
    failed: int


def goodput_of(points: list[SweepPoint], target: float = ATTAINMENT_TARGET) -> float:
    """The highest rate whose attainment reaches ``target`` (0.0 when none does)."""
    return max((p.rate for p in points if p.slo_attainment >= target), default=0.0)


def point_of(rate: float, res: BenchResult) -> SweepPoint:
    return SweepPoint(
        rate,
        res.slo_attainment or 0.0,
        res.request_goodput or 0.0,
        res.request_throughput,
        res.ttft_ms.p90,
        res.tpot_ms.p90,
        res.failed,
    )


async def run_sweep(cfg: ServeConfig, rates: list[float]) -> tuple[list[SweepPoint], list[dict]]:
    """Run ``cfg`` at each rate (warm-up only before the first); return points and raw runs."""
    if not cfg.slo.is_set:
        raise BenchError("a sweep needs --slo-ttft and/or --slo-tpot")
    points, runs = [], []
    for i, rate in enumerate(sorted(rates)):
        point, run = await run_rate(cfg, rate, i)
        points.append(point)
        runs.append(run)
    return points, runs


async def run_rate(
    cfg: ServeConfig, rate: float, index: int, tag: str = ""
) -> tuple[SweepPoint, dict]:
    """The ``index``-th rate of a sweep: a fresh nonce (or ``--nonce`` plus tag and index),
    warm-up and the cold-start probe only before the first rate."""
    nonce = new_nonce() if cfg.nonce is None else f"{cfg.nonce}{tag}-{index}"
    first = index == 0
    res = await run_benchmark(
        with_rate(
            cfg,
            rate,
            nonce=nonce,
            warmup=cfg.warmup if first else 0,
            cold_start=cfg.cold_start if first else 0,
        )
    )
    return point_of(rate, res), res.to_dict()


def format_sweep(points: list[SweepPoint]) -> str:
    header = (
        f"{'rate':>8} {'attain':>8} {'goodput':>9} {'thruput':>9} {'p90 TTFT':>10} "
        f"{'p90 TPOT':>10} {'failed':>7}"
    )
    lines = [header]
    for p in points:
        lines.append(
            f"{p.rate:>8.3g} {p.slo_attainment:>8.1%} {p.request_goodput:>9.3f} "
            f"{p.request_throughput:>9.3f} {p.p90_ttft_ms:>8.0f}ms {p.p90_tpot_ms:>8.1f}ms "
            f"{p.failed:>7}"
        )
    goodput = goodput_of(points)
    lines.append(
        f"goodput (highest rate with >= {ATTAINMENT_TARGET:.0%} attainment): {goodput:g} req/s"
    )
    return "\n".join(lines)


def add_parser(sub) -> None:
    p = sub.add_parser("sweep", help="SLO attainment per request rate; the highest rate >= 90%%")
    add_load_args(p)
    p.add_argument("--rates", required=True, help="comma-separated requests/s, e.g. 0.25,0.5,1")
    p.set_defaults(func=cmd_sweep)


def parse_rates(text: str) -> list[float]:
    return [float(r) for r in text.split(",") if r.strip()]


def sweep_json(points: list[SweepPoint], runs: list[dict]) -> dict:
    """One sweep as written to --json (bench sweep; one per system in bench compare)."""
    return {
        "goodput": goodput_of(points),
        "attainment_target": ATTAINMENT_TARGET,
        "points": [vars(p) for p in points],
        "runs": runs,
    }


def cmd_sweep(args) -> int:
    rates = parse_rates(args.rates)
    cfg = config_from_args(args, rates[0])
    try:
        points, runs = asyncio.run(run_sweep(cfg, rates))
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_sweep(points))
    if args.json_out:
        write_json(args.json_out, sweep_json(points, runs))
    return 0
