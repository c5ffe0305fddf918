"""What "holds the rate" means: per-request SLOs at an attainment target, and percentile bounds.

Two kinds of target, either or both:
- per request (DistServe's): a request is good when its TTFT <= ``ttft_s`` and its TPOT <=
  ``tpot_s``; the deployment holds when the share of good requests is >= ``attainment``;
- percentile bounds (an operator's dashboard): ``p99 TTFT <= 2 s``, ``p50 TPOT <= 40 ms``,
  ``p90 ITL <= 60 ms``, over every request sent (a failed request counts as infinitely late).

The sizing search splits a spec into its prefill part (what a first token depends on: TTFT) and
its decode part (TPOT, ITL), so each pool is sized against the targets it drives.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

import numpy as np

from pdserve.metrics import ATTAINMENT_TARGET, SLO, BenchResult

METRICS = ("ttft", "tpot", "itl")
PREFILL_METRICS = ("ttft",)
_BOUND = re.compile(r"^(ttft|tpot|itl):p(\d+(?:\.\d+)?)=(\d+(?:\.\d+)?(?:e-?\d+)?)$")


@dataclass(frozen=True)
class Bound:
    """The ``percentile``-th percentile of ``metric`` must be <= ``seconds``."""

    metric: str
    percentile: float
    seconds: float

    @classmethod
    def parse(cls, text: str) -> Bound:
        """``ttft:p99=2.0`` (seconds); ValueError naming the text."""
        m = _BOUND.match(text.strip().lower())
        if m is None:
            raise ValueError(
                f"bad SLO bound {text!r}: want METRIC:pPCT=SECONDS with METRIC one of "
                f"{', '.join(METRICS)} (e.g. ttft:p99=2, tpot:p50=0.04)"
            )
        pct, seconds = float(m.group(2)), float(m.group(3))
        if not 0 < pct <= 100 or seconds <= 0:
            raise ValueError(f"bad SLO bound {text!r}: percentile in (0, 100], seconds > 0")
        return cls(m.group(1), pct, seconds)

    @property
    def label(self) -> str:
        return f"p{self.percentile:g} {self.metric.upper()} <= {self.seconds * 1e3:g} ms"

    def value(self, res: BenchResult) -> float:
        """The percentile in seconds; failed requests count as infinitely late."""
        values = {"ttft": res.ttfts, "tpot": res.tpots, "itl": res.itls}[self.metric]
        missing = res.failed if self.metric == "ttft" else 0
        if not values and not missing:
            return 0.0
        data = np.concatenate([np.asarray(values, dtype=float), np.full(missing, np.inf)])
        return float(np.percentile(data, self.percentile, method="higher"))

    def met(self, res: BenchResult) -> bool:
        return self.value(res) <= self.seconds


@dataclass(frozen=True)
class SloSpec:
    per_request: SLO = field(default_factory=SLO)
    attainment: float = ATTAINMENT_TARGET
    bounds: tuple[Bound, ...] = ()

    def __post_init__(self) -> None:
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment must be in (0, 1], got {self.attainment}")

    @property
    def is_set(self) -> bool:
        return self.per_request.is_set or bool(self.bounds)

    def holds(self, res: BenchResult) -> bool:
        return self.margin(res) >= 0

    def attained(self, res: BenchResult) -> float:
        """The share of requests sent that completed meeting the per-request SLOs. With one
        SLO it is counted from the run's per-request lists (so one run scores each pool's part
        alone); with both, the run must have been scored with them (``slo_attainment``)."""
        slo, sent = self.per_request, max(res.num_requests, 1)
        if slo.ttft_s is not None and slo.tpot_s is not None:
            if (res.slo_ttft_s, res.slo_tpot_s) != (slo.ttft_s, slo.tpot_s):
                raise ValueError("the run was scored with other SLOs than this spec's")
            return res.slo_attainment or 0.0
        if slo.ttft_s is not None:
            return sum(t <= slo.ttft_s for t in res.ttfts) / sent
        if slo.tpot_s is not None:
            one_token = res.completed - len(res.tpots)  # TPOT 0: met
            return (sum(t <= slo.tpot_s for t in res.tpots) + one_token) / sent
        return res.completed / sent

    def margin(self, res: BenchResult) -> float:
        """How far inside the targets a run is, as the smallest relative slack (< 0: missed).
        Compares the pools' misses when a joint run fails."""
        slacks = []
        if self.per_request.is_set:
            slacks.append((self.attained(res) - self.attainment) / self.attainment)
        for b in self.bounds:
            v = b.value(res)
            slacks.append(-math.inf if math.isinf(v) else (b.seconds - v) / b.seconds)
        if res.failed and not self.per_request.is_set:
            slacks.append(-res.failed / max(res.num_requests, 1))
        return min(slacks, default=0.0)

    def part(self, pool: str) -> SloSpec:
        """The targets a ``prefill`` or ``decode`` pool drives (its TTFT, or TPOT and ITL)."""
        mine = PREFILL_METRICS if pool == "prefill" else ("tpot", "itl")
        slo = self.per_request
        per_request = SLO(
            slo.ttft_s if "ttft" in mine else None, slo.tpot_s if "tpot" in mine else None
        )
        # Each pool may miss half of what the whole may: by the union bound, two pools that
        # meet their parts meet the whole (the sizing then gives back what it can spare).
        both = slo.ttft_s is not None and slo.tpot_s is not None
        share = 1 - (1 - self.attainment) / 2 if both else self.attainment
        bounds = tuple(b for b in self.bounds if b.metric in mine)
        return replace(self, per_request=per_request, attainment=share, bounds=bounds)

    def describe(self) -> str:
        parts = []
        if self.per_request.ttft_s is not None:
            parts.append(f"TTFT <= {self.per_request.ttft_s:g} s")
        if self.per_request.tpot_s is not None:
            parts.append(f"TPOT <= {self.per_request.tpot_s:g} s")
        text = ""
        if parts:
            text = f"{' and '.join(parts)} for >= {self.attainment:.0%} of requests"
        bounds = ", ".join(b.label for b in self.bounds)
        return "; ".join(t for t in (text, bounds) if t)
