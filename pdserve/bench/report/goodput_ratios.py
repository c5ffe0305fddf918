"""Goodput of each system in a ``bench compare`` JSON, and its ratio to a base system and to a
peer (scripts/bench_compare.sh prints this after its sweep).

    pdserve bench goodput-ratios /tmp/pdserve-bench/compare.json --base disaggregated \
        --peer vllm

Goodput is ``bench compare``'s: the highest rate of the sweep whose SLO attainment reaches the
target (90%), so a ratio is only as fine as the rates swept; 0 when no rate reaches it (a ratio
against 0 is printed as "-").
"""

from __future__ import annotations

import json
import sys


def ratio_text(value: float, against: float | None) -> str:
    if against is None or against <= 0:
        return "-"
    return f"{value / against:.2f}x"


def goodput_table(result: dict, base: str, peer: str | None) -> list[str]:
    goodput = {name: float(system["goodput"]) for name, system in result.items()}
    against = [base] + ([peer] if peer else [])
    width = max(len(name) for name in goodput)
    cols = [len(name) + 4 for name in against]
    lines = [f"{'system':<{width}} {'goodput':>9}" + "".join(
        f" {'x ' + name:>{col}}" for name, col in zip(against, cols)
    )]  # fmt: skip
    for name, value in goodput.items():
        ratios = "".join(
            f" {ratio_text(value, goodput.get(other)):>{col}}" for other, col in zip(against, cols)
        )
        lines.append(f"{name:<{width}} {value:>7.3g}/s{ratios}")
    return lines


def add_parser(sub) -> None:
    p = sub.add_parser(
        "goodput-ratios",
        help="each system's goodput in a `bench compare` JSON and its ratios",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("compare_json")
    p.add_argument("--base", default="disaggregated", help="the system others are divided by")
    p.add_argument("--peer", default=None, help="a second system to divide by (e.g. vllm)")
    p.set_defaults(func=run)


def run(args) -> int:
    with open(args.compare_json) as f:
        result = json.load(f)
    if args.base not in result:
        print(f"error: no system {args.base!r} in {args.compare_json}", file=sys.stderr)
        return 2
    peer = args.peer if args.peer in result else None
    print("\n".join(goodput_table(result, args.base, peer)))
    return 0
