"""``pdserve bench fidelity``'s modes on stored runs, with no cluster: ``--resimulate``
(a stored run re-scored on another profile, optionally each run fitted on the others),
``--repeat`` (two runs of one seed against each other) and ``--calibrate-from`` (a profile
fitted on the step traces of stored runs)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from pdserve.bench.fidelity import stored_runs
from pdserve.bench.fidelity.fidelity_replay import (
    format_spread,
    load_report,
    repeat_spread,
    run_name,
)
from pdserve.bench.fidelity.stored_runs import format_mape, format_row


def rescore(args, profile, slos: dict, tokenizer) -> int:
    """A stored run's simulated side redone on ``profile`` (the measured side kept)."""
    stored = json.loads(Path(args.resimulate).read_text())
    seed = stored.get("seed", args.seed)  # the runs' own; older files: --seed
    report = stored_runs.rescored(
        stored, profile, slos, tokenizer, seed, args.leave_one_out,
        args.cpu_cores, args.calibrate_from or (),
    )  # fmt: skip
    for row in report["fidelity"] if args.leave_one_out else ():
        print(f"{run_name(row)}: calibrated on the others: {json.dumps(row['costs'])}")
    report.update(
        leave_one_out=args.leave_one_out,
        profile=args.profile,
        resimulated=time.strftime("%Y-%m-%d %H:%M:%S"),
        mape_as_stored=stored.get("mape"),  # the simulated side this replaced
    )
    for row in report["fidelity"]:
        print(format_row(row))
    print(format_mape(report["mape"]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if getattr(args, "record_validation", False):
        record_validation(args.profile, profile, report)
    return 0


def rescore_capacity_run(args, profile) -> int:
    """A stored ``--part capacity`` run's measured sweeps against ``profile``'s plan."""
    from pdserve.bench.fidelity.capacity import format_capacity, rescore_capacity

    stored = json.loads(Path(args.resimulate).read_text())
    if "capacity" not in stored:
        raise SystemExit(f"{args.resimulate}: not a --part capacity run")
    report = rescore_capacity(stored, profile, args.cpu_cores)
    print(format_capacity(report), flush=True)
    if args.json:
        out = {**stored, "capacity": report, "profile": args.profile}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def record_validation(path: str, profile, report: dict) -> None:
    """The profile with the MAPE a re-scoring measured as its ``meta.validation``: the error
    `pdserve plan` prints beside each figure (keys as the plan's: p50_ttft, ..., goodput)."""
    import dataclasses

    runs = len(report["fidelity"])
    how = "each fitted on the others" if report.get("leave_one_out") else "as calibrated"
    validation = {k.removesuffix("_ms"): v for k, v in report["mape"].items()}
    validation["how"] = (
        f"MAPE over {runs} live runs re-simulated {how} ({report['resimulated']}; "
        "pdserve bench fidelity --resimulate)"
    )
    meta = {**profile.meta, "validation": validation}
    dataclasses.replace(profile, meta=meta).save(path)
    print(f"recorded the validation in {path}: {json.dumps(validation)}")


def compare_repeat(args) -> int:
    """Two stored runs of the same requests (``--repeat FIRST SECOND``): the real cluster
    against itself, beside each simulation scored on the other run."""
    spread = repeat_spread(*(load_report(f) for f in args.repeat))
    print(format_spread(spread), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(spread, indent=1) + "\n")
    return 0


def calibrate_from_runs(args, profile, tokenizer) -> int:
    """The profile with the live costs fitted on every run of the stored fidelity JSONs (their
    step traces pooled, each at its probed speed), written to ``--calibrated-out``."""
    pooled, costs = stored_runs.pooled_profile(
        profile, args.calibrate_from, args.cpu_cores, tokenizer
    )
    pooled.save(args.calibrated_out)
    print(f"wrote {args.calibrated_out}: {json.dumps(costs)}")
    return 0
