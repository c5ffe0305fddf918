"""The decode table's per-row scale (``Profile.decode_row_scale``), fitted on live steps.

The profile measures each (batch, context) point of the decode table once or a few times; on
a shared machine one point can come out high, and the running maximum that keeps the table
monotone (profile.monotone) lifts every larger batch at that context to it. Live decode steps
then run under their price at those batches and over it past them, the same way in every run
(Zen 4: 0.86x at 2-3 rows, 1.09x at 7-10). Scaling each table row by what the live steps read
there corrects the table where the co-run factors, fitted on top of it, cannot.
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

MIN_ROW_STEPS = 20.0  # steps (interpolation-weighted) a decode table row is fitted on


def _grid_weights(grid: tuple[float, ...], n: float) -> list[tuple[int, float]]:
    """The decode table rows a batch of ``n`` is priced from, with their interpolation
    weights (flat outside the grid, as ``Table2D`` reads it)."""
    i = bisect_left(grid, n)
    if i == 0 or i == len(grid):
        return [(min(i, len(grid) - 1), 1.0)]
    upper = (n - grid[i - 1]) / (grid[i] - grid[i - 1])
    return [(i - 1, 1.0 - upper), (i, upper)]


def decode_row_scale(rows: list[dict], grid: tuple[float, ...]) -> tuple[float, ...] | None:
    """Per row of the decode table (its batch sizes ``grid``): ``rows`` (priced decode-only
    steps, step_residuals.priced_steps; the caller picks them: a decode worker's, with no other
    worker computing) summed real over summed priced seconds, each step shared between the
    table rows its batch is interpolated from. A table row with fewer than MIN_ROW_STEPS steps
    takes the nearest fitted row's factor; None when no row has enough."""
    real, priced, weight = np.zeros(len(grid)), np.zeros(len(grid)), np.zeros(len(grid))
    for r in rows:
        for i, w in _grid_weights(grid, r["decode_rows"]):
            real[i] += w * r["real_s"]
            priced[i] += w * r["priced_s"]
            weight[i] += w
    fitted = [i for i in range(len(grid)) if weight[i] >= MIN_ROW_STEPS and priced[i] > 0]
    if not fitted:
        return None
    nearest = [min(fitted, key=lambda j: abs(j - i)) for i in range(len(grid))]
    return tuple(float(real[j] / priced[j]) for j in nearest)


def row_scaled(rows: list[dict], grid: tuple[float, ...], scale: tuple[float, ...]):
    """Decode-only steps' prices with ``scale`` applied (``Profile.decode_priced`` scales its
    table the same way, then takes the running maximum)."""

    def factor(n: float) -> float:
        return sum(w * scale[i] for i, w in _grid_weights(grid, n))

    return [
        {**r, "priced_s": r["priced_s"] * factor(r["decode_rows"])} if r["kind"] == "decode" else r
        for r in rows
    ]
