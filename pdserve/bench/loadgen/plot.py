"""`bench serve --plot`: latency CDFs of one run, with the SLOs marked."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pdserve.metrics import BenchResult


def plot_cdfs(result: BenchResult, path: str | Path, title: str = "") -> None:
    """Latency CDFs (TTFT, TPOT, ITL, E2EL) to a PNG, with the SLOs as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("TTFT", result.ttfts, result.slo_ttft_s),
        ("TPOT", result.tpots, result.slo_tpot_s),
        ("ITL", result.itls, None),
        ("E2E latency", result.e2els, None),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, seconds, slo) in zip(axes.flat, panels):
        ms = np.sort(np.asarray(seconds, dtype=np.float64) * 1000.0)
        if ms.size:
            ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post")
        if slo is not None:
            ax.axvline(slo * 1000.0, color="red", linestyle="--", label=f"SLO {slo * 1000:.0f} ms")
            ax.legend(loc="lower right")
        ylabel = "fraction of gaps" if name == "ITL" else "fraction of requests"
        ax.set(title=name, xlabel="ms", ylabel=ylabel, ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    fig.suptitle(
        title or f"{result.meta.get('workload', '')} @ {result.meta.get('request_rate')} req/s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
