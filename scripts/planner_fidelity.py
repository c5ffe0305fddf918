"""The planner's simulator against real clusters on this machine (docs/PLANNING.md).

Part 1, fidelity: for each setup (1P1D, 1P2D, colocated; embedded model, one torch thread per
worker, each worker its own process, as ``cluster_configs/local.yaml``) and two Poisson rates
(one low, one near the simulated saturation), a real cluster serves ``pdserve bench serve``'s
workload over HTTP with ``ignore_eos``; the simulator then replays the *same* requests (each
one's send time, prompt tokens from usage, output tokens) on the profile. Prints simulated vs
measured p50/p90 TTFT, p50 TPOT and goodput with their errors, and the MAPE per metric.

Part 2, the recommendation: for a long-prompt workload (longdoc) and a short-prompt,
long-answer one (chat), ``plan`` recommends a split up to ``--max-workers``; each candidate
split of that size is then run for real at the same rate, and the recommended split's measured
goodput is compared with the best measured one.

    python scripts/planner_fidelity.py --profile docs/results/planner/profile_cpu_smollm2.json \
        --json docs/results/planner/fidelity.json

``--resimulate FILE`` re-scores a stored run (its measured side kept, its requests rebuilt from
the seeded workload: pdserve/planner/fidelity_replay.py) on ``--profile``, with no cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import planner_fidelity_stored as stored_modes

from engine.step_trace import ENV_VAR as STEP_TRACE_ENV
from pdserve.bench.loadgen.metrics import SLO
from pdserve.bench.loadgen.serve import ServeConfig, run_benchmark
from pdserve.cluster.local import ClusterSpec, LocalCluster
from pdserve.planner.fidelity_replay import (
    METRICS,
    NONCE,
    err,
    mape,
    mape_of,
    per_request,
    replay,
    run_name,
    sent_requests,
    shared_prefix_tokens,
    summary,
)
from pdserve.planner.profile import load_profile
from pdserve.planner.sim import SimConfig, Split
from pdserve.planner.speed_probe import Speed
from pdserve.planner.step_residuals import (
    format_residuals,
    load_steps,
    priced_steps,
    step_residuals,
    summarise,
)
from pdserve.planner.stored_runs import format_mape, format_row, pooled_costs

# (split, workload, SLO). Rates: LOW and NEAR x the simulated capacity (highest rate at 90%).
# SLOs suit this VM: a 1,300-token document alone takes 2-4 s to prefill on one thread.
SETUPS = [
    ("1P1D", "mixed", SLO(10.0, 0.2)),
    ("1P2D", "chat", SLO(2.0, 0.15)),
    ("colo2", "mixed", SLO(10.0, 0.2)),
]
LOW, NEAR = 0.4, 0.85
# (workload, SLO, share of the recommended split's simulated capacity to run at)
RECOMMEND = [("longdoc", SLO(12.0, 0.2), 0.9), ("chat", SLO(2.0, 0.15), 0.9)]
FALLBACK_RATE = 0.1  # when the simulation holds no rate at 90%


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


def _run_real(split: Split, workload: str, rate: float, n: int, slo: SLO, seed: int):
    spec = ClusterSpec(
        num_prefill=split.num_prefill,
        num_decode=split.num_decode,
        threads_per_worker=1,
        separate_processes=True,
        http_port=0,
    )
    with LocalCluster(spec) as cluster:
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


@functools.cache
def embedded_tokenizer():
    """The router's tokenizer for the embedded model: the runs' prompt lengths come from it."""
    from engine.tokenizer import Tokenizer
    from pdserve.planner.measure import engine_dir

    return Tokenizer(engine_dir("embedded"))


@functools.cache
def shared_prefix(workload: str, nonce: str = NONCE) -> int:
    """The leading tokens a run's prompts share (its chat preamble and its nonce line), which
    the live workers' prefix caches serve after the first request."""
    return shared_prefix_tokens(workload, embedded_tokenizer(), nonce)


def sim_config(split: Split, workload: str, cores: int) -> SimConfig:
    return SimConfig(split, cpu_cores=cores, shared_prefix_tokens=shared_prefix(workload))


def sim_capacity(profile, split: Split, workload: str, slo: SLO, cores: int) -> float:
    from pdserve.planner.search import Evaluator, synthetic_workload

    wl = synthetic_workload(workload, 0, duration_s=200, min_requests=60, max_requests=600)
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


# A live run apart from the scored ones (another seed and rate) to measure the co-run slowdowns.
CALIBRATION = ("1P1D", "mixed", 0.5, 45, 7)  # split, workload, rate, requests, seed


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
            "bare_forwards": [profile.co_run_slowdown, profile.co_run_slowdown_prefill],
            "quiet_prefill_worker_slowdown": profile.prefill_worker_slowdown,
            "fit": "real = factor x (price + fixed_s), steps with a neighbour busy throughout",
        },
    }
    out = dataclasses.replace(profile, **costs, meta=meta)
    out.save(args.calibrated_out)
    print(f"wrote {args.calibrated_out}: {json.dumps(costs)}")
    return 0


def speed_probe(args, profile):
    """The probe the real runs are bracketed by, or None with ``--no-speed-probe``."""
    from pdserve.planner.speed_probe import SpeedProbe

    return None if args.no_speed_probe else SpeedProbe(profile)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default=None, help="the profile (every mode but --repeat)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=1.0, help="x the requests per run")
    ap.add_argument("--part", choices=("fidelity", "recommend", "all"), default="all")
    ap.add_argument("--max-workers", type=int, default=2, help="part 2's pool size")
    ap.add_argument("--cpu-cores", type=int, default=os.cpu_count(), help="cores the workers share")
    ap.add_argument("--resimulate", default=None, help="a stored fidelity JSON to re-score")
    ap.add_argument(
        "--calibrated-out",
        default=None,
        help="run the live calibration only and write the profile with its co-run slowdowns",
    )
    ap.add_argument(
        "--calibrate-from",
        nargs=2,
        action="append",
        default=None,
        metavar=("STORED", "TRACES"),
        help="with --calibrated-out: fit the live costs on every run of a stored fidelity JSON "
        "(and its step traces) instead of running a calibration run; repeat to pool several. "
        "With --leave-one-out: these runs join the other runs each scored run is fitted on",
    )
    ap.add_argument(
        "--workloads", nargs="+", default=None, help="part 2: only these of longdoc, chat"
    )
    ap.add_argument(
        "--step-trace", default=None, help="folder for the real workers' step traces (part 1)"
    )
    ap.add_argument(
        "--no-speed-probe",
        action="store_true",
        help="simulate on the profile as measured, not rescaled by a bare-engine probe of the "
        "machine's speed just before and after each real run",
    )
    ap.add_argument(
        "--repeat",
        nargs=2,
        default=None,
        metavar=("FIRST", "SECOND"),
        help="two stored runs of the same requests (same --seed, one after the other): print "
        "how far the real cluster lands from itself, the floor a run's MAPE is read against",
    )
    ap.add_argument(
        "--leave-one-out",
        default=None,
        metavar="TRACES",
        help="with --resimulate: simulate each run on live costs calibrated from the step "
        "traces (this folder, as --step-trace wrote it) of the other runs",
    )
    return ap


def main() -> int:
    ap = build_parser()
    args = ap.parse_args()
    if args.repeat:
        try:
            return stored_modes.compare_repeat(args)
        except ValueError as e:
            ap.error(f"--repeat: {e}")
    if not args.profile:
        ap.error("--profile is required")
    if args.leave_one_out and not args.resimulate:
        ap.error("--leave-one-out needs --resimulate (a stored run and its step traces)")
    profile = load_profile(args.profile)
    if args.calibrate_from and not (args.calibrated_out or args.leave_one_out):
        ap.error("--calibrate-from needs --calibrated-out (where to write the profile)")
    try:
        if args.resimulate:
            slos = {workload: slo for _, workload, slo in SETUPS}
            return stored_modes.rescore(args, profile, slos, embedded_tokenizer())
        if args.calibrated_out and args.calibrate_from:
            return stored_modes.calibrate_from_runs(args, profile, embedded_tokenizer())
    except FileNotFoundError as e:  # a traces folder without the stored runs' traces
        ap.error(f"--leave-one-out / --calibrate-from: {e}")
    if args.calibrated_out:
        return calibrate(args, profile)
    return live_report(args, profile)


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


if __name__ == "__main__":
    sys.exit(main())
