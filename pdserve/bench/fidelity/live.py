"""``pdserve bench fidelity`` on real clusters on this machine (docs/PLANNING.md).

Part 1, fidelity: for each setup (1P1D, 1P2D, colocated; embedded model, one torch thread per
worker, each worker its own process, as ``cluster_configs/local.yaml``) and two Poisson rates
(one low, one near the simulated saturation), a real cluster serves ``pdserve bench serve``'s
workload over HTTP with ``ignore_eos``; the simulator then replays the *same* requests (each
one's send time, prompt tokens from usage, output tokens) on the profile. Reports simulated vs
measured p50/p90 TTFT, p50 TPOT and goodput with their errors, and the MAPE per metric.

Part 2, the recommendation: for a long-prompt workload (longdoc) and a short-prompt,
long-answer one (chat), ``plan`` recommends a split up to ``--max-workers``; each candidate
split of that size is then run for real at the same rate, and the recommended split's measured
goodput is compared with the best measured one.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

from engine.step_trace import ENV_VAR as STEP_TRACE_ENV
from pdserve.bench.fidelity.fidelity_replay import (
    METRICS,
    NONCE,
    err,
    mape,
    mape_of,
    per_request,
    replay,
    run_name,
    sent_requests,
    summary,
)
from pdserve.bench.fidelity.setups import (
    CALIBRATION,
    FALLBACK_RATE,
    LOW,
    NEAR,
    RECOMMEND,
    SETUPS,
    shared_prefix,
)
from pdserve.bench.fidelity.speed_probe import Speed
from pdserve.bench.fidelity.step_residuals import (
    format_residuals,
    load_steps,
    priced_steps,
    step_residuals,
    summarise,
)
from pdserve.bench.fidelity.stored_runs import format_mape, format_row, pooled_costs
from pdserve.bench.loadgen.serve import ServeConfig, run_benchmark
from pdserve.cluster.local import ClusterSpec, LocalCluster
from pdserve.metrics import SLO
from pdserve.planner.sim import SimConfig, Split


def run_real(split: Split, workload: str, rate: float, n: int, slo: SLO, seed: int, trace=None):
    """One real cluster serving the workload; ``trace``: a folder its workers write their step
    traces to (engine/step_trace.py; the workers inherit the variable, this process's own
    simulations do not see it)."""
    if trace is not None:
        os.environ[STEP_TRACE_ENV] = str(trace)
    try:
        return _run_real(split, workload, rate, n, slo, seed)
    finally:
        os.environ.pop(STEP_TRACE_ENV, None)


def real_cluster_spec(split: Split) -> ClusterSpec:
    """The real cluster a run of ``split`` serves on: the embedded model, one torch thread per
    worker, each worker its own process."""
    return ClusterSpec(
        num_prefill=split.num_prefill,
        num_decode=split.num_decode,
        threads_per_worker=1,
        separate_processes=True,
        http_port=0,
        # The policies the simulation runs (SimConfig's, load-based: its workers keep no KV
        # index), not the router's default kv_aware, so real and simulated route alike.
        prefill_policy=SimConfig.prefill_policy,
        decode_policy=SimConfig.decode_policy,
    )


def serve_on(cluster: LocalCluster, workload: str, rate: float, n: int, slo: SLO, seed: int):
    """``n`` requests of ``workload`` at ``rate`` (Poisson, ``ignore_eos``) on a running cluster."""
    cfg = ServeConfig(
        url=f"http://{cluster.http_address}",
        workload=workload,
        num_requests=n,
        rate=rate,
        seed=seed,
        slo=slo,
        warmup=2,
        ignore_eos=True,
        progress=False,
    )
    return asyncio.run(run_benchmark(cfg))


def _run_real(split: Split, workload: str, rate: float, n: int, slo: SLO, seed: int):
    with LocalCluster(real_cluster_spec(split)) as cluster:
        return serve_on(cluster, workload, rate, n, slo, seed)


def sim_config(split: Split, workload: str, cores: int) -> SimConfig:
    return SimConfig(split, cpu_cores=cores, shared_prefix_tokens=shared_prefix(workload))


def sim_capacity(profile, split: Split, workload: str, slo: SLO, cores: int, seed=0) -> float:
    from pdserve.planner.search import Evaluator, synthetic_workload

    wl = synthetic_workload(workload, seed, duration_s=200, min_requests=60, max_requests=600)
    return Evaluator(profile, wl, slo, sim_config(split, workload, cores)).capacity(split, 0.5)


def probed_run(
    probe, split: Split, workload: str, rate: float, n: int, slo: SLO, seed: int, trace=None
):
    """A real run between two speed probes (None: not probed): the result and the speeds."""
    before = probe.measure() if probe else None
    real = run_real(split, workload, rate, n, slo, seed, trace)
    after = probe.measure() if probe else None
    if probe is None:
        return real, None
    speed = {"before": before.to_dict(), "after": after.to_dict()}
    speed["used"] = Speed.mean([before, after]).to_dict()
    print(f"  speed against the profile: {speed}", flush=True)
    return real, speed


def fidelity(profile, seed: int, scale: float, cores: int, traces=None, probe=None) -> list[dict]:
    rows = []
    for label, workload, slo in SETUPS:
        split = Split.parse(label)
        cap = sim_capacity(profile, split, workload, slo, cores) or FALLBACK_RATE / LOW
        print(f"{label} {workload}: simulated capacity {cap:.3g} req/s", flush=True)
        for rate in (round(LOW * cap, 2), round(NEAR * cap, 2)):
            n = max(30, int(rate * 60 * scale))
            started = time.time()
            name = run_name({"split": label, "workload": workload, "rate": rate})
            trace_dir = Path(traces) / name if traces else None
            real, speed = probed_run(probe, split, workload, rate, n, slo, seed, trace_dir)
            if real.completed < n:
                print(f"  {label} @ {rate}: {real.failed} failed: {real.errors[:2]}", flush=True)
            trace = sent_requests(real, rate, seed, n)
            nonce = real.meta.get("nonce") or NONCE
            shared = shared_prefix(workload, nonce)
            now = profile.at_speed(**speed["used"]) if speed else profile
            sim = replay(now, split, trace, slo, cores, shared)
            row = {
                "load_average": os.getloadavg()[0],
                "split": label,
                "workload": workload,
                "rate": rate,
                "requests": n,
                "nonce": nonce,  # --resimulate rebuilds the prompts with it
                "speed": speed,
                "real": summary(real),
                "sim": summary(sim),
                "wall_s": time.time() - started,
            }
            row["error"] = {m: err(row["sim"][m], row["real"][m]) for m in METRICS}
            if speed:  # the same requests on the profile as measured, for the record
                row["sim_as_profiled"] = summary(replay(profile, split, trace, slo, cores, shared))
            row["per_request"] = {"real": per_request(real), "sim": per_request(sim)}
            rows.append(row)
            print(format_row(row), flush=True)
            if trace_dir is not None:  # each real step against the profile's price for it
                row["steps"] = step_residuals(now, trace_dir)
                print(format_residuals(row["steps"]), flush=True)
    return rows


def recommendation(
    profile, seed: int, max_workers: int, scale: float, cores: int, only=None
) -> list[dict]:
    from pdserve.planner.search import candidate_splits, plan, recommend, synthetic_workload

    out = []
    for workload, slo, share in RECOMMEND:
        if only and workload not in only:
            continue
        wl = synthetic_workload(workload, seed, duration_s=200, min_requests=60, max_requests=600)
        base = sim_config(Split(1, 1), workload, cores)
        # Plan at a low rate first to find the best split, then check it at 90% of its capacity.
        # Only splits of exactly max_workers are run for real, so only they compete here.
        first = plan(profile, wl, 0.1, slo, max_workers, base, curve_points=2)
        sized = [r for r in first.results if r.split.workers == max_workers]
        rate = round(share * recommend(sized, 0.1)[0].capacity, 2) or FALLBACK_RATE
        p = plan(profile, wl, rate, slo, max_workers, base, curve_points=2)
        chosen, _ = recommend([r for r in p.results if r.split.workers == max_workers], rate)
        splits = [s for s in candidate_splits(max_workers) if s.workers == max_workers]
        measured = {}
        for split in splits:
            n = max(30, int(rate * 60 * scale))
            measured[split.label] = summary(run_real(split, workload, rate, n, slo, seed))
            print(f"  {workload} {split.label}: {measured[split.label]}", flush=True)
        best = max(measured, key=lambda k: measured[k]["goodput"])
        rec = chosen.split.label
        got = measured.get(rec, {}).get("goodput")
        out.append(
            {
                "workload": workload,
                "rate": rate,
                "recommended": rec,
                "best_measured": best,
                "measured": measured,
                "ratio": got / measured[best]["goodput"]
                if got is not None and measured[best]["goodput"]
                else None,
            }
        )
        print(
            f"{workload}: recommended {rec}, best measured {best}, ratio {out[-1]['ratio']}",
            flush=True,
        )
    return out


def calibrate(args, profile) -> int:
    """Set the profile's live costs from the step traces of one live 1P1D run
    (stored_runs.pooled_costs over that one run: each role's alone slowdown, then a co-run factor and a
    once-per-step work for each kind) and write it to ``--calibrated-out``."""
    import dataclasses

    label, workload, rate, n, seed = CALIBRATION
    folder = Path(args.step_trace or "step_traces") / f"calibration_{label}_{workload}_{rate}"
    slo = {w: s for _, w, s in SETUPS}[workload]
    probe = speed_probe(args, profile)
    _, speed = probed_run(probe, Split.parse(label), workload, rate, n, slo, seed, folder)
    used = Speed(**speed["used"]) if speed else Speed()
    # Fitted against the prices at the run's speed, so the fields hold at any speed; the fixed
    # work comes back at the profile's speed, as at_speed scales it (pooled_costs of one run).
    at = (used.decode, used.prefill, used.prefill_small)
    rows = priced_steps(profile.at_speed(*at), load_steps(folder))
    print(format_residuals(summarise(rows)), flush=True)
    costs = pooled_costs(profile, [(folder, *at)], args.cpu_cores)
    meta = {
        **profile.meta,
        "co_run": {
            "source": f"step traces of a live {label} {workload} run at {rate} req/s, seed {seed}",
            "speed": speed,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "load_average": os.getloadavg()[0],
            "bare_forwards": [profile.cpu.co_run_slowdown, profile.cpu.co_run_slowdown_prefill],
            "quiet_prefill_worker_slowdown": profile.cpu.prefill_worker_slowdown,
            "fit": "real = factor x (price + fixed_s), steps with a neighbour busy throughout",
        },
    }
    out = dataclasses.replace(profile.with_cpu(**costs), meta=meta)
    out.save(args.calibrated_out)
    print(f"wrote {args.calibrated_out}: {json.dumps(costs)}")
    return 0


def speed_probe(args, profile):
    """The probe the real runs are bracketed by, or None with ``--no-speed-probe``."""
    from pdserve.bench.fidelity.speed_probe import SpeedProbe

    return None if args.no_speed_probe else SpeedProbe(profile)


def live_report(args, profile) -> int:
    """Parts 1 and 2 on real clusters (``--part``), written to ``--json``."""
    report: dict = {
        "profile": args.profile,
        "cpu_cores": args.cpu_cores,
        "seed": args.seed,  # --resimulate rebuilds the runs' requests from it
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load_average_at_start": os.getloadavg(),
    }
    if args.part in ("fidelity", "all"):
        rows = fidelity(
            profile, args.seed, args.scale, args.cpu_cores, args.step_trace,
            speed_probe(args, profile),
        )  # fmt: skip
        report["fidelity"], report["mape"] = rows, mape(rows)
        print(format_mape(report["mape"]), flush=True)
        if all(r.get("sim_as_profiled") for r in rows):
            report["mape_as_profiled"] = mape_of(rows, "sim_as_profiled")
            label = "MAPE on the profile as measured"
            print(format_mape(report["mape_as_profiled"], label), flush=True)
    if args.part in ("recommend", "all"):
        report["recommendation"] = recommendation(
            profile, args.seed, args.max_workers, args.scale, args.cpu_cores, args.workloads
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0
