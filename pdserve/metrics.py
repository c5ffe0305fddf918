"""Serving metrics with `vllm bench serve`'s definitions and field names.

Per request (timestamps from one monotonic clock, in seconds):
    TTFT = first token chunk - send;  E2EL = end of stream - send;
    TPOT = (E2EL - TTFT) / (output_tokens - 1), only for requests with more than one token;
    ITL  = every gap between consecutive streamed token chunks.
Over a run: throughputs divide by the run's duration; a request is *good* when it completed and
meets every SLO given (TTFT <= slo_ttft, TPOT <= slo_tpot; one-token outputs have TPOT 0);
``request_goodput`` = good requests / duration, ``slo_attainment`` = good / all requests sent
(a failed request misses its SLOs). DistServe's goodput of a *system* is the highest Poisson
rate at which attainment >= 90% (pdserve/bench/loadgen/sweep.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (90, 99)
ATTAINMENT_TARGET = 0.9


@dataclass
class RequestRecord:
    """What one request's stream looked like, as the client saw it."""

    send_time: float
    end_time: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival of each token chunk
    prompt_tokens: int = 0  # from usage; 0 when the server sends none
    completion_tokens: int | None = None  # from usage; None: count token chunks instead
    success: bool = False
    error: str = ""
    kind: str = ""

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.send_time if self.token_times else 0.0

    @property
    def e2el(self) -> float:
        return self.end_time - self.send_time

    @property
    def output_tokens(self) -> int:
        if self.completion_tokens is not None:
            return self.completion_tokens
        return len(self.token_times)

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        return (self.e2el - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        return np.diff(self.token_times).tolist() if len(self.token_times) > 1 else []


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    tpot_s: float | None = None

    @property
    def is_set(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None

    def met_by(self, r: RequestRecord) -> bool:
        if not r.success:
            return False
        if self.ttft_s is not None and r.ttft > self.ttft_s:
            return False
        tpot = r.tpot or 0.0
        return self.tpot_s is None or tpot <= self.tpot_s


@dataclass
class LatencyStats:
    mean: float = 0.0
    median: float = 0.0
    std: float = 0.0
    p90: float = 0.0
    p99: float = 0.0

    @classmethod
    def of(cls, seconds: list[float]) -> LatencyStats:
        """Stats in milliseconds; all zero for no samples (as vLLM reports them)."""
        if not seconds:
            return cls()
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        p90, p99 = np.percentile(ms, PERCENTILES)
        return cls(float(ms.mean()), float(np.median(ms)), float(ms.std()), float(p90), float(p99))


@dataclass
class BenchResult:
    num_requests: int
    completed: int
    failed: int
    duration: float  # s, from the first scheduled send to the last request's end
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    request_goodput: float | None  # good requests / s; None without an SLO
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    slo_attainment: float | None  # good / num_requests; None without an SLO
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2el_ms: LatencyStats
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    # per completed request, in seconds (tpots: requests with > 1 token), for plots and sweeps
    ttfts: list[float] = field(default_factory=list)
    tpots: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    e2els: list[float] = field(default_factory=list)
    input_lens: list[int] = field(default_factory=list)
    output_lens: list[int] = field(default_factory=list)
    # each completed request's place in send order: the per-request lists above line up with it
    # (ttfts, e2els and the lengths one for one), so a failed request shifts nothing after it
    sent_indices: list[int] = field(default_factory=list)
    # each completed request's kind (chat, longdoc, turn1, turn2, ...: the workload's), so a
    # percentile can be taken per kind (``ttft_by_kind``)
    kinds: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # url, model, workload, rate, seed, nonce, ...

    def to_dict(self) -> dict:
        """Flat, with vLLM's names: ``mean_ttft_ms``, ``median_ttft_ms``, ``p99_ttft_ms``..."""
        out = asdict(self)
        out["ttft_by_kind_ms"] = {k: asdict(v) for k, v in self.ttft_by_kind().items()}
        for metric in ("ttft", "tpot", "itl", "e2el"):
            stats = out.pop(f"{metric}_ms")
            for stat, value in stats.items():
                out[f"{stat}_{metric}_ms"] = value
        meta = out.pop("meta")
        return {**meta, **out}

    def ttft_by_kind(self) -> dict[str, LatencyStats]:
        """TTFT stats of each kind of request, in the order kinds first appear (a p90 over a
        mix sits on its slowest kind's share: a multiturn run's openings, a mixed run's
        documents)."""
        by_kind: dict[str, list[float]] = {}
        for kind, ttft in zip(self.kinds, self.ttfts):
            by_kind.setdefault(kind, []).append(ttft)
        return {kind: LatencyStats.of(ttfts) for kind, ttfts in by_kind.items()}


def compute_result(
    records: list[RequestRecord], duration: float, slo: SLO = SLO(), meta: dict | None = None
) -> BenchResult:
    sent_indices = [i for i, r in enumerate(records) if r.success]
    done = [records[i] for i in sent_indices]
    ttfts = [r.ttft for r in done]
    tpots = [t for t in (r.tpot for r in done) if t is not None]
    itls = [gap for r in done for gap in r.itls]
    e2els = [r.e2el for r in done]
    total_in = sum(r.prompt_tokens for r in done)
    total_out = sum(r.output_tokens for r in done)
    good = sum(slo.met_by(r) for r in records)
    per_s = 1.0 / duration if duration > 0 else 0.0
    return BenchResult(
        num_requests=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        duration=duration,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(done) * per_s,
        request_goodput=good * per_s if slo.is_set else None,
        output_throughput=total_out * per_s,
        total_token_throughput=(total_in + total_out) * per_s,
        slo_attainment=(good / len(records) if records else 0.0) if slo.is_set else None,
        ttft_ms=LatencyStats.of(ttfts),
        tpot_ms=LatencyStats.of(tpots),
        itl_ms=LatencyStats.of(itls),
        e2el_ms=LatencyStats.of(e2els),
        slo_ttft_s=slo.ttft_s,
        slo_tpot_s=slo.tpot_s,
        ttfts=ttfts,
        tpots=tpots,
        itls=itls,
        e2els=e2els,
        input_lens=[r.prompt_tokens for r in done],
        output_lens=[r.output_tokens for r in done],
        sent_indices=sent_indices,
        kinds=[r.kind for r in done],
        errors=[r.error for r in records if not r.success],
        meta=dict(meta or {}),
    )


def format_result(res: BenchResult, title: str = "Serving Benchmark Result") -> str:
    """A text table in the layout of `vllm bench serve`'s summary."""

    def opt(v, fmt="{:.2f}"):
        return "n/a" if v is None else fmt.format(v)

    rows = [
        ("Successful requests:", res.completed),
        ("Failed requests:", res.failed),
        ("Benchmark duration (s):", f"{res.duration:.2f}"),
        ("Total input tokens:", res.total_input_tokens),
        ("Total generated tokens:", res.total_output_tokens),
        ("Request throughput (req/s):", f"{res.request_throughput:.2f}"),
        ("Request goodput (req/s):", opt(res.request_goodput)),
        ("SLO attainment:", opt(res.slo_attainment, "{:.1%}")),
        ("Output token throughput (tok/s):", f"{res.output_throughput:.2f}"),
        ("Total token throughput (tok/s):", f"{res.total_token_throughput:.2f}"),
    ]
    lines = [f"{title:=^60}"] + [f"{k:<42}{v:>18}" for k, v in rows]
    names = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
        "e2el": "End-to-end Latency",
    }
    for metric, name in names.items():
        stats: LatencyStats = getattr(res, f"{metric}_ms")
        lines.append(f"{name:-^60}")
        for stat in ("mean", "median", "p90", "p99"):
            label = f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()}"
            lines.append(
                f"{label + ' ' + metric.upper() + ' (ms):':<42}{getattr(stats, stat):>18.2f}"
            )
    by_kind = res.ttft_by_kind()
    if len(by_kind) > 1:
        lines.append(f"{'TTFT by kind of request':-^60}")
        lines.append(f"{'kind (requests)':<24}{'median (ms)':>18}{'p90 (ms)':>18}")
        counts = {k: res.kinds.count(k) for k in by_kind}
        for kind, stats in by_kind.items():
            lines.append(f"{f'{kind} ({counts[kind]})':<24}{stats.median:>18.2f}{stats.p90:>18.2f}")
    lines.append("=" * 60)
    return "\n".join(lines)
