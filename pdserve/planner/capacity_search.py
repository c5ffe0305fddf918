"""A deployment's capacity, the highest rate at which it holds: bracket from a start rate by a
factor, then bisect. One search, two ways to run it:

- ``capacity_of``: one probe at a time (inside a worker process: probes.py's ``_capacity``);
- ``speculative_capacity`` (probes.py, beside the ``ProbeRunner`` it drives): the probe the search needs next together with
  the ones each of its outcomes would ask for after it (breadth first, up to ``width`` at
  once), so idle processes run what the search will likely need. Its answer is
  ``capacity_of``'s: it walks the same states on the same probes' outcomes; the extra probes
  only come in early (or are not used).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

BRACKET_TRIES = 12  # rates tried while bracketing before giving up (the last held is the answer)


@dataclass(frozen=True)
class Bisection:
    """A state of the search: ``rate`` is the next to try; done: ``lo`` is the capacity."""

    rate: float
    steps: int  # bisection steps left once bracketed
    factor: float
    lo: float = 0.0  # the highest rate seen to hold (0: none yet)
    hi: float = 0.0  # the lowest seen to miss (0: none yet)
    tries: int = 0  # bracketing tries made
    bisecting: bool = False
    done: bool = False

    def after(self, held: bool) -> Bisection:
        """The state once ``rate`` was seen to hold (or not)."""
        lo, hi = (self.rate, self.hi) if held else (self.lo, self.rate)
        if self.bisecting:
            return self._bisect(lo, hi, self.steps - 1)
        if lo and hi:
            return self._bisect(lo, hi, self.steps)
        if self.tries + 1 >= BRACKET_TRIES:
            return replace(self, lo=lo, hi=hi, tries=self.tries + 1, done=True)
        rate = self.rate * self.factor if held else self.rate / self.factor
        return replace(self, rate=rate, lo=lo, hi=hi, tries=self.tries + 1)

    def _bisect(self, lo: float, hi: float, steps: int) -> Bisection:
        s = replace(self, lo=lo, hi=hi, steps=steps, bisecting=True)
        return replace(s, done=True) if steps <= 0 else replace(s, rate=(lo + hi) / 2)

    def ahead(self, width: int) -> list[float]:
        """The next rate and those its outcomes lead to, breadth first: ``width`` at most. A
        miss's branch first: searches start from an estimate at or just past the answer."""
        out, frontier = [], [self]
        while frontier and len(out) < width:
            state = frontier.pop(0)
            if not state.done:
                out.append(state.rate)
                frontier += [state.after(False), state.after(True)]
        return out


def capacity_of(holds: Callable[[float], bool], start: float, steps: int, factor: float) -> float:
    state = Bisection(start, steps, factor)
    while not state.done:
        state = state.after(holds(state.rate))
    return state.lo
