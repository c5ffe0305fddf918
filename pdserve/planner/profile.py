"""A worker's latency profile: what one forward, one KV transfer and the router cost here.

Measured by ``pdserve profile`` (measure.py) or written by hand from published figures (see
``profiles/``). Tables are piecewise linear between measured points and extrapolate linearly
past the last one (a batch larger than any measured costs what the last slope says); below the
first point they hold the first value (a forward's fixed cost dominates there).

A step's cost, from the scheduler's plan (``step_seconds``):
  decode only   decode[batch][mean context]
  prefill only  prefill[new tokens][token-weighted mean offset]
  mixed         prefill[new tokens + decode rows][offset] + the decode rows' attention, i.e.
                decode[b][context] - decode[b][smallest context]: decode rows are more GEMM
                rows, and their attention is what grows with context.
  plus, in every kind, ``sample_seconds_per_row`` for each row it samples at a temperature
  (the tables are timed greedy; a temperature row sorts the vocabulary for top-p).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from engine.settings import EngineSettings  # the worker settings a profile was measured with
from engine.step_trace import PlanShape  # a plan in the terms the tables price it
from pdserve.planner.cpu_corrections import CpuCorrections

PROFILE_VERSION = 1
# Worker settings added after profiles were first written (tensor parallelism, #49).
ENGINE_KEYS_SINCE_V1 = ("tensor_parallel_size", "tp_host")


def interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear ``ys(x)``; flat below ``xs[0]``, linear past ``xs[-1]`` (never
    downward: a bigger batch or a longer context is not faster)."""
    if x <= xs[0] or len(xs) == 1:
        return ys[0]
    i = min(bisect_right(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    if x > x1:
        return y1 + max(0.0, (y1 - y0) / (x1 - x0)) * (x - x1)
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


SPIKE = 1.15  # a point this far over both its neighbours on an axis is a disturbed timing


def despike(seconds: Sequence[Sequence[float]], spike: float = SPIKE) -> list[list[float]]:
    """Each point that stands over both its neighbours along a row or a column by more than
    ``spike`` x the larger, replaced by their mean. A timing the machine disturbed (a neighbour
    process, a page fault) is one point; ``monotone`` would carry it to every larger shape
    (Zen 4: batch 2 at context 64 read 36.3 ms between 27.2 at batch 1 and 29.7 at batch 4,
    and priced batches 2-8 there at 36.3)."""
    out = [list(r) for r in seconds]
    for i, row in enumerate(seconds):
        for j, x in enumerate(row):
            for lo, hi in _neighbour_pairs(seconds, i, j):
                if x > spike * max(lo, hi):
                    out[i][j] = (lo + hi) / 2
                    break
    return out


def _neighbour_pairs(seconds: Sequence[Sequence[float]], i: int, j: int):
    """The point's two neighbours along its column, then along its row, where it has both."""
    if 0 < i < len(seconds) - 1:
        yield seconds[i - 1][j], seconds[i + 1][j]
    if 0 < j < len(seconds[i]) - 1:
        yield seconds[i][j - 1], seconds[i][j + 1]


def monotone(seconds: Sequence[Sequence[float]]) -> tuple[tuple[float, ...], ...]:
    """Running maximum along both axes: on a shared machine a point measured in a quiet
    moment can come out below a smaller one, and more work is never faster."""
    rows = [list(itertools.accumulate(r, max)) for r in seconds]
    for j in range(len(rows[0]) if rows else 0):
        for i in range(1, len(rows)):
            rows[i][j] = max(rows[i][j], rows[i - 1][j])
    return tuple(tuple(r) for r in rows)


@dataclass(frozen=True)
class Table2D:
    """``seconds[i][j]`` measured at ``rows[i]``, ``cols[j]``."""

    rows: tuple[float, ...]
    cols: tuple[float, ...]
    seconds: tuple[tuple[float, ...], ...]
    # Steps repeat the same (batch, context) shapes: memoized on rounded coordinates.
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.seconds) != len(self.rows) or any(
            len(r) != len(self.cols) for r in self.seconds
        ):
            raise ValueError("table shape does not match its axes")
        if list(self.rows) != sorted(set(self.rows)) or list(self.cols) != sorted(set(self.cols)):
            raise ValueError("table axes must be strictly increasing")

    def lookup(self, row: int, col16: int) -> float:
        key = (row, col16)
        t = self._memo.get(key)
        if t is None:
            t = self._memo[key] = self.at(row, col16 * 16)
        return t

    def at(self, row: float, col: float) -> float:
        by_row = [interp(self.cols, line, col) for line in self.seconds]
        return interp(self.rows, by_row, row)

    def scaled(self, factor: float | Sequence[float]) -> Table2D:
        """Every entry times ``factor``, or each row times its own (one factor per row)."""
        factors = [factor] * len(self.rows) if isinstance(factor, (int, float)) else factor
        return Table2D(
            self.rows,
            self.cols,
            tuple(tuple(t * f for t in r) for f, r in zip(factors, self.seconds, strict=True)),
        )

    @classmethod
    def from_dict(cls, d: dict) -> Table2D:
        return cls(tuple(d["rows"]), tuple(d["cols"]), tuple(tuple(r) for r in d["seconds"]))


@dataclass(frozen=True)
class Profile:
    prefill: Table2D  # rows: new tokens in the step, cols: offset (tokens already computed)
    decode: Table2D  # rows: sequences in the batch, cols: mean context per sequence
    transfer_bytes: tuple[float, ...]  # a whole request's KV pushed, bytes
    transfer_seconds: tuple[float, ...]
    router_overhead_s: float  # what the router adds to the first token (fake workers)
    kv_bytes_per_token: int
    num_layers: int
    engine: EngineSettings = field(default_factory=EngineSettings)
    # What a sampled row costs over a greedy one (the tables are timed greedy; a temperature
    # row sorts the vocabulary for top-p): on any device, so not a CPU correction.
    sample_seconds_per_row: float = 0.0
    # Workers sharing a few CPU cores: fitted corrections, neutral by default (GPU profiles).
    cpu: CpuCorrections = field(default_factory=CpuCorrections)
    meta: dict = field(default_factory=dict)  # hardware, model, dtype, versions, date

    @property
    def devices_per_worker(self) -> int:
        """Devices one worker spans: its tensor-parallel degree (``meta["tp"]``; 1 for a CPU
        or one-GPU worker)."""
        return int(self.meta.get("tp") or getattr(self.engine, "tensor_parallel_size", 1) or 1)

    @property
    def shape_label(self) -> str:
        """Hardware and TP degree, as a plan names a pool's worker shape."""
        hw = self.meta.get("hardware")
        name = hw.get("name") if isinstance(hw, dict) else hw
        return f"{name or self.meta.get('device', '?')} x{self.devices_per_worker}"

    @property
    def validation(self) -> dict:
        """What this profile's validation measured: ``{"p50_ttft": 0.074, ..., "how": "..."}``
        as relative errors, or ``{"none": why}`` (a roofline, a profile never checked)."""
        v = self.meta.get("validation")
        if isinstance(v, dict) and v:
            return v
        source = str(self.meta.get("source", ""))
        if "roofline" in source or "analytic" in source:
            return {"none": "roofline from published figures, not measured"}
        return {"none": "not validated against live runs"}

    def with_cpu(self, **corrections) -> Profile:
        """This profile with some of its CPU corrections replaced."""
        return replace(self, cpu=replace(self.cpu, **corrections))

    # ---- latencies -----------------------------------------------------------------------
    def prefill_seconds(self, tokens: float, offset: float = 0.0) -> float:
        return self.prefill.lookup(round(tokens), round(offset / 16))

    def decode_seconds(self, batch: float, context: float) -> float:
        return self.decode.lookup(round(batch), round(context / 16))

    def transfer_seconds_for(self, num_tokens: int) -> float:
        """Time to push ``num_tokens`` tokens of KV, start to commit."""
        nbytes = num_tokens * self.kv_bytes_per_token
        if len(self.transfer_bytes) == 1:
            return self.transfer_seconds[0] * nbytes / self.transfer_bytes[0]
        return interp(self.transfer_bytes, self.transfer_seconds, nbytes)

    def exposed_transfer_s(self, num_tokens: int, prefill_s: float) -> float:
        """The transfer's part after the first token: streamed layer by layer during prefill,
        only the last layer's frames are left once compute ends, unless the link is slower."""
        total = self.transfer_seconds_for(num_tokens)
        return max(total - prefill_s, total / max(self.num_layers, 1))

    @staticmethod
    def has_prefill(scheduled) -> bool:
        """Whether a plan computes prompt tokens (a prefill or mixed step), not only decodes."""
        return any(
            s.num_new_tokens > 1 or s.request.num_computed_tokens < s.request.num_prompt_tokens
            for s in scheduled
        )

    def step_seconds(self, scheduled) -> float:
        """One forward over a scheduler plan's ``scheduled`` sequences, and its sampling."""
        return self.shape_seconds(PlanShape.of(scheduled))

    def shape_seconds(self, shape: PlanShape) -> float:
        """A step of this shape: its forward and its rows sampled at a temperature, a
        decode-only step at its batch's live factor (``decode_row_factors``)."""
        t = self.forward_seconds(shape) + shape.sampled * self.sample_seconds_per_row
        if self.cpu.decode_row_factors and not shape.prompt_tokens and shape.decode_rows:
            t *= self.decode_row_factor(shape.decode_rows)
        return t

    def decode_row_factor(self, rows: int) -> float:
        """``decode_row_factors`` between the table's batch sizes, flat past both ends."""
        if not self.cpu.decode_row_factors:
            return 1.0
        return _row_factor(self.decode.rows, self.cpu.decode_row_factors, rows)

    def forward_seconds(self, shape: PlanShape) -> float:
        """The forward (and a greedy sample per row, as the tables were timed)."""
        dec_n, pre_n = shape.decode_rows, shape.prompt_tokens
        if not pre_n:
            return self.decode_seconds(dec_n, shape.decode_context / dec_n) if dec_n else 0.0
        t = self.prefill_seconds(pre_n + dec_n, shape.prompt_work / pre_n)
        if dec_n:
            ctx = shape.decode_context / dec_n
            t += self.decode_seconds(dec_n, ctx) - self.decode_seconds(dec_n, self.decode.cols[0])
        return t

    def at_speed(
        self, decode: float = 1.0, prefill: float = 1.0, prefill_small: float | None = None
    ) -> Profile:
        """This profile on the same machine running ``decode`` / ``prefill`` times slower (a
        speed probe's ratios, pdserve/planner/speed_probe.py): each kind's table and its
        once-per-step co-run work scaled; the shares and slowdowns are ratios, kept.
        ``prefill_small``: the ratio at the probe's small prompt, where ``prefill`` is the one at
        its large prompt (``prefill_probe_tokens``); the prefill rows between the two then
        scale log-linearly in tokens from one to the other, and each end's beyond it."""
        return replace(
            self,
            prefill=self.prefill.scaled(self._prefill_row_factors(prefill, prefill_small)),
            decode=self.decode.scaled(decode),
            cpu=self.cpu.at_speed(decode, prefill),
        )

    def prefill_probe_tokens(self) -> tuple[int, int]:
        """The prompt lengths a speed probe times (at offset 0): the table's smallest row, where
        per-step work dominates, and a large one, where the matmuls do."""
        rows = self.prefill.rows
        return int(rows[0]), int(rows[len(rows) * 2 // 3])

    def _prefill_row_factors(self, large: float, small: float | None) -> list[float]:
        if small is None:
            return [large] * len(self.prefill.rows)
        lo, hi = (math.log(n) for n in self.prefill_probe_tokens())
        out = []
        for tokens in self.prefill.rows:
            share = min(1.0, max(0.0, (math.log(tokens) - lo) / (hi - lo))) if hi > lo else 1.0
            out.append(math.exp((1 - share) * math.log(small) + share * math.log(large)))
        return out

    # ---- files ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The JSON form: the corrections as top-level keys, in the order profiles have
        always been written (the sample cost among them)."""
        d = asdict(self)
        for table in ("prefill", "decode"):
            d[table].pop("_memo")
        for key in ENGINE_KEYS_SINCE_V1:  # written once set: older files read back the same
            if d["engine"].get(key) == getattr(EngineSettings, key):
                d["engine"].pop(key)
        cpu, meta, sample = d.pop("cpu"), d.pop("meta"), d.pop("sample_seconds_per_row")
        for key, value in cpu.items():
            if key == "router_cpu_per_request_s":
                d["sample_seconds_per_row"] = sample
            d[key] = value
        d.update(meta=meta, version=PROFILE_VERSION)
        return d

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        try:
            return cls(
                prefill=Table2D.from_dict(d["prefill"]),
                decode=Table2D.from_dict(d["decode"]),
                transfer_bytes=tuple(d["transfer_bytes"]),
                transfer_seconds=tuple(d["transfer_seconds"]),
                router_overhead_s=float(d["router_overhead_s"]),
                kv_bytes_per_token=int(d["kv_bytes_per_token"]),
                num_layers=int(d["num_layers"]),
                engine=EngineSettings(**d.get("engine", {})),
                sample_seconds_per_row=float(d.get("sample_seconds_per_row", 0.0)),
                cpu=CpuCorrections.from_dict(d, len(d["decode"]["rows"])),
                meta=dict(d.get("meta", {})),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a valid profile: {type(e).__name__}: {e}") from None


@functools.lru_cache(maxsize=4096)
def _row_factor(rows: tuple, factors: tuple, n: int) -> float:
    return interp(rows, factors, min(n, rows[-1]))


def read_json(path: str | Path, what: str = ""):
    """A JSON file's contents; ValueError naming the file (as ``what``) if it cannot be read or
    is not JSON."""
    name = f"{what} {path}" if what else str(path)
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read {name}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} is not JSON: {e}") from None


def load_profile(path: str | Path) -> Profile:
    data = read_json(path, "profile")
    try:
        return Profile.from_dict(data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
