"""A profile's grid within a time budget: a coarse grid first, then the points where the curve
bends, until the budget is spent.

One GPU profiling attempt stopped at 12 of 38 points (prefill points took 4-24 s each on an
H200). Here each table's rows (prompt tokens, batch sizes) are a fine list; every other one of
them (and the last) is measured first, each row across all its columns. Then, while the
budget allows another row (the last row's time as the estimate), the unmeasured fine row
inside the interval whose slope differs most from its neighbours' is measured next: where
the latency curve bends (a GEMM leaving its memory-bound regime, a kernel changing path),
linear interpolation is worst. What was measured, and what was skipped, goes in the record.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Clock = Callable[[], float]


@dataclass
class AxisRecord:
    measured: list[int] = field(default_factory=list)  # rows, in the order measured
    skipped: list[int] = field(default_factory=list)  # fine rows the budget left out
    seconds: float = 0.0


def coarse(rows: Sequence[int]) -> list[int]:
    """Every other row, and the last."""
    out = list(rows[::2])
    if rows[-1] not in out:
        out.append(rows[-1])
    return out


def _bend(xs: list[int], ys: list[float], i: int) -> float:
    """How far the straight line over interval ``i`` (xs[i]..xs[i+1]) may be from the curve:
    extend the neighbouring intervals' lines inward; where they cross inside the interval, the
    curve likely bends there, and the chord's distance from them at that point, relative to
    the chord, is the score. 0 where they do not cross inside (or a neighbour is missing)."""
    if i == 0 or i + 2 >= len(xs):
        return 0.0
    a, b = xs[i], xs[i + 1]
    left = (ys[i] - ys[i - 1]) / (a - xs[i - 1])
    right = (ys[i + 2] - ys[i + 1]) / (xs[i + 2] - b)
    if left == right:
        return 0.0
    # left line through (a, ys[i]), right line through (b, ys[i+1]): where they meet.
    x = (ys[i + 1] - ys[i] + left * a - right * b) / (left - right)
    if not a < x < b:
        return 0.0
    chord = ys[i] + (ys[i + 1] - ys[i]) * (x - a) / (b - a)
    return abs(chord - (ys[i] + left * (x - a))) / max(abs(chord), 1e-12)


def next_row(rows: Sequence[int], done: dict[int, float]) -> int | None:
    """The unmeasured fine row to measure next: the middle one of the interval that bends
    most (None when every row is measured)."""
    xs = sorted(done)
    ys = [done[x] for x in xs]
    best = None
    for i in range(len(xs) - 1):
        inside = [r for r in rows if xs[i] < r < xs[i + 1] and r not in done]
        if inside:
            # No bend anywhere: the widest interval (in ratio) first.
            score = (_bend(xs, ys, i), xs[i + 1] / max(xs[i], 1e-9))
            if best is None or score > best[0]:
                best = (score, inside[len(inside) // 2])
    return None if best is None else best[1]


def measure_rows(
    rows: Sequence[int],
    measure_row: Callable[[int], list[float]],
    budget_s: float,
    clock: Clock = time.monotonic,
) -> tuple[list[int], list[list[float]], AxisRecord]:
    """The rows measured within ``budget_s`` (the coarse ones always), sorted, with their
    values (each row: ``measure_row(row)``, one value per column) and the record."""
    started = clock()
    record = AxisRecord()
    values: dict[int, list[float]] = {}
    worst_s = 0.0  # the longest row so far: the next one's estimate
    for row in coarse(rows):
        t0 = clock()
        values[row] = measure_row(row)
        worst_s = max(worst_s, clock() - t0)
        record.measured.append(row)
    while clock() - started + worst_s <= budget_s:
        row = next_row(rows, {r: sum(v) / len(v) for r, v in values.items()})
        if row is None:
            break
        t0 = clock()
        values[row] = measure_row(row)
        worst_s = max(worst_s, clock() - t0)
        record.measured.append(row)
    record.skipped = [r for r in rows if r not in values]
    record.seconds = clock() - started
    kept = sorted(values)
    return kept, [values[r] for r in kept], record
