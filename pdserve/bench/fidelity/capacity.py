"""``pdserve bench fidelity --part capacity``: each shape's 90%-attainment capacity, measured by
rate sweeps of real clusters on this machine, beside the planner's for the same shape.

For each sweep (seed 1, 2, ...) and each shape (in an order rotated per sweep, so that the
machine's drift falls on every shape alike), one real cluster (live.real_cluster_spec) serves
the workload at Poisson rates stepped up or down from a start until 90% attainment is bracketed,
then once between; the sweep's capacity is the rate where the attainment's line between the
bracketing rates crosses 90%. The planner's capacity is the
one ``pdserve plan`` finds on the profile as stored (planner_capacities), for simulation seeds
0, 1, 2: its seed-0 figure is what ``plan`` prints. The check (issue 53): the planner's capacity
within 10% of each shape's measured median, or within the measured spread where that is wider,
and the shapes ranked alike. ``--resimulate RUN.json`` scores a stored run's sweeps against
another profile, with no cluster.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from pdserve.metrics import SLO
from pdserve.planner.sim import Split

TARGET = 0.9  # attainment at capacity
START = 0.8  # x the planner's capacity: a shape's first sweep starts there (later ones at the
# median of its sweeps so far)
STEP_UP, STEP_DOWN, MAX_STEPS = 1.2, 0.8, 5  # until 90% is bracketed
RUN_S = 45.0  # each rate's requests span about this long
MIN_REQUESTS = 40
TOLERANCE = 0.10


def interpolated_capacity(points: list[tuple[float, float]], target: float = TARGET):
    """The rate where attainment crosses ``target``, on the line between the last rate that
    held and the first (ascending) that did not, above the lowest rate that held (a noisy miss
    below it does not count); None where no rate or every rate held. ``points``: (rate,
    attainment) pairs, any order."""
    points = sorted(points)
    first_held = next((i for i, (_, a) in enumerate(points) if a >= target), None)
    if first_held is None:
        return None
    for i in range(first_held + 1, len(points)):
        rate, att = points[i]
        if att < target:
            r0, a0 = points[i - 1]
            return r0 + (a0 - target) / (a0 - att) * (rate - r0)
    return None


def bracketed(points: list[tuple[float, float]], target: float = TARGET) -> bool:
    """A rate held and a higher one did not."""
    return interpolated_capacity(points, target) is not None


def verdict(predicted: float, measured: list[float]) -> dict:
    """How the planner's capacity stands against a shape's measured sweeps."""
    median = statistics.median(measured)
    spread = (max(measured) - min(measured)) / median
    error = predicted / median - 1
    return {
        "predicted": predicted,
        "measured": measured,
        "median": median,
        "spread": spread,
        "error": error,
        "within": abs(error) <= max(TOLERANCE, spread),
    }


def ranking(capacities: dict[str, float]) -> list[str]:
    return sorted(capacities, key=capacities.get, reverse=True)


def sweep_shape(cluster, split: Split, workload: str, slo: SLO, seed: int, start: float):
    """One sweep on a running cluster: from ``start``, up by STEP_UP while 90% holds or down by
    STEP_DOWN until it does, then once between the bracketing rates. Its (rate, attainment,
    summary) rows, ascending rates."""
    from pdserve.bench.fidelity.fidelity_replay import summary
    from pdserve.bench.fidelity.live import serve_on

    rows: list[dict] = []

    def run(rate: float) -> None:
        rate = round(rate, 3)
        n = max(MIN_REQUESTS, round(rate * RUN_S))
        began = time.time()
        res = summary(serve_on(cluster, workload, rate, n, slo, seed))
        rows.append({"rate": rate, "requests": n, **res, "wall_s": time.time() - began})
        rows[-1]["load_average"] = os.getloadavg()[0]
        print(
            f"  {split.label} seed {seed} @ {rate:g} req/s: attainment {res['attainment']:.1%} "
            f"({n} requests, p90 TTFT {res['p90_ttft_ms']:.0f} ms, p50 TPOT "
            f"{res['p50_tpot_ms']:.0f} ms, load {rows[-1]['load_average']:.1f})",
            flush=True,
        )

    def points() -> list[tuple[float, float]]:
        return [(r["rate"], r["attainment"]) for r in rows]

    run(start)
    for _ in range(MAX_STEPS):
        if bracketed(points()):
            break
        held = [r for r, a in points() if a >= TARGET]
        run(max(held) * STEP_UP if held else min(r for r, _ in points()) * STEP_DOWN)
    if bracketed(points()):  # once more between the rates that bracket 90%
        ordered = sorted(points())
        first_held = next(i for i, (_, a) in enumerate(ordered) if a >= TARGET)
        i = next(i for i in range(first_held + 1, len(ordered)) if ordered[i][1] < TARGET)
        run((ordered[i - 1][0] + ordered[i][0]) / 2)
    return sorted(rows, key=lambda r: r["rate"])


def planner_capacities(profile, labels, workload: str, slo: SLO, cores: int) -> dict:
    """Each shape's capacity as ``pdserve plan`` finds it (its default probes: 300 simulated
    seconds, at least 200 requests), for simulation seeds 0, 1, 2: seed 0 is what ``plan``
    prints. Simulated as the real runs serve (live.sim_config: their routing, their cores,
    their shared chat preamble)."""
    from pdserve.bench.fidelity.live import sim_config
    from pdserve.planner.search import Evaluator, synthetic_workload

    out = {}
    for label in labels:
        split = Split.parse(label)
        cfg = sim_config(split, workload, cores)
        out[label] = [
            Evaluator(profile, synthetic_workload(workload, k), slo, cfg).capacity(split, 0.5)
            for k in range(3)
        ]
    return out


def capacity_report(profile, shapes, workload: str, slo: SLO, sweeps: int, cores: int) -> dict:
    """Every shape's sweeps and the planner's capacities; the verdicts and the two rankings."""
    from pdserve.bench.fidelity.live import real_cluster_spec
    from pdserve.cluster.local import LocalCluster

    splits = [Split.parse(s) for s in shapes]
    planned = planner_capacities(profile, shapes, workload, slo, cores)
    print(f"planner capacity (simulation seeds 0, 1, 2): {planned}", flush=True)
    sweeps_of: dict[str, list] = {s.label: [] for s in splits}
    for k in range(sweeps):
        seed = k + 1
        for split in splits[k % len(splits) :] + splits[: k % len(splits)]:
            with LocalCluster(real_cluster_spec(split)) as cluster:
                done = [r["capacity"] for r in sweeps_of[split.label] if r["capacity"]]
                start = statistics.median(done) if done else START * planned[split.label][0]
                rows = sweep_shape(cluster, split, workload, slo, seed, start)
            cap = interpolated_capacity([(r["rate"], r["attainment"]) for r in rows])
            print(f"{split.label} seed {seed}: measured capacity {cap}", flush=True)
            sweeps_of[split.label].append({"seed": seed, "capacity": cap, "rates": rows})
    report = {"workload": workload, "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}}
    return scored({**report, "sweeps": sweeps_of}, planned)


def scored(report: dict, planned: dict) -> dict:
    """``report``'s measured sweeps against ``planned`` (label: capacities, seed 0 first): the
    verdicts and the two rankings."""
    verdicts = {}
    for label, runs in report["sweeps"].items():
        caps = [r["capacity"] for r in runs if r["capacity"] is not None]
        if caps:
            verdicts[label] = verdict(planned[label][0], caps)
    measured_rank = ranking({k: v["median"] for k, v in verdicts.items()})
    planned_rank = ranking({k: v["predicted"] for k, v in verdicts.items()})
    return {
        **report,
        "planned": planned,
        "verdicts": verdicts,
        "measured_ranking": measured_rank,
        "planned_ranking": planned_rank,
        "ranking_matches": measured_rank == planned_rank,
    }


def rescore_capacity(stored: dict, profile, cores: int) -> dict:
    """A stored ``--part capacity`` run's sweeps against another profile's plan (no cluster)."""
    report = stored["capacity"]
    slo = SLO(report["slo"]["ttft_s"], report["slo"]["tpot_s"])
    planned = planner_capacities(profile, list(report["sweeps"]), report["workload"], slo, cores)
    return scored(report, planned)


def format_capacity(report: dict) -> str:
    lines = []
    for label, v in report["verdicts"].items():
        sweeps = ", ".join(f"{c:.3g}" for c in v["measured"])
        lines.append(
            f"{label}: planned {v['predicted']:.3g} req/s, measured median {v['median']:.3g} "
            f"(sweeps {sweeps}; spread {v['spread']:.0%}): {v['error']:+.1%}, "
            f"{'within' if v['within'] else 'outside'} max(10%, spread)"
        )
    match = "match" if report["ranking_matches"] else "differ"
    lines.append(
        f"ranking: measured {' > '.join(report['measured_ranking'])}, planned "
        f"{' > '.join(report['planned_ranking'])}: {match}"
    )
    return "\n".join(lines)


def capacity_main(args, profile) -> int:
    """``--part capacity`` on real clusters: the report printed and written to ``--json``."""
    slo = SLO(args.slo_ttft, args.slo_tpot)
    report = {
        "profile": args.profile,
        "cpu_cores": args.cpu_cores,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load_average_at_start": os.getloadavg(),
        "capacity": capacity_report(
            profile, args.shapes, args.workload, slo, args.sweeps, args.cpu_cores
        ),
    }
    print(format_capacity(report["capacity"]), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0
