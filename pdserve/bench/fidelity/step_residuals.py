"""Each real step against the profile's price for it (engine/step_trace.py's traces).

A fidelity run's workers record every step's shape and duration; here each step is priced by
the profile exactly as the simulator prices it (``Profile.shape_seconds``), and the ratio
measured / priced is summarised by kind of step (decode only, prefill only, mixed) and by how
much of the step another worker was computing at the same time (alone, or co-running). A ratio
away from 1 in one cell names the cost the profile misses, instead of guessing it from the
latency percentiles.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from engine.step_trace import PlanShape, read_trace
from pdserve.planner.profile import Profile

SHAPE_FIELDS = tuple(PlanShape.__dataclass_fields__)
ALONE, CO_RUN = 0.1, 0.9  # share of a step's time another worker computes


def kind_of(shape: PlanShape) -> str:
    if not shape.prompt_tokens:
        return "decode"
    return "mixed" if shape.decode_rows else "prefill"


def _overlaps(start: float, end: float, others: list[tuple[list, list]]):
    """Each other worker's steps clipped to [start, end), as (from, to) (each other worker:
    its step starts and ends, sorted; its steps never overlap each other)."""
    for starts, ends in others:
        i = bisect_left(ends, start)  # the first step still running at ``start``
        while i < len(starts) and starts[i] < end:
            yield max(starts[i], start), min(ends[i], end)
            i += 1


def overlap_share(start: float, end: float, others: list[tuple[list, list]]) -> float:
    """The share of [start, end) during which at least one other worker was in a step."""
    if end <= start:
        return 0.0
    total, reach = 0.0, start
    for a, b in sorted(_overlaps(start, end, others)):  # union of the intervals
        a = max(a, reach)
        if b > a:
            total += b - a
            reach = b
    return total / (end - start)


def busy_others(start: float, end: float, others: list[tuple[list, list]]) -> float:
    """How many other workers were in a step during [start, end), on average over it."""
    if end <= start:
        return 0.0
    return sum(b - a for a, b in _overlaps(start, end, others)) / (end - start)


def _spans(steps: list[dict]) -> tuple[list, list]:
    return [s["t"] for s in steps], [s["t"] + s["s"] for s in steps]


def load_steps(folder: str | Path) -> dict[str, list[dict]]:
    return {p.stem: read_trace(p) for p in sorted(Path(folder).glob("*.jsonl"))}


def background_share(profile: Profile, steps_by_worker: dict[str, list[dict]]) -> float:
    """The router's and its client's mean CPU use over one live run (cores' worth), as the
    simulator charges it (``CpuShare.charge``): each request's and each token's CPU cost,
    with the tokens the steps sampled (first tokens) and decoded, over the run's span."""
    steps = [s for worker in steps_by_worker.values() for s in worker]
    if not steps:
        return 0.0
    span = max(s["t"] + s["s"] for s in steps) - min(s["t"] for s in steps)
    first = sum(max(0, s.get("sampled", 0) - s["decode_rows"]) for s in steps)  # prompts done
    decoded = sum(s["decode_rows"] for s in steps)
    c = profile.cpu
    per_token = c.router_cpu_per_token_s + c.stream_cpu_per_token_s
    cpu = first * c.router_cpu_per_request_s + (first + decoded) * per_token
    return cpu / span if span > 0 else 0.0


def priced_steps(profile: Profile, steps_by_worker: dict[str, list[dict]]) -> list[dict]:
    """Every step of every worker with its priced seconds, kind and co-running share, and the
    run's background CPU share (``background_share``)."""
    background = background_share(profile, steps_by_worker)
    spans = {w: _spans(steps) for w, steps in steps_by_worker.items()}
    prompts = {  # each worker's steps that computed prompt tokens
        w: _spans([s for s in steps if s["prompt_tokens"]]) for w, steps in steps_by_worker.items()
    }
    out = []
    for worker, steps in steps_by_worker.items():
        others = [span for w, span in spans.items() if w != worker]
        prefilling = [span for w, span in prompts.items() if w != worker]
        for s in steps:
            shape = PlanShape(**{f: s[f] for f in SHAPE_FIELDS})
            out.append(
                {
                    "worker": worker,
                    "kind": kind_of(shape),
                    "rows": shape.decode_rows,
                    "real_s": s["s"],
                    "priced_s": profile.shape_seconds(shape),
                    "co_run": overlap_share(s["t"], s["t"] + s["s"], others),
                    "busy_others": busy_others(s["t"], s["t"] + s["s"], others),
                    "beside_prefill": overlap_share(s["t"], s["t"] + s["s"], prefilling),
                    "background": background,
                }
            )
    return out


def summarise(rows: list[dict]) -> dict:
    """Per kind and co-running bucket: steps, median ratio, and summed measured over summed
    priced seconds (the time-weighted ratio: what the simulated clock would gain or lose)."""
    cells: dict[str, list[dict]] = {}
    for r in rows:
        bucket = "alone" if r["co_run"] < ALONE else "co-run" if r["co_run"] > CO_RUN else "part"
        cells.setdefault(f"{r['kind']}/{bucket}", []).append(r)
        cells.setdefault(f"{r['kind']}/all", []).append(r)
    out = {}
    for key, group in sorted(cells.items()):
        real = np.array([g["real_s"] for g in group])
        priced = np.array([g["priced_s"] for g in group])
        ok = priced > 0
        out[key] = {
            "steps": len(group),
            "median_ratio": float(np.median(real[ok] / priced[ok])) if ok.any() else None,
            "time_ratio": float(real.sum() / priced.sum()) if priced.sum() > 0 else None,
            "real_s": float(real.sum()),
            "priced_s": float(priced.sum()),
        }
    return out


def step_residuals(profile: Profile, folder: str | Path) -> dict:
    return summarise(priced_steps(profile, load_steps(folder)))


def format_residuals(summary: dict) -> str:
    lines = [f"{'step kind':<18}{'steps':>7}{'median':>9}{'time':>8}{'seconds':>9}"]
    for key, c in summary.items():
        med = "-" if c["median_ratio"] is None else f"{c['median_ratio']:.2f}"
        tim = "-" if c["time_ratio"] is None else f"{c['time_ratio']:.2f}"
        lines.append(f"{key:<18}{c['steps']:>7}{med:>9}{tim:>8}{c['real_s']:>9.1f}")
    return "\n".join(lines)


# The least slope a decode step's co-run fit may take. Priced with the decode table's row
# factors (fitted on alone steps: 1.10-1.13x at four to eight rows on Zen 4), decode steps
# beside a neighbour read about 0.91 x (price + 6-8 ms): the alone steps' mid-batch excess is
# smaller beside a busy neighbour. A prompt step's fit keeps the slope at 1 or more.
DECODE_SLOPE_FLOOR = 0.85


def affine_fit(real: np.ndarray, priced: np.ndarray, floor: float = 1.0) -> tuple[float, float]:
    """(a, c) with real ~ a x (priced + c), a >= ``floor`` and c >= 0, by least squares: the
    co-run factor and the once-per-step work of CpuShare (``fixed``), in seconds of the step
    alone."""
    if len(real) < 3 or np.ptp(priced) <= 0:
        a = max(1.0, float(real.sum() / priced.sum())) if priced.sum() > 0 else 1.0
        return a, 0.0
    a, b = np.polyfit(priced, real, 1)
    if a < floor:  # the slope held at the floor: the rest of the excess is per step
        a, b = floor, max(0.0, float(np.mean(real - floor * priced)))
    elif b < 0.0:  # the intercept held at 0: the excess is proportional
        a, b = max(1.0, float(real @ priced / (priced @ priced))), 0.0
    return float(a), float(b) / float(a)


def co_run_affine(rows: list[dict]) -> dict[str, tuple[float, float]]:
    """Per kind ("decode", "prefill": any step computing prompt tokens), the affine co-run
    cost of its steps that ran beside the *other* kind throughout (priced_steps' rows): a
    decode step beside a prompt step, a prompt step beside decode steps only. This is what
    the simulator's co-run factor and fixed work stand for, measured on the live cluster
    itself, where a neighbour also means KV frames streaming in or out through the workers'
    Python threads beside the forward: two bare forwards side by side slow each other only a
    few percent."""
    out = {}
    prompts = [r for r in co_running(rows, "prefill") if beside_other_kind(r)]
    local = [r for r in prompts if not on_prefill_worker(r)]
    groups = {
        "decode": [r for r in co_running(rows, "decode") if beside_other_kind(r)],
        # A prefill worker's prompt steps stream KV frames out through its threads beside the
        # forward; a decode (colocated) worker's own do not: each has its own fixed work.
        "prefill": [r for r in prompts if on_prefill_worker(r)] or prompts,
    }
    if local:  # "local_prefill" only where decode workers computed prompts beside decode steps
        groups["local_prefill"] = local
    for kind, group in groups.items():
        real = np.array([r["real_s"] for r in group], dtype=float)
        priced = np.array([r["priced_s"] for r in group], dtype=float)
        floor = DECODE_SLOPE_FLOOR if kind == "decode" else 1.0
        out[kind] = affine_fit(real, priced, floor) if len(group) else (1.0, 0.0)
    return out


def co_running(rows: list[dict], kind: str) -> list[dict]:
    """``kind``'s steps (decode; or prefill and mixed) with another worker busy throughout."""
    return [
        r for r in rows if (r["kind"] == "decode") == (kind == "decode") and r["co_run"] > CO_RUN
    ]


def on_prefill_worker(r: dict) -> bool:
    """A prefill worker's step (a row naming no worker counts as one)."""
    return r.get("worker", "prefill").startswith("prefill")


def beside_other_kind(r: dict) -> bool:
    """A decode step beside a prompt step most of it, or a prompt step beside decode steps
    only (a row without ``beside_prefill`` counts as beside the other kind)."""
    if r["kind"] == "decode":
        return r.get("beside_prefill", 1.0) > 0.5
    return r.get("beside_prefill", 0.0) < ALONE


def beside_same_kind(r: dict) -> bool:
    """A decode step beside decode steps only, or a prompt step beside a prompt step most of
    it (a row without ``beside_prefill`` counts as beside the other kind)."""
    if r["kind"] == "decode":
        return r.get("beside_prefill", 1.0) < ALONE
    return r.get("beside_prefill", 0.0) > 0.5


def prefill_pair_factor(rows: list[dict], fixed: Callable[[dict], float]) -> float | None:
    """The co-run factor of prompt steps beside another worker's prompt steps only, with each
    step's fixed work held (``fixed(row)``): summed real over summed (price + fixed), at least
    1. None without such steps. (The decode pair is affine: ``decode_pair_affine``.)"""
    group = [r for r in co_running(rows, "prefill") if beside_same_kind(r)]
    if len(group) < 3:
        return None
    priced = sum(r["priced_s"] + fixed(r) for r in group)
    return max(1.0, sum(r["real_s"] for r in group) / priced)


def role_slowdown(rows: list[dict], role: str, kinds: tuple[str, ...]) -> float:
    """A role's live steps of ``kinds`` with no other worker computing, measured over priced
    seconds (the worker's own threads, the router and the client still run beside them)."""
    group = [r for r in rows if r["worker"].startswith(role) and r["kind"] in kinds]
    group = [r for r in group if r["co_run"] < ALONE]
    priced = sum(r["priced_s"] for r in group)
    return sum(r["real_s"] for r in group) / priced if priced > 0 else 1.0


def unshared(rows: list[dict], cores: int | None) -> list[dict]:
    """Each step's real seconds over the processor-sharing slowdown the simulator applies
    on its own (``CpuShare``: max(1, workers computing / cores), one thread a worker), so the
    co-run terms fitted on them stand for what they stand for in the simulator: what a
    neighbour costs beyond its share of the cores. Without it, a run with more workers than
    cores (1P2D on 2) fits its oversubscription into the co-run factor, and the simulator
    then charges it twice there and wrongly on every run with a core a worker."""
    if not cores:
        return rows
    return [{**r, "real_s": r["real_s"] / _fair_share(r, cores)} for r in rows]


def _fair_share(r: dict, cores: int) -> float:
    """The simulator's processor-sharing slowdown of a step, in expectation: the workers
    computing beside it and the background thread (busy ``background`` of the time) on
    ``cores``. The live steps ran beside the real router, so a co-run cost fitted on them
    without this would charge the router's CPU twice: once inside the fit, once in CpuShare."""
    return max(1.0, (1.0 + r.get("busy_others", 0.0) + r.get("background", 0.0)) / cores)


def oversubscribed(r: dict, cores: int) -> bool:
    """More workers were computing during the step than there are cores."""
    return r.get("busy_others", 0.0) + 1.0 > cores + 0.5


def prefill_share_weight(rows: list[dict], cores: int | None, factor: float, fixed_s: float):
    """``oversubscribed_prefill_weight``: the claim on oversubscribed cores that makes
    ``CpuShare.shares`` slow the prompt steps that ran beside ``n`` decoding workers (more
    workers than cores) as much as they really slowed, past their co-run cost (``factor`` x
    (price + ``fixed_s``)). With weight w against each decode step's 1, a prompt step gets
    cores x w / (w + n) cores, so its slowdown s = (w + n) / (cores x w) gives
    w = n / (cores x s - 1). On the EPYC VMs the kernel favours the decode workers, which sleep
    briefly between steps (w < 1). None without such steps."""
    if not cores:
        return None
    group = [
        r for r in co_running(rows, "prefill")
        if oversubscribed(r, cores) and beside_other_kind(r)
    ]  # fmt: skip
    if len(group) < 3:
        return None
    slowdown = sum(r["real_s"] for r in group) / sum(
        factor * (r["priced_s"] + fixed_s) for r in group
    )
    n = float(np.mean([r["busy_others"] for r in group]))
    if cores * slowdown - 1.0 <= 0.0:
        return None
    return float(min(10.0, max(0.1, n / (cores * slowdown - 1.0))))


def calibrated_costs(rows: list[dict], cores: int | None = None) -> dict[str, float]:
    """The profile fields a live run's steps calibrate: each role's alone slowdown, then the
    co-run factor and fixed work on top of it (prices scaled by the role's slowdown, as the
    simulator scales them), on real times less the sharing of ``cores`` (``unshared``)."""
    raw = rows
    rows = unshared(rows, cores)
    if cores:  # past the cores the live kernel's share is not fair (PLANNING.md): left out
        rows = [r for r in rows if not oversubscribed(r, cores)]
    decode = role_slowdown(rows, "decode", ("decode",))
    prefill = role_slowdown(rows, "prefill", ("prefill", "mixed"))

    def scaled(r: dict) -> dict:  # as SimWorker.run: each role's slowdown on its own kind
        if r["worker"].startswith("prefill"):
            role = prefill
        else:
            role = decode if r["kind"] == "decode" else 1.0
        return {**r, "priced_s": r["priced_s"] * role}

    rows = [scaled(r) for r in rows]
    fit = co_run_affine(rows)
    costs = {
        "decode_worker_slowdown": decode,
        "prefill_worker_slowdown": prefill,
        "co_run_slowdown": fit["decode"][0],
        "co_run_fixed_s": fit["decode"][1],
        "co_run_slowdown_prefill": fit["prefill"][0],
        "co_run_fixed_s_prefill": fit["prefill"][1],
    }
    weight = prefill_share_weight([scaled(r) for r in raw], cores, *fit["prefill"])
    if weight is not None:
        costs["oversubscribed_prefill_weight"] = weight
    if "local_prefill" in fit:
        costs["co_run_fixed_s_local_prefill"] = fit["local_prefill"][1]

    def fixed(r: dict) -> float:  # the fixed work the simulator gives a prompt step
        local = not on_prefill_worker(r) and "local_prefill" in fit
        return fit["local_prefill" if local else "prefill"][1]

    pair = decode_pair_affine(rows)  # a pair no run had keeps the profile's figures
    if pair is not None:
        costs["co_run_slowdown_decode_pair"], costs["co_run_fixed_s_decode_pair"] = pair
    prefill_pair = prefill_pair_factor(rows, fixed)
    if prefill_pair is not None:
        costs["co_run_slowdown_prefill_pair"] = prefill_pair
    return costs


def decode_pair_affine(rows: list[dict]) -> tuple[float, float] | None:
    """The decode pair's (factor, fixed work): decode steps beside decode steps only, as
    ``affine_fit``. None without such steps."""
    group = [r for r in co_running(rows, "decode") if beside_same_kind(r)]
    if len(group) < 3:
        return None
    real = np.array([r["real_s"] for r in group], dtype=float)
    priced = np.array([r["priced_s"] for r in group], dtype=float)
    return affine_fit(real, priced, DECODE_SLOPE_FLOOR)


MIN_ROW_STEPS = 30  # a decode table row with fewer alone steps is read from its neighbours


def decode_row_factors(rows: list[dict], batches: Sequence[float]) -> tuple[float, ...]:
    """``Profile.decode_row_factors``: each decode table row's live decode-only steps with no
    other worker computing, summed real over summed priced (priced without factors). A step
    between two of the table's batch sizes counts toward both, by its linear weight, as the
    factor is read back; a row with under ``MIN_ROW_STEPS`` steps' weight is interpolated
    between the fitted rows around it, or takes the end one's. () without such steps."""
    real, priced, weight = (np.zeros(len(batches)) for _ in range(3))
    for r in rows:
        if r["kind"] != "decode" or r["co_run"] >= ALONE or on_prefill_worker(r):
            continue
        n = min(max(r["rows"], batches[0]), batches[-1])
        hi = min(bisect_left(batches, n), len(batches) - 1)
        lo = max(hi - 1, 0)
        share = 1.0 if hi == lo else (n - batches[lo]) / (batches[hi] - batches[lo])
        for k, w in ((lo, 1.0 - share), (hi, share)):
            real[k] += w * r["real_s"]
            priced[k] += w * r["priced_s"]
            weight[k] += w
    fitted = weight >= MIN_ROW_STEPS
    if not fitted.any():
        return ()
    at = np.asarray(batches, dtype=float)
    factors = np.interp(at, at[fitted], real[fitted] / priced[fitted])  # flat past the ends
    return tuple(float(f) for f in factors)


def with_row_factors(rows: list[dict], profile: Profile) -> list[dict]:
    """Rows priced without ``decode_row_factors``, priced as ``profile`` prices them."""
    if not profile.cpu.decode_row_factors:
        return rows
    return [
        {**r, "priced_s": r["priced_s"] * profile.decode_row_factor(r["rows"])}
        if r["kind"] == "decode"
        else r
        for r in rows
    ]
