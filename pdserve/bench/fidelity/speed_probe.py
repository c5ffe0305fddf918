"""How fast this machine runs the profile's own steps right now, against the profile.

A shared VM's speed drifts: on the Zen 5 VM of docs/PLANNING.md section 4 the same live
workload's batch-1 decode steps took 22.4 ms in one half hour and 17.4 ms in the next. A
profile measured at one time prices every step of a run made at another by the speed of the
first. The probe times a few of the profile's own grid points on a bare engine built from the
profile's engine settings, with its thread count, just before (and after) a real run, and
divides by the profile's prices there: the ratios say how much slower (> 1) or faster the
machine is than when it was profiled. ``Profile.at_speed`` rescales a profile by them.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace

import torch

from pdserve.planner.profile import Profile


def probe_points(profile: Profile) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Grid points of the profile a live run steps through most: decode at its smallest batch
    and context and at the middle of both (the full grid: (1, 64) and (8, 512)); prefill at
    offset 0 of the large prompt, then the small one (``Profile.prefill_probe_tokens``; the
    full grid: 256 and 16 tokens)."""
    rows, cols = profile.decode.rows, profile.decode.cols
    decode = [(rows[0], cols[0]), (rows[len(rows) // 2], cols[len(cols) // 2])]
    small, large = profile.prefill_probe_tokens()
    prefill = [(large, profile.prefill.cols[0]), (small, profile.prefill.cols[0])]
    return [(int(b), int(c)) for b, c in decode], [(int(n), int(c)) for n, c in prefill]


@dataclass(frozen=True)
class Speed:
    """Seconds now over the profile's seconds, per step kind (1.0: as profiled).
    ``prefill`` is a large prompt's ratio, ``prefill_small`` a small one's: on a shared VM a
    16-token step, mostly per-step work, drifts further than a 256-token one (PLANNING.md).
    None: not probed (runs stored before the small prompt was probed)."""

    decode: float = 1.0
    prefill: float = 1.0
    prefill_small: float | None = None

    def to_dict(self) -> dict:
        out = {"decode": round(self.decode, 4), "prefill": round(self.prefill, 4)}
        if self.prefill_small is not None:
            out["prefill_small"] = round(self.prefill_small, 4)
        return out

    @classmethod
    def mean(cls, speeds: list[Speed]) -> Speed:
        smalls = [s.prefill_small for s in speeds if s.prefill_small is not None]
        return cls(
            sum(s.decode for s in speeds) / len(speeds),
            sum(s.prefill for s in speeds) / len(speeds),
            sum(smalls) / len(smalls) if smalls else None,
        )


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


class SpeedProbe:
    """A bare engine as the profile measured it, kept for repeated probes in one process."""

    def __init__(self, profile: Profile, reps: int = 5):
        from engine.llm_engine import build_engine
        from pdserve.planner.measure import Grid, WorkerTimer

        self.profile = profile
        self.threads = int(profile.meta.get("threads") or 1)
        self.decode_points, self.prefill_points = probe_points(profile)
        batches = [b for b, _ in self.decode_points]
        contexts = [c for _, c in self.decode_points]
        grid = Grid((), (), tuple(batches), tuple(contexts), (), reps=reps, decode_steps=4)
        blocks = max(batches) * (max(contexts) // profile.engine.block_size + 2) + 64
        with torch_threads(self.threads):
            engine = build_engine(replace(profile.engine, num_blocks=blocks))
        self.timer = WorkerTimer(engine, grid)

    def measure(self) -> Speed:
        with torch_threads(self.threads):
            decode = [
                self.timer.decode(b, c) / self.profile.decode_seconds(b, c)
                for b, c in self.decode_points
            ]
            prefill = [
                self.timer.prefill(n, c) / self.profile.prefill_seconds(n, c)
                for n, c in self.prefill_points
            ]
        large, small = prefill  # probe_points' order
        return Speed(geometric_mean(decode), large, small)


@contextlib.contextmanager
def torch_threads(threads: int):
    """torch's intra-op thread count for a block (the profile's workers run one each)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
