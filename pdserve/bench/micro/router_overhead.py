"""``pdserve bench router``: what the router adds to TTFT, against workers that answer at once
(the measurement is ``pdserve.measure.router_overhead``, which ``pdserve profile`` takes too)."""

from __future__ import annotations

import asyncio
import json

from grpc_plumbing.tracing import tracing_missing
from pdserve.measure.router_overhead import measure


def add_parser(sub) -> None:
    p = sub.add_parser("router", help="what the router adds to TTFT (instant fake workers)")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="interleaved blocks each path's requests are split into (more on a busy machine)",
    )
    p.add_argument(
        "--no-tracing",
        dest="tracing",
        action="store_false",
        help="skip the router with OpenTelemetry tracing on (run beside the default one)",
    )
    p.add_argument(
        "--baseline-tree",
        default=None,
        help="also run the router of this source tree (e.g. a checkout from before a change)",
    )
    p.set_defaults(func=_main)


def _main(args) -> int:
    traced = args.tracing and tracing_missing() is None
    if args.tracing and not traced:
        print(f"tracing on: not measured ({tracing_missing()})")
    result = asyncio.run(
        measure(args.requests, args.prompt_tokens, traced, args.baseline_tree, args.rounds)
    )
    print(
        f"prompt {result['prompt_tokens']} tokens; workers, router and client in separate processes"
    )
    print(
        f"{'requests':<14}{'direct p50':>12}{'routed p50':>12}{'p90':>8}{'added p50':>11}"
        f"{'reserve-first added':>21}{'bare relay added':>18}"
    )
    for r in result["rows"]:
        print(
            f"{r['pattern']:<14}{r['direct_p50_ms']:>10.2f}ms{r['routed_p50_ms']:>10.2f}ms"
            f"{r['routed_p90_ms']:>6.2f}ms{r['router_added_p50_ms']:>9.2f}ms"
            f"{r['reserve_first_added_p50_ms']:>19.2f}ms{r['relay_added_p50_ms']:>16.2f}ms"
        )
    print(
        f"router adds at most {result['router_added_p50_ms']:.2f} ms at p50 (target < 2 ms); "
        f"one bare grpc.aio hop adds {result['relay_added_p50_ms']:.2f} ms "
        f"(router / hop: {result['router_added_p50_ms'] / result['relay_added_p50_ms']:.2f}x)"
    )
    for r in result["rows"]:  # the same rounds, so the differences are like for like
        if "traced_added_p50_ms" in r:
            print(
                f"{r['pattern']:<14}tracing on adds {r['traced_added_p50_ms']:.2f} ms at p50: "
                f"on - off {-r['routed_minus_traced_p50_ms']:+.3f} ms"
            )
        if "baseline_added_p50_ms" in r:
            print(
                f"{r['pattern']:<14}the baseline tree's router adds "
                f"{r['baseline_added_p50_ms']:.2f} ms at p50: this tree's (tracing off) - "
                f"baseline {r['routed_minus_baseline_p50_ms']:+.3f} ms"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
