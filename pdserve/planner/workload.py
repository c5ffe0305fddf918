"""What the simulator serves: arrival times and token lengths, synthetic or from a trace.

Arrivals: ``poisson`` (exponential gaps), ``gamma`` (bursty: gaps with coefficient of variation
``cv`` > 1; cv = 1 is Poisson) or a trace's own times (scaled to a requested rate). Lengths:
named distributions (uniform integer ranges, in tokens), ``P_LO-P_HI/O_LO-O_HI`` for a custom
uniform one (``512/128`` for fixed lengths), or a JSONL trace of
``{"arrival_s": float, "prompt_tokens": int, "output_tokens": int}`` per line, which is what
``pdserve trace`` records from a live router.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ARRIVALS = ("poisson", "gamma")


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class LengthDist:
    """Uniform integer prompt and output lengths (inclusive ranges); a mix picks a component
    per request with the given weights."""

    prompt: tuple[int, int]
    output: tuple[int, int]

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        p = rng.integers(self.prompt[0], self.prompt[1] + 1, n)
        o = rng.integers(self.output[0], self.output[1] + 1, n)
        return p, o


# Token lengths. chat / longdoc / mixed are the shapes of pdserve.bench.loadgen.workloads on SmolLM2's
# tokenizer (chat template included; tests/test_planner_workload_shapes.py checks them): a
# document of 700-1,000 words is 841-1,180 tokens; longprompt and longoutput are the extremes.
NAMED: dict[str, list[tuple[float, LengthDist]]] = {
    "chat": [(1.0, LengthDist((49, 57), (64, 200)))],
    "longdoc": [(1.0, LengthDist((840, 1180), (32, 64)))],
    "mixed": [(0.8, LengthDist((49, 57), (64, 200))), (0.2, LengthDist((840, 1180), (32, 64)))],
    "longprompt": [(1.0, LengthDist((1200, 1800), (8, 24)))],
    "longoutput": [(1.0, LengthDist((16, 64), (200, 400)))],
}


def parse_lengths(spec: str) -> list[tuple[float, LengthDist]]:
    """A named distribution or ``P_LO-P_HI/O_LO-O_HI``; raises ValueError naming the spec."""
    if spec in NAMED:
        return NAMED[spec]
    try:
        prompt, output = spec.split("/")
        dist = LengthDist(_range(prompt), _range(output))
    except ValueError:
        raise ValueError(
            f"unknown workload {spec!r}: one of {', '.join(NAMED)}, or P_LO-P_HI/O_LO-O_HI "
            "in tokens (e.g. 1000-1500/20-40)"
        ) from None
    return [(1.0, dist)]


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 1 <= lo_i <= hi_i:
        raise ValueError(text)
    return lo_i, hi_i


def arrival_times(
    n: int, rate: float, seed: int = 0, arrival: str = "poisson", cv: float = 1.0
) -> np.ndarray:
    """``n`` arrival times from 0: gaps of mean 1/rate, exponential or gamma(cv)."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if arrival not in ARRIVALS:
        raise ValueError(f"unknown arrival process {arrival!r}; known: {', '.join(ARRIVALS)}")
    if cv <= 0:
        raise ValueError(f"cv must be > 0, got {cv}")
    rng = np.random.default_rng([seed, 7])
    if arrival == "poisson":
        gaps = rng.exponential(1.0 / rate, n)
    else:
        shape = 1.0 / cv**2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def synthetic(
    spec: str, n: int, rate: float, seed: int = 0, arrival: str = "poisson", cv: float = 1.0
) -> list[TraceRequest]:
    """``n`` requests of a named or custom length distribution on an arrival process."""
    mix = parse_lengths(spec)
    times = arrival_times(n, rate, seed, arrival, cv)
    rng = np.random.default_rng([seed, 11])
    weights = np.array([w for w, _ in mix]) / sum(w for w, _ in mix)
    which = rng.choice(len(mix), size=n, p=weights)
    prompts, outputs = np.zeros(n, dtype=int), np.zeros(n, dtype=int)
    for k, (_, dist) in enumerate(mix):
        idx = np.flatnonzero(which == k)
        prompts[idx], outputs[idx] = dist.sample(rng, len(idx))
    return [TraceRequest(float(t), int(p), int(o)) for t, p, o in zip(times, prompts, outputs)]


def at_rate(trace: list[TraceRequest], rate: float | None) -> list[TraceRequest]:
    """The trace with its times scaled so its mean rate is ``rate`` (None: as recorded)."""
    trace = sorted(trace, key=lambda r: r.arrival_s)
    if rate is None or len(trace) < 2:
        return trace
    t0 = trace[0].arrival_s
    span = trace[-1].arrival_s - t0
    if span <= 0:
        raise ValueError("the trace's requests all arrive at once: it has no rate to scale")
    scale = (len(trace) - 1) / rate / span
    return [
        TraceRequest((r.arrival_s - t0) * scale, r.prompt_tokens, r.output_tokens) for r in trace
    ]


def requests_for(
    rate: float, duration_s: float = 300.0, min_requests: int = 200, max_requests: int = 4000
) -> int:
    """How many requests make a run long enough to reach steady state at ``rate``: a few
    hundred requests all at once measure a transient (a queue that grows without bound still
    looks short), so the count grows with the rate, within bounds that keep a run fast."""
    return int(min(max(rate * duration_s, min_requests), max_requests))


def repeat_trace(trace: list[TraceRequest], n: int) -> list[TraceRequest]:
    """``n`` requests cycling through the trace's rows, each cycle after the last one."""
    trace = sorted(trace, key=lambda r: r.arrival_s)
    t0 = trace[0].arrival_s
    span = trace[-1].arrival_s - t0
    gap = span / max(len(trace) - 1, 1)
    out = []
    for i in range(n):
        cycle, r = divmod(i, len(trace))
        row = trace[r]
        t = row.arrival_s - t0 + cycle * (span + gap)
        out.append(TraceRequest(t, row.prompt_tokens, row.output_tokens))
    return out


def read_trace(path: str | Path) -> list[TraceRequest]:
    """A JSONL trace; a bad line is named by number."""
    out = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read trace {path}: {e.strerror}") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            req = TraceRequest(
                float(row["arrival_s"]), int(row["prompt_tokens"]), int(row["output_tokens"])
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"{path}:{lineno}: want {{arrival_s, prompt_tokens, output_tokens}} ({e})"
            ) from None
        if req.prompt_tokens < 1 or req.output_tokens < 1:
            raise ValueError(f"{path}:{lineno}: prompt_tokens and output_tokens must be >= 1")
        out.append(req)
    if not out:
        raise ValueError(f"trace {path} has no requests")
    return out


def write_trace(path: str | Path, trace: list[TraceRequest]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(asdict(r)) + "\n" for r in trace)
