"""``pdserve bench cpu-costs``: a small machine's CPU corrections that need a live router or a
live worker pair, measured into an existing profile (its tables kept).

- the router's and its client's CPU per request and per streamed token, and the decode
  worker's gRPC threads' per token (measure_router.py): on a machine of a few cores they run
  on the workers' cores;
- a disaggregated prefill worker's prefill steps over the bare engine's (measure_live.py):
  the worker builds and ships KV frames on the cores its forward uses.

    pdserve bench cpu-costs --profile P [--config cluster.yaml] [--skip-live-prefill]
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time


def add_parser(sub) -> None:
    p = sub.add_parser("cpu-costs", help="router CPU and live prefill slowdown into a profile")
    p.add_argument("--profile", required=True, help="the profile to update in place")
    p.add_argument("--config", default=None, help="cluster YAML (default: the embedded one)")
    p.add_argument("--model", default=None, help="override the config's model")
    p.add_argument(
        "--skip-live-prefill", action="store_true", help="only the router's CPU (no live pair)"
    )
    p.set_defaults(func=cmd_cpu_costs)


def live_prefill_slowdown(cfg, profile) -> tuple[float, dict]:
    """The median of a live prefill worker's prefill seconds over the bare engine's at the
    same lengths, and the pairs {tokens: {live_s, bare_s}} it comes from."""
    import torch

    from engine.llm_engine import build_engine
    from pdserve.bench.fidelity.measure_live import live_prefill_seconds
    from pdserve.planner.measure import QUICK, WorkerTimer

    # The live worker runs the profile's threads, as the bare engine below does: this process's
    # own count (every core, until an engine here sets it) made the live worker faster than
    # the table it is compared with (0.73x on 2 cores, one thread profiled).
    live = live_prefill_seconds(cfg, profile.engine.threads or torch.get_num_threads())
    engine = build_engine(dataclasses.replace(profile.engine, num_blocks=64))
    timer = WorkerTimer(engine, dataclasses.replace(QUICK, reps=3))  # the full grid's repeats
    pairs = {n: {"live_s": s, "bare_s": timer.prefill(n, 0)} for n, s in live.items()}
    return statistics.median(p["live_s"] / p["bare_s"] for p in pairs.values()), pairs


def cmd_cpu_costs(args) -> int:
    from pdserve.bench.fidelity.measure_router import measure_router_cpu
    from pdserve.config import load_config
    from pdserve.planner.measure import engine_dir
    from pdserve.planner.profile import load_profile

    cfg = load_config(args.config)
    if args.model:
        cfg = cfg.with_overrides(model=args.model)
    profile = load_profile(args.profile)
    cpu = measure_router_cpu(str(engine_dir(cfg.model)))
    costs = {
        "router_cpu_per_request_s": cpu.per_request_s,
        "router_cpu_per_token_s": cpu.per_token_s,
        "stream_cpu_per_token_s": cpu.worker_per_token_s,
    }
    record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average": os.getloadavg()[0]}
    if not args.skip_live_prefill:
        costs["prefill_worker_slowdown"], record["live_prefill"] = live_prefill_slowdown(
            cfg, profile
        )
    meta = {**profile.meta, "cpu_costs": record}
    dataclasses.replace(profile.with_cpu(**costs), meta=meta).save(args.profile)
    print(f"wrote {args.profile}: " + ", ".join(f"{k} {v:.4g}" for k, v in costs.items()))
    return 0
