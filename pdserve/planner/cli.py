"""``pdserve profile`` and ``pdserve plan``: argument parsing and checks (a bad argument is
named by argparse: ``argument --rate: must be > 0``)."""

from __future__ import annotations

import argparse
import sys
import time


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def workload_spec(text: str) -> str:
    from pdserve.planner.workload import parse_lengths

    try:
        parse_lengths(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_profile(sub) -> None:
    from engine.args import device_name
    from engine.config import LOAD_FORMATS

    p = sub.add_parser("profile", help="measure one worker's latencies here (for `plan`)")
    p.add_argument("--config", default=None, help="cluster YAML (default: the embedded local one)")
    p.add_argument("--device", type=device_name, default="cpu", help="cpu, cuda[:N], or auto")
    p.add_argument("--model", default=None, help="override the config's model")
    p.add_argument(
        "--load-format",
        choices=LOAD_FORMATS,
        default=None,
        help="dummy: random weights from the model folder's config.json (a shape's timings)",
    )
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--quick", action="store_true", help="a tiny grid (tests, tiny models)")
    p.add_argument("--skip-router", action="store_true", help="assume 2 ms for the router")
    p.add_argument(
        "--cpu-costs-only",
        action="store_true",
        help="measure only the sampling cost, into the existing profile at --out (the router's "
        "CPU on a shared machine: `pdserve bench cpu-costs`)",
    )
    p.add_argument(
        "--cpu-corrections",
        action="store_true",
        help="on CPU, also measure how much slower a step runs beside another worker process "
        "(workers sharing this machine's cores); default: the tables only",
    )
    p.add_argument(
        "--time-budget",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="measure within about this long: a coarse grid first, then the rows where the "
        "latency curve bends (the record lists what was measured and skipped)",
    )
    p.add_argument("--no-progress", action="store_true")
    from pdserve.planner.sweep_import import add_import_args

    add_import_args(p)
    p.set_defaults(func=cmd_profile)


def cmd_cpu_costs(args, cfg) -> int:
    """Re-measure a profile's sampling cost and keep its tables."""
    import dataclasses
    import os

    from engine.llm_engine import build_engine
    from pdserve.planner.measure import measure_sample_cost
    from pdserve.planner.profile import load_profile

    try:
        prof = load_profile(args.out)
    except ValueError as e:
        print(f"pdserve profile: error: argument --out: {e}", file=sys.stderr)
        return 2
    engine = build_engine(dataclasses.replace(prof.engine, num_blocks=64))
    sample_s = measure_sample_cost(engine)
    meta = {
        **prof.meta,
        "cpu_costs": {
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "load_average": os.getloadavg()[0],
        },
    }
    dataclasses.replace(prof, sample_seconds_per_row=sample_s, meta=meta).save(args.out)
    print(f"wrote {args.out}: sample_seconds_per_row {sample_s * 1e3:.3f} ms")
    return 0


def cmd_profile(args) -> int:
    from pdserve.config import load_config
    from pdserve.planner.measure import run_profile

    if args.from_sweep:
        from pdserve.planner.sweep_import import cmd_import

        return cmd_import(args)
    cfg = load_config(args.config)
    if args.model:
        cfg = cfg.with_overrides(model=args.model)
    if args.load_format:
        cfg = cfg.with_overrides(load_format=args.load_format)
    if args.cpu_costs_only:
        return cmd_cpu_costs(args, cfg)
    if args.cpu_corrections and args.device != "cpu":
        print("pdserve profile: error: --cpu-corrections: only with --device cpu", file=sys.stderr)
        return 2
    started = time.time()
    prof = run_profile(
        cfg,
        args.device,
        args.quick,
        args.skip_router,
        not args.no_progress,
        args.cpu_corrections,
        args.time_budget,
    )
    prof.save(args.out)
    e = prof.engine
    print(
        f"wrote {args.out} ({time.time() - started:.0f} s): prefill {e.max_num_batched_tokens} "
        f"tokens {prof.prefill_seconds(e.max_num_batched_tokens) * 1e3:.1f} ms, decode step "
        f"(batch 1) {prof.decode_seconds(1, 256) * 1e3:.1f} ms, router "
        f"{prof.router_overhead_s * 1e3:.2f} ms"
    )
    return 0


def add_plan(sub) -> None:
    from pdserve.planner.cli_size import add_sizing_args

    p = sub.add_parser("plan", help="which prefill:decode split a workload needs (simulated)")
    p.add_argument(
        "--profile",
        action="append",
        default=None,
        help="from `pdserve profile`, or hand-written; repeat to size several worker shapes",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--workload",
        type=workload_spec,
        help="chat | longdoc | mixed | longprompt | longoutput | P_LO-P_HI/O_LO-O_HI (tokens)",
    )
    src.add_argument("--trace", help="JSONL of {arrival_s, prompt_tokens, output_tokens}")
    p.add_argument(
        "--rate",
        type=positive_float,
        default=None,
        help="target req/s (a trace's own rate by default)",
    )
    p.add_argument("--slo-ttft", type=positive_float, default=None, help="seconds")
    p.add_argument("--slo-tpot", type=positive_float, default=None, help="seconds")
    p.add_argument(
        "--max-workers",
        type=positive_int,
        default=None,
        help="search every split up to this many workers (without it: the fewest devices for "
        "--rate, or the most goodput within --budget)",
    )
    p.add_argument("--out", default=None, help="folder for plan.txt/json and the PNG plots")
    p.add_argument(
        "--unit-max",
        type=positive_int,
        default=None,
        help="past this many workers, search units up to it and replicate them",
    )
    p.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    p.add_argument("--cv", type=positive_float, default=1.0, help="gamma arrivals' burstiness")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--duration",
        type=positive_float,
        default=300.0,
        help="simulated seconds per probe (more requests at higher rates)",
    )
    p.add_argument("--max-requests", type=positive_int, default=4000)
    # Not the router's defaults (kv_aware): the simulated workers keep no KV index, so kv_aware
    # would fall back to a load-only cost nobody calibrated; the planner simulates the load-based
    # policies its fidelity runs were measured with (as SimConfig's defaults).
    p.add_argument("--prefill-policy", default="least_queued")
    p.add_argument("--decode-policy", default="most_free_blocks")
    p.add_argument("--local-prefill-max-tokens", type=int, default=0)
    p.add_argument("--decode-num-blocks", type=positive_int, default=None)
    p.add_argument(
        "--cpu-cores",
        type=positive_int,
        default=None,
        help="workers share this many cores (one small machine); default: own hardware",
    )
    p.add_argument(
        "--temperature",
        type=non_negative_float,
        default=1.0,
        help="the clients' sampling temperature (OpenAI's default 1; 0: greedy)",
    )
    p.add_argument(
        "--shared-prefix-tokens",
        type=non_negative_int,
        default=0,
        help="leading tokens every prompt shares (system prompt, chat template): served from "
        "the workers' prefix caches",
    )
    add_sizing_args(p, positive_float, positive_int)
    p.set_defaults(func=cmd_plan)


def _plan_inputs(args, parser_error):
    from pdserve.planner.profile import load_profile
    from pdserve.planner.search import synthetic_workload, trace_workload
    from pdserve.planner.workload import read_trace
    from router.policies import get_policy

    if args.max_workers is not None and args.slo_ttft is None and args.slo_tpot is None:
        parser_error("give --slo-ttft and/or --slo-tpot")
    for kind, name in (("prefill", args.prefill_policy), ("decode", args.decode_policy)):
        try:
            get_policy(kind, name)
        except ValueError as e:
            parser_error(f"argument --{kind}-policy: {e}")
    prof = None
    if args.max_workers is not None:
        if not args.profile or len(args.profile) > 1:
            parser_error("argument --profile: the split search (--max-workers) takes one")
        try:
            prof = load_profile(args.profile[0])
        except ValueError as e:
            parser_error(f"argument --profile: {e}")
    sizes = {"duration_s": args.duration, "max_requests": args.max_requests}
    if args.trace:
        try:
            trace = read_trace(args.trace)
        except ValueError as e:
            parser_error(f"argument --trace: {e}")
        rate = args.rate
        if rate is None:
            span = max(r.arrival_s for r in trace) - min(r.arrival_s for r in trace)
            if span <= 0:
                parser_error("argument --rate: the trace has no rate of its own; give one")
            rate = (len(trace) - 1) / span
        return prof, trace_workload(trace, **sizes), rate
    if args.rate is None:
        parser_error("argument --rate: required with --workload")
    return (
        prof,
        synthetic_workload(args.workload, args.seed, args.arrival, args.cv, **sizes),
        args.rate,
    )


def cmd_plan(args) -> int:
    from pdserve.metrics import SLO
    from pdserve.planner.report import format_plan, write_report
    from pdserve.planner.search import plan
    from pdserve.planner.sim import SimConfig, Split

    def error(msg: str):
        print(f"pdserve plan: error: {msg}", file=sys.stderr)
        raise SystemExit(2)

    prof, workload, rate = _plan_inputs(args, error)
    if args.budget is not None and args.max_workers is not None:
        error("argument --budget: not with --max-workers (the split search)")
    base = SimConfig(
        Split(1, 1),
        decode_num_blocks=args.decode_num_blocks,
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
        cpu_cores=args.cpu_cores,
        temperature=args.temperature,
        shared_prefix_tokens=args.shared_prefix_tokens,
    )
    if args.max_workers is None:
        from pdserve.planner.cli_size import cmd_size

        return cmd_size(args, base, workload, rate, error)
    started = time.time()
    result = plan(
        prof,
        workload,
        rate,
        SLO(args.slo_ttft, args.slo_tpot),
        args.max_workers,
        base,
        progress=lambda label: print(f"  simulated {label}", file=sys.stderr),
        unit_max=args.unit_max,
    )
    from pdserve.planner.sizing_report import trust_line

    print(format_plan(result))
    print(trust_line(prof))
    if args.out:
        for path in write_report(result, args.out):
            print(f"wrote {path}")
    print(f"({time.time() - started:.0f} s)", file=sys.stderr)
    return 0


def add_trace(sub) -> None:
    p = sub.add_parser(
        "trace", help="record a live cluster's requests (lengths, lifetimes) as a plan trace"
    )
    p.add_argument("--url", required=True, help="the router's HTTP API, e.g. http://127.0.0.1:8000")
    p.add_argument("--out", required=True, help="JSONL trace to write")
    p.add_argument("--host", default="127.0.0.1", help="where clients reach the recorder")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--duration", type=positive_float, default=None, help="stop after seconds")
    p.set_defaults(func=cmd_trace)


def cmd_trace(args) -> int:
    from pdserve.planner.trace_proxy import serve

    return serve(args.url, args.out, args.host, args.port, args.duration)


def register(sub) -> None:
    add_profile(sub)
    add_plan(sub)
    add_trace(sub)
