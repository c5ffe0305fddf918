"""The ``pdserve`` command line."""

from __future__ import annotations

import argparse
import sys

from engine import hugepages

hugepages.request()  # before anything imports torch: its allocator reads it once

from engine.errors import PdserveError
from engine.generate import add_generate_parser
from pdserve.serve_args import FlagError, add_serve_arguments, apply_serve_args


def _add_demo(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="launch the local cluster on Ray, stream a few chat requests "
        "through prefill -> KV transfer -> decode, print a table, stop",
    )
    p.add_argument("--config", default=None, help="cluster YAML (default: the embedded local one)")
    p.add_argument("--model", default=None, help="override the config's model")
    p.add_argument("--max-tokens", type=int, default=48)
    p.set_defaults(func=lambda args: _run_demo(args))


def _run_demo(args) -> int:
    from pdserve.config import load_config
    from pdserve.demo import run_demo

    cfg = load_config(args.config)
    if args.model:
        cfg = cfg.with_overrides(model=args.model)
    return run_demo(cfg, args.max_tokens)


def _add_cluster_commands(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="launch the cluster on Ray and serve until Ctrl-C/SIGTERM",
        description="Serve MODEL on a prefill pool and a decode pool (Ray), with an "
        "OpenAI-compatible HTTP API and a gRPC API. The flags override the cluster YAML; the "
        "YAML (--config) holds everything else.",
    )
    p.add_argument("--config", default=None, help="cluster YAML (default: the embedded local one)")
    add_serve_arguments(p)
    p.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join ('auto': the one on this machine); "
        "default: start a local Ray instance",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve the client API off loopback without an API key (only behind something "
        "that authenticates clients)",
    )
    p.add_argument(
        "--drain-grace-s",
        type=float,
        default=None,
        help="on SIGTERM/Ctrl-C, how long running streams get to finish while new requests "
        "are refused (default: the config's drain_grace_s, 30 s)",
    )
    p.set_defaults(func=lambda args, serve=p: cmd_serve(args, serve))
    p = sub.add_parser("scale", help="resize the running cluster's pools")
    p.add_argument("--prefill", type=int, default=None, help="prefill workers wanted")
    p.add_argument("--decode", type=int, default=None, help="decode workers wanted")
    p.add_argument("--address", default="auto", help="the Ray cluster (default: auto)")
    p.add_argument("--no-wait", action="store_true", help="return before drains finish")
    p.set_defaults(func=cmd_scale)
    p = sub.add_parser("status", help="pools, workers, health and KV usage of the running cluster")
    p.add_argument("--address", default="auto", help="the Ray cluster (default: auto)")
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")
    p.set_defaults(func=cmd_status)


def cmd_serve(args, parser: argparse.ArgumentParser) -> int:
    from pdserve.config import load_config
    from pdserve.security_config import api_security
    from router.security import OpenBindError, check_api_exposure

    cfg = load_config(args.config)
    try:  # the operator flags (and $PDSERVE_API_KEY), before Ray starts anything
        cfg = apply_serve_args(cfg, args)
    except FlagError as e:
        parser.error(str(e))  # "pdserve serve: error: argument --port: ...", exit 2
    overrides = {}
    if args.allow_unauthenticated:
        overrides["security"] = {**cfg.security.model_dump(), "allow_unauthenticated": True}
    if args.drain_grace_s is not None:
        overrides["drain_grace_s"] = args.drain_grace_s
    cfg = cfg.with_overrides(**overrides) if overrides else cfg
    try:  # here, before Ray starts anything: the router would refuse the same way
        check_api_exposure(cfg.host or "each node's IP", cfg.api_key, api_security(cfg))
    except OpenBindError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from pdserve.cluster.ray_launcher import serve_forever  # Ray: only once the flags are good

    return serve_forever(cfg, args.address)


def cmd_scale(args) -> int:
    import ray

    from pdserve.cluster.ray_launcher import find_controller, format_status

    if args.prefill is None and args.decode is None:
        print("error: give --prefill N and/or --decode M", file=sys.stderr)
        return 2
    controller = find_controller(args.address)
    try:
        st = ray.get(controller.scale.remote(args.prefill, args.decode, not args.no_wait))
    except ray.exceptions.RayTaskError as e:
        print(f"error: {e.cause}", file=sys.stderr)
        return 2
    print(format_status(st))
    return 0


def cmd_status(args) -> int:
    import json

    import ray

    from pdserve.cluster.ray_launcher import find_controller, format_status

    st = ray.get(find_controller(args.address).status.remote())
    print(json.dumps(st, indent=2) if args.json else format_status(st))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    _add_demo(sub)
    _add_cluster_commands(sub)
    from pdserve.bench import register as add_bench

    add_bench(sub)
    from pdserve.planner.cli import register as add_planner

    add_planner(sub)  # profile, plan
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PdserveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
