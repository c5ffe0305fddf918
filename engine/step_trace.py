"""Per-step timings of a live worker, to read a planner profile against a real run.

With ``PDSERVE_STEP_TRACE=DIR`` in its environment, each worker appends one JSON line per step
to ``DIR/<worker id>.jsonl``: when the step started (wall clock, so several processes' lines
line up), how long its forward and update took, and the plan's shape in the terms the
planner's profile prices a step (``PlanShape``). Off unless the variable is set; one short
line per step when on.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

ENV_VAR = "PDSERVE_STEP_TRACE"


@dataclass(frozen=True)
class PlanShape:
    """What a step computes: decode rows and the context they attend over, prompt tokens and
    the offsets they start at, and the rows sampled at a temperature (greedy rows are in the
    profile's tables)."""

    decode_rows: int = 0
    decode_context: int = 0  # summed over decode rows, each counting its new token
    prompt_tokens: int = 0
    prompt_work: int = 0  # sum of new tokens x tokens already computed: the mean offset's weight
    sampled: int = 0

    @classmethod
    def of(cls, scheduled) -> PlanShape:
        """The shape of a plan's ``scheduled`` sequences, read before the step runs (the
        update advances each request's computed tokens)."""
        dec_n = dec_ctx = pre_n = pre_work = sampled = 0
        for s in scheduled:
            done = s.request.num_computed_tokens
            if s.num_new_tokens == 1 and done >= s.request.num_prompt_tokens:
                dec_n += 1
                dec_ctx += done + 1
            else:
                pre_n += s.num_new_tokens
                pre_work += s.num_new_tokens * done
            sampled += bool(s.samples and not s.request.sampling.is_greedy)
        return cls(dec_n, dec_ctx, pre_n, pre_work, sampled)


class StepTrace:
    """Appends one line per step; ``from_env`` returns None when tracing is off."""

    def __init__(self, path: str | Path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the worker's life

    @classmethod
    def from_env(cls, worker_id: str) -> StepTrace | None:
        folder = os.environ.get(ENV_VAR)
        return cls(Path(folder) / f"{worker_id}.jsonl") if folder else None

    def record(self, started: float, seconds: float, shape: PlanShape) -> None:
        line = {"t": round(started, 6), "s": round(seconds, 6), **asdict(shape)}
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()


def read_trace(path: str | Path) -> list[dict]:
    """A trace file's steps, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
