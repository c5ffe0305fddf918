"""A sizing's answer as text and JSON, each figure beside the error its profile's validation
measured (``Profile.validation``; a roofline says it has none)."""

from __future__ import annotations

from pdserve.planner.probes import Deployment, Outcome
from pdserve.planner.profile import Profile
from pdserve.planner.sizing import Sized

# A figure -> the validation key that measured its error, and the pool whose profile priced it.
FIGURES = {
    "p50 TTFT": ("p50_ttft", "prefill"),
    "p90 TTFT": ("p90_ttft", "prefill"),
    "p50 TPOT": ("p50_tpot", "decode"),
    "goodput": ("goodput", "decode"),
}


def trust(profile: Profile, figure: str) -> str:
    """``±7.3% (150 live runs, ...)``, or why there is no such figure."""
    key, _ = FIGURES[figure]
    v = profile.validation
    if key in v:
        return f"±{float(v[key]):.1%}"
    if "none" in v:
        return f"error unknown: {v['none']}"
    return "error unknown: not in the profile's validation"


def trust_line(profile: Profile) -> str:
    """Every figure's error from the profile's record, on one line (the split search's table)."""
    cells = ", ".join(f"{name} {trust(profile, name)}" for name in FIGURES)
    how = profile.validation.get("how")
    return f"the profile's validation: {cells}" + (f" ({how})" if how else "")


def shape(dep: Deployment, profiles: dict[str, Profile]) -> str:
    d = profiles[dep.decode]
    if dep.colocated:
        return f"colocated {dep.num_decode} x [{d.shape_label}]"
    p = profiles[dep.prefill]
    return f"{dep.num_prefill} x [{p.shape_label}] prefill + {dep.num_decode} x [{d.shape_label}] decode"


def _pool_profile(dep: Deployment, pool: str, profiles: dict[str, Profile]) -> Profile:
    return profiles[dep.prefill if pool == "prefill" and not dep.colocated else dep.decode]


def figures(dep: Deployment, out: Outcome, profiles: dict[str, Profile]) -> list[str]:
    values = {
        "p50 TTFT": f"{out.p50_ttft_s * 1e3:.0f} ms",
        "p90 TTFT": f"{out.p90_ttft_s * 1e3:.0f} ms",
        "p50 TPOT": f"{out.p50_tpot_s * 1e3:.1f} ms",
        "goodput": f"{out.goodput:.4g} req/s",
    }
    lines = []
    for name, value in values.items():
        prof = _pool_profile(dep, FIGURES[name][1], profiles)
        lines.append(f"  {name:<9}{value:>14}   ({trust(prof, name)})")
    lines.append(f"  p99 ITL {out.p99_itl_s * 1e3:>14.1f} ms, attainment {out.attainment:.1%}")
    return lines


def format_sizing(
    sized: list[Sized], profiles, rate: float, target: float, spec, budget: int | None = None
) -> str:
    if budget is not None:
        head = f"the most goodput within {budget} devices at {spec.describe()}"
    else:
        room = f" (with headroom: {target:.4g} req/s)" if target != rate else ""
        head = f"fewest devices for {rate:g} req/s{room} at {spec.describe()}"
    lines = [head, f"{'devices':>8}{'estimate':>9}{'capacity':>10}  shape"]
    for s in sized:
        cap = f"{s.capacity:.4g}" if s.capacity else "-"
        ok = "" if budget is not None or s.holds else "  (does not hold)"
        lines.append(
            f"{s.devices:>8}{s.estimate_devices:>9}{cap:>10}  {shape(s.deployment, profiles)}{ok}"
        )
    best = sized[0]
    verdict = "recommended" if budget is not None or best.holds else "nothing holds; closest"
    dep = best.deployment
    ratio = "" if dep.colocated else f", P:D {dep.num_prefill}:{dep.num_decode}"
    lines.append(f"{verdict}: {shape(dep, profiles)} = {best.devices} devices{ratio}")
    if best.outcome is not None:
        at = rate if budget is not None else target
        lines.append(f"simulated, the whole cluster at {at:.4g} req/s:")
        lines += figures(dep, best.outcome, profiles)
    return "\n".join(lines)


def sizing_json(sized: list[Sized], rate: float, target: float, budget: int | None) -> dict:
    def row(s: Sized) -> dict:
        d = s.deployment
        return {
            "prefill_profile": d.prefill,
            "num_prefill": d.num_prefill,
            "decode_profile": d.decode,
            "num_decode": d.num_decode,
            "colocated": d.colocated,
            "devices": s.devices,
            "estimate_devices": s.estimate_devices,
            "holds": s.holds,
            "capacity": s.capacity,
            "unit_capacity": s.unit_capacity,
            "outcome": None if s.outcome is None else s.outcome.__dict__,
        }

    return {
        "rate": rate,
        "target_rate": target,
        "budget": budget,
        "candidates": [row(s) for s in sized],
    }
