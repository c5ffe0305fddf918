"""`pdserve bench compare`: rate sweeps of several servers, interleaved rate by rate.

On a shared machine the noise moves over minutes. Sweeping one server after another puts each
in its own window: measured here, one system's attainment at 0.3 req/s was 47% in a sweep and
95% in each of four runs fifteen minutes later. Here every rate runs on every server back to
back, the order rotating from one rate to the next, so the systems share the windows. Each run
gets its own prompt nonce (no server sees another's prompts, nor its own twice); the workload's
shape and arrival times are the same for all (same seed). The servers stay up side by side and
must be idle while another one is measured.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, replace

from pdserve.bench.loadgen.serve import (
    BenchError,
    ServeConfig,
    add_load_args,
    config_from_args,
    write_json,
)
from pdserve.bench.loadgen.sweep import SweepPoint, goodput_of, parse_rates, run_rate, sweep_json


@dataclass(frozen=True)
class System:
    name: str
    url: str


@dataclass
class SystemSweep:
    system: System
    points: list[SweepPoint]
    runs: list[dict]

    @property
    def goodput(self) -> float:
        return goodput_of(self.points)


def parse_system(text: str) -> System:
    name, sep, url = text.partition("=")
    if not sep or not name.strip() or not url.strip():
        raise BenchError(f"--against wants NAME=URL, got {text!r}")
    return System(name.strip(), url.strip())


def run_order(systems: list[System], index: int) -> list[System]:
    """Rate ``index``'s order: rotated by one per rate, so no system always goes first."""
    k = index % len(systems)
    return systems[k:] + systems[:k]


async def run_compare(
    cfg: ServeConfig, systems: list[System], rates: list[float]
) -> list[SystemSweep]:
    if not cfg.slo.is_set:
        raise BenchError("a comparison needs --slo-ttft and/or --slo-tpot")
    if len({s.name for s in systems}) != len(systems):
        raise BenchError("system names must differ")
    sweeps = {s.name: SystemSweep(s, [], []) for s in systems}
    for i, rate in enumerate(sorted(rates)):
        for system in run_order(systems, i):
            system_cfg = replace(cfg, url=system.url, model=None)  # each server's own model
            point, run = await run_rate(system_cfg, rate, i, tag=f"-{system.name}")
            sweeps[system.name].points.append(point)
            sweeps[system.name].runs.append(run)
    return list(sweeps.values())


def format_compare(sweeps: list[SystemSweep]) -> str:
    width = max(len(s.system.name) for s in sweeps)
    header = (
        f"{'system':<{width}} {'rate':>6} {'attain':>8} {'p90 TTFT':>10} {'p90 TPOT':>10} "
        f"{'p99 ITL':>9} {'failed':>7}"
    )
    lines = [header]
    for sweep in sweeps:
        for point, run in zip(sweep.points, sweep.runs, strict=True):
            lines.append(
                f"{sweep.system.name:<{width}} {point.rate:>6.3g} {point.slo_attainment:>8.1%} "
                f"{point.p90_ttft_ms:>8.0f}ms {point.p90_tpot_ms:>8.1f}ms "
                f"{run['p99_itl_ms']:>7.0f}ms {point.failed:>7}"
            )
    lines += _p90_ttft_by_kind(sweeps, width)
    for sweep in sweeps:
        lines.append(f"goodput {sweep.system.name}: {sweep.goodput:g} req/s")
    return "\n".join(lines)


def _p90_ttft_by_kind(sweeps: list[SystemSweep], width: int) -> list[str]:
    """Each run's p90 TTFT per kind of request, where a workload has several kinds (a p90
    over the mix sits on its slowest kind: multiturn's openings, mixed's documents)."""
    kinds = list(
        dict.fromkeys(k for s in sweeps for r in s.runs for k in r.get("ttft_by_kind_ms", {}))
    )
    if len(kinds) < 2:
        return []
    lines = [
        f"p90 TTFT by kind (ms): {'system':<{width}} {'rate':>6} "
        + " ".join(f"{k:>8}" for k in kinds)
    ]
    for sweep in sweeps:
        for point, run in zip(sweep.points, sweep.runs, strict=True):
            by_kind = run.get("ttft_by_kind_ms", {})
            cells = [f"{by_kind[k]['p90']:>8.0f}" if k in by_kind else f"{'-':>8}" for k in kinds]
            lines.append(
                f"{'':23}{sweep.system.name:<{width}} {point.rate:>6.3g} " + " ".join(cells)
            )
    return lines


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="rate sweeps of several servers, interleaved per rate")
    add_load_args(p)
    p.add_argument("--name", default="pdserve", help="the name of the --url server")
    p.add_argument(
        "--against", action="append", default=[], help="NAME=URL of another server (repeat)"
    )
    p.add_argument("--rates", required=True, help="comma-separated requests/s, e.g. 0.25,0.5,1")
    p.set_defaults(func=cmd_compare)


def cmd_compare(args) -> int:
    rates = parse_rates(args.rates)
    try:
        systems = [System(args.name, args.url)] + [parse_system(t) for t in args.against]
        sweeps = asyncio.run(run_compare(config_from_args(args, rates[0]), systems, rates))
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_compare(sweeps))
    if args.json_out:
        write_json(
            args.json_out,
            {s.system.name: {"url": s.system.url, **sweep_json(s.points, s.runs)} for s in sweeps},
        )
    return 0
