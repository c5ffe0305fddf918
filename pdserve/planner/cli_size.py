"""``pdserve plan`` without ``--max-workers``: the fewest devices for ``--rate`` (or the most
goodput within ``--budget`` devices), over every prefill/decode shape given."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def add_sizing_args(p, positive_float, positive_int) -> None:
    """The sizing flags on ``plan``'s parser (the argument types are cli.py's, passed in: this
    module must not import it back)."""
    p.add_argument(
        "--prefill-profile",
        action="append",
        default=[],
        help="a prefill worker shape (repeat for several: hardware, TP degree)",
    )
    p.add_argument(
        "--decode-profile",
        action="append",
        default=[],
        help="a decode worker shape (repeat for several)",
    )
    p.add_argument(
        "--budget",
        type=positive_int,
        default=None,
        help="devices on hand: the most goodput within them",
    )
    p.add_argument(
        "--headroom",
        type=positive_float,
        default=1.0,
        help="size for rate x this (e.g. 1.2: 20%% spare)",
    )
    p.add_argument(
        "--attainment",
        type=positive_float,
        default=0.9,
        help="share of requests that must meet --slo-ttft/--slo-tpot (0-1]",
    )
    p.add_argument(
        "--slo",
        action="append",
        default=[],
        metavar="METRIC:pPCT=SECONDS",
        help="a percentile bound, e.g. ttft:p99=2 tpot:p50=0.04 itl:p90=0.06",
    )
    p.add_argument(
        "--kv-link-gbps",
        type=positive_float,
        default=None,
        help="the KV link's bandwidth, GB/s (default: the profile's transfer table)",
    )
    p.add_argument("--kv-link-latency-us", type=float, default=None)
    p.add_argument(
        "--kv-link-scope",
        choices=("prefill_worker", "cluster"),
        default="prefill_worker",
        help="one link per prefill worker, or one shared",
    )
    p.add_argument("--no-colocated", action="store_true", help="size disaggregated pools only")
    p.add_argument(
        "--jobs", type=positive_int, default=None, help="simulations at once (default: every core)"
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="simulate the answer again on a fresh workload twice as long",
    )


def slo_spec(args, error):
    from pdserve.metrics import SLO
    from pdserve.planner.slo import Bound, SloSpec

    try:
        bounds = tuple(Bound.parse(b) for b in args.slo)
    except ValueError as e:
        error(f"argument --slo: {e}")
    if not 0 < args.attainment <= 1:
        error(f"argument --attainment: must be in (0, 1], got {args.attainment}")
    spec = SloSpec(SLO(args.slo_ttft, args.slo_tpot), args.attainment, bounds)
    if not spec.is_set:
        error("give --slo-ttft, --slo-tpot and/or --slo")
    return spec


def _shapes(args, error):
    """(profiles by name, prefill names, decode names, colocated names)."""
    from pdserve.planner.profile import load_profile

    profiles, names = {}, {"any": [], "prefill": [], "decode": []}
    for kind, paths in (
        ("any", args.profile or []),
        ("prefill", args.prefill_profile),
        ("decode", args.decode_profile),
    ):
        for path in paths:
            try:
                profiles[path] = load_profile(path)
            except ValueError as e:
                error(f"argument --{'profile' if kind == 'any' else kind + '-profile'}: {e}")
            names[kind].append(path)
    pre = names["prefill"] or names["any"]
    dec = names["decode"] or names["any"]
    if not pre or not dec:
        error("argument --profile: give --profile, or --prefill-profile and --decode-profile")
    colos = [] if args.no_colocated else names["any"]
    return profiles, pre, dec, colos


def _kv_link(args, profile):
    from pdserve.planner.kv_link import KvLink

    link = KvLink.from_table(profile.transfer_bytes, profile.transfer_seconds, args.kv_link_scope)
    if args.kv_link_gbps is None and args.kv_link_latency_us is None:
        return link
    bw = args.kv_link_gbps * 1e9 if args.kv_link_gbps else link.bandwidth_bytes_per_s
    lat = link.latency_s if args.kv_link_latency_us is None else args.kv_link_latency_us * 1e-6
    return KvLink(bw, lat, args.kv_link_scope)


def cmd_size(args, base, workload, rate, error) -> int:
    from dataclasses import replace

    from pdserve.planner.probes import Probe, ProbeRunner, speculative_capacity
    from pdserve.planner.sim import check_compatible
    from pdserve.planner.sizing import best_within, fewest_devices
    from pdserve.planner.sizing_report import figures, format_sizing, sizing_json

    spec = slo_spec(args, error)
    profiles, pre, dec, colos = _shapes(args, error)
    pairs = [(p, d) for p in pre for d in dec]
    try:
        for p, d in pairs:
            check_compatible(profiles[p], profiles[d])
    except ValueError as e:
        error(f"argument --decode-profile: {e}")
    base = replace(base, kv_link=_kv_link(args, profiles[pre[0]]))
    tp = {k: v.devices_per_worker for k, v in profiles.items()}
    target = rate * args.headroom
    started = time.time()
    with ProbeRunner(profiles, workload, spec, base, args.jobs) as runner:
        if args.budget is not None:
            sized = best_within(runner, args.budget, rate, pairs, colos, tp)
        else:
            sized = fewest_devices(runner, target, pairs, colos, tp)
        text = format_sizing(sized, profiles, rate, target, spec, args.budget)
        if args.verify and sized[0].outcome is not None:
            at = rate if args.budget is not None else target
            dep = sized[0].deployment
            # The check and the answer's own capacity at full scale (how close to the target
            # it sits: bracket x1.1, 3 steps) side by side; the capacity starts at the target,
            # which the search simulated already.
            check, cap = runner.concurrently(
                [
                    lambda: runner.one(Probe(dep, at, longer=2.0)),
                    lambda: speculative_capacity(runner, dep, "all", at, 3, 1.1),
                ]
            )
            text += (
                f"\nverified on a fresh workload twice as long ({check.requests} "
                f"requests): {'holds' if check.holds else 'DOES NOT HOLD'}\n"
            )
            text += "\n".join(figures(dep, check, profiles))
            text += (
                f"\nthe whole cluster's capacity (simulated): {cap:.4g} req/s, "
                f"{cap / at - 1:+.1%} over {at:.4g}"
            )
        sims = runner.simulations
    print(text)
    print(
        f"({time.time() - started:.0f} s, {sims} simulations on {runner.workers} processes)",
        file=sys.stderr,
    )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.txt").write_text(text + "\n")
        data = sizing_json(sized, rate, target, args.budget)
        (out / "plan.json").write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {out / 'plan.txt'} and {out / 'plan.json'}")
    return 0
