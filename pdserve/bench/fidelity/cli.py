"""``pdserve bench fidelity``: the planner's simulator against real clusters on this machine.

    pdserve bench fidelity --profile P --json fidelity.json --scale 2 --step-trace traces/
    pdserve bench fidelity --profile P --resimulate fidelity.json [--leave-one-out traces/]
    pdserve bench fidelity --profile P --calibrated-out P2.json [--calibrate-from R TRACES]
    pdserve bench fidelity --repeat first.json second.json

With no stored-run mode it runs real clusters (live.py); ``--resimulate``, ``--repeat`` and
``--calibrate-from`` work on stored runs with no cluster (stored.py).
"""

from __future__ import annotations

import os


def add_parser(sub) -> None:
    ap = sub.add_parser("fidelity", help="the planner's simulator against real clusters here")
    ap.add_argument("--profile", default=None, help="the profile (every mode but --repeat)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=1.0, help="x the requests per run")
    ap.add_argument(
        "--part",
        choices=("fidelity", "recommend", "all", "capacity"),
        default="all",
        help="capacity (not in all): each --shapes' 90%%-attainment capacity, measured by "
        "--sweeps rate sweeps, beside the planner's",
    )
    ap.add_argument("--shapes", nargs="+", default=["1P1D", "1P2D", "colo2"])
    ap.add_argument("--sweeps", type=int, default=3, help="--part capacity: sweeps per shape")
    ap.add_argument("--workload", default="mixed", help="--part capacity's workload")
    ap.add_argument("--slo-ttft", type=float, default=5.0, help="--part capacity (s)")
    ap.add_argument("--slo-tpot", type=float, default=0.1, help="--part capacity (s)")
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
    ap.add_argument(
        "--record-validation",
        action="store_true",
        help="with --resimulate: write the MAPE into the profile's record (meta.validation), "
        "which `pdserve plan` prints beside each figure it derives from the profile",
    )
    ap.set_defaults(func=lambda args: main(args, ap.error))


def main(args, error) -> int:
    """The mode the flags ask for; ``error`` reports a bad combination (argparse's)."""
    from pdserve.bench.fidelity import stored

    if args.repeat:
        try:
            return stored.compare_repeat(args)
        except ValueError as e:
            error(f"--repeat: {e}")
    if not args.profile:
        error("--profile is required")
    if args.leave_one_out and not args.resimulate:
        error("--leave-one-out needs --resimulate (a stored run and its step traces)")
    if args.calibrate_from and not (args.calibrated_out or args.leave_one_out):
        error("--calibrate-from needs --calibrated-out (where to write the profile)")
    from pdserve.bench.fidelity.setups import SLOS, embedded_tokenizer
    from pdserve.planner.profile import load_profile

    profile = load_profile(args.profile)
    if args.resimulate and args.part == "capacity":
        return stored.rescore_capacity_run(args, profile)
    try:
        if args.resimulate:
            return stored.rescore(args, profile, SLOS, embedded_tokenizer())
        if args.calibrated_out and args.calibrate_from:
            return stored.calibrate_from_runs(args, profile, embedded_tokenizer())
    except FileNotFoundError as e:  # a traces folder without the stored runs' traces
        error(f"--leave-one-out / --calibrate-from: {e}")
    from pdserve.bench.fidelity import live

    if args.part == "capacity":
        from pdserve.bench.fidelity.capacity import capacity_main

        return capacity_main(args, profile)
    if args.calibrated_out:
        return live.calibrate(args, profile)
    return live.live_report(args, profile)
