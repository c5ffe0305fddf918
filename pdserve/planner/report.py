"""A plan as a table, JSON and PNG plots (goodput against rate; attainment against P:D)."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.metrics import ATTAINMENT_TARGET
from pdserve.planner.search import Plan, SplitResult


def format_plan(p: Plan) -> str:
    head = (
        f"{'split':<7}{'workers':>8}{'attain':>8}{'goodput':>9}{'gp/wkr':>8}"
        f"{'capacity':>10}{'cap/wkr':>9}{'p90 TTFT':>10}{'p50 TPOT':>10}{'copies':>7}"
    )
    lines = [
        (
            f"at {p.rate:g} req/s, SLO TTFT {p.slo.ttft_s} s, TPOT {p.slo.tpot_s} s; capacity = "
            f"highest rate with >= {ATTAINMENT_TARGET:.0%} attainment (req/s)"
        ),
        head,
    ]
    for r in p.results:
        mark = " <-" if r is p.recommended else ""
        lines.append(
            f"{r.split.label:<7}{r.split.workers:>8}{r.attainment:>8.1%}{r.goodput:>9.3f}"
            f"{r.goodput_per_worker:>8.3f}{r.capacity:>10.3f}{r.capacity_per_worker:>9.3f}"
            f"{r.p90_ttft_ms:>8.0f}ms{r.p50_tpot_ms:>8.1f}ms{r.replicas:>7}{mark}"
        )
    lines.append(recommendation_text(p))
    return "\n".join(lines)


def recommendation_text(p: Plan) -> str:
    best = p.recommended
    verdict = (
        f"recommended: {best.split.label} ({best.capacity:.3g} req/s, "
        f"{best.capacity_per_worker:.3g} per worker)"
    )
    if best.replicas > 1:
        verdict += (
            f"; deployed as {best.replicas} copies = {best.split.num_prefill * best.replicas}P"
            f"{best.split.num_decode * best.replicas}D, {best.deployment_capacity:.3g} req/s"
        )
    if not p.holds_rate:
        verdict += f"; no split up to this size holds {p.rate:g} req/s at 90%"
    d, c = p.best_disaggregated, p.best_colocated
    if d is not None and c is not None:
        ratio = (
            d.capacity_per_worker / c.capacity_per_worker if c.capacity_per_worker else float("inf")
        )
        if best.split.colocated:
            verdict += (
                f"; disaggregation does not pay here: the best split ({d.split.label}) holds "
                f"{ratio:.2f}x colocated's rate per worker"
            )
        else:
            verdict += f"; {ratio:.2f}x the best colocated pool ({c.split.label}) per worker"
    return verdict


def plan_json(p: Plan) -> dict:
    def row(r: SplitResult) -> dict:
        return {
            "split": r.split.label,
            "num_prefill": r.split.num_prefill,
            "num_decode": r.split.num_decode,
            "attainment": r.attainment,
            "goodput": r.goodput,
            "goodput_per_worker": r.goodput_per_worker,
            "capacity": r.capacity,
            "capacity_per_worker": r.capacity_per_worker,
            "replicas": r.replicas,
            "deployment_capacity": r.deployment_capacity,
            "p90_ttft_ms": r.p90_ttft_ms,
            "p50_tpot_ms": r.p50_tpot_ms,
            "curve": [{"rate": a, "attainment": b, "goodput": c} for a, b, c in r.curve],
        }

    return {
        "rate": p.rate,
        "slo_ttft_s": p.slo.ttft_s,
        "slo_tpot_s": p.slo.tpot_s,
        "recommended": p.recommended.split.label,
        "holds_rate": p.holds_rate,
        "disaggregation_pays": p.disaggregation_pays,
        "summary": recommendation_text(p),
        "splits": [row(r) for r in p.results],
    }


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_goodput_vs_rate(p: Plan, path: str | Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in p.results:
        rates = [c[0] for c in r.curve]
        style = "--" if r.split.colocated else "-"
        width = 2.5 if r is p.recommended else 1.2
        ax.plot(
            rates, [c[2] for c in r.curve], style, marker="o", ms=3, lw=width, label=r.split.label
        )
    ax.plot(
        [0, max(c[0] for c in p.results[0].curve)],
        [0, max(c[0] for c in p.results[0].curve)],
        ":",
        color="gray",
        lw=0.8,
        label="all good",
    )
    ax.axvline(p.rate, color="red", lw=0.8, ls=":")
    ax.set(
        xlabel="request rate (req/s)",
        ylabel="goodput (good req/s)",
        title=f"goodput per split (recommended {p.recommended.split.label})",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_attainment_vs_ratio(p: Plan, path: str | Path) -> None:
    """For each pool size, attainment at the target rate against P:D; colocated as a line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    sizes = sorted({r.split.workers for r in p.results if not r.split.colocated})
    for n in sizes:
        rows = [r for r in p.results if r.split.workers == n and not r.split.colocated]
        rows.sort(key=lambda r: r.split.num_prefill / r.split.num_decode)
        xs = [r.split.num_prefill / r.split.num_decode for r in rows]
        line = ax.plot(xs, [r.attainment for r in rows], marker="o", label=f"{n} workers")
        colo = next((r for r in p.results if r.split.colocated and r.split.workers == n), None)
        if colo is not None:
            ax.axhline(
                colo.attainment, ls="--", lw=0.8, color=line[0].get_color(), label=f"colocated {n}"
            )
        for x, r in zip(xs, rows):
            ax.annotate(
                r.split.label,
                (x, r.attainment),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
    ax.axhline(ATTAINMENT_TARGET, color="red", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set(
        xlabel="prefill : decode workers",
        ylabel=f"SLO attainment at {p.rate:g} req/s",
        ylim=(-0.02, 1.02),
        title="attainment against the P:D ratio",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(p: Plan, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [
        out / "plan.txt",
        out / "plan.json",
        out / "goodput_vs_rate.png",
        out / "attainment_vs_ratio.png",
    ]
    paths[0].write_text(format_plan(p) + "\n")
    paths[1].write_text(json.dumps(plan_json(p), indent=1) + "\n")
    plot_goodput_vs_rate(p, paths[2])
    plot_attainment_vs_ratio(p, paths[3])
    return paths
