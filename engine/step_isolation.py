"""When a step's forward raises: find the request(s) it fails for, and fail only those.

The forward writes only each request's own KV slots (positions num_computed .. + n, in blocks
the request owns alone; shared prefix blocks are full and never rewritten) and nothing
advances until the update, so running a part of the step again is safe. The batch is split in
halves, each half run again; a half that still fails is split again, down to single
sequences. The halves that run get their tokens as in any step.

Bounds: at most 2 * ceil(log2(batch)) forwards, each of at most half the batch, which finds
one culprit whatever its place (a forward that fails for a batch size, not for a request,
succeeds on the halves and fails nobody). Sequences not reached when the budget is spent stay
in the batch for the next step, which finds at least one more culprit. Nothing here runs
unless a forward raised.

Who is to blame: a single sequence whose forward fails alone while another part of the same
step ran is a culprit (an engine error, its client's). When nothing at all ran in the step,
a lone request's step included, the worker is to blame: every request of the step fails
with a ``WorkerError``, which the router moves elsewhere. Blaming a lone request instead would
fail a good request whenever a worker breaks (its first failing step, the circuit breaker's
case); a request that really breaks every forward goes around on other workers only until
the router's migration limit, then fails with the cause.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from engine.errors import EngineError, StepUpdateError, WorkerError

if TYPE_CHECKING:
    from engine.scheduler import ScheduledSequence, SchedulerOutput
    from engine.step import StepLoop

log = logging.getLogger("pdserve.engine")


class _Bisection:
    def __init__(self, loop: StepLoop, batch_size: int):
        self.loop = loop
        self.budget = 2 * math.ceil(math.log2(batch_size)) if batch_size > 1 else 0
        self.num_runs = 0
        self.any_ran = False
        self.culprits: list[tuple[ScheduledSequence, BaseException]] = []

    def find(self, seqs: list[ScheduledSequence], error: BaseException) -> None:
        """``seqs`` failed together with ``error``: run each half again, split what fails."""
        if len(seqs) == 1:
            self.culprits.append((seqs[0], error))
            return
        half = len(seqs) // 2
        for part in (seqs[:half], seqs[half:]):
            if self.num_runs >= self.budget:
                return  # left in the batch: the next step goes on looking
            part_error = self._run(part)
            if part_error is None:
                self.any_ran = True
            else:
                self.find(part, part_error)

    def _run(self, seqs: list[ScheduledSequence]) -> BaseException | None:
        from engine.scheduler import SchedulerOutput

        self.num_runs += 1
        try:
            self.loop.run(SchedulerOutput(list(seqs)))
        except StepUpdateError:
            raise
        except Exception as e:  # noqa: BLE001 - what the part fails with
            return e
        return None


def isolate_failed_forward(loop: StepLoop, plan: SchedulerOutput, error: BaseException) -> None:
    """``plan``'s forward raised ``error``: fail the request(s) it fails for, run the rest."""
    seqs = plan.scheduled
    log.warning("a forward of %d sequences failed (%r); isolating the cause", len(seqs), error)
    search = _Bisection(loop, len(seqs))
    search.find(seqs, error)
    worker_broken = not search.any_ran
    with loop.lock:
        if worker_broken:
            loop.num_worker_errors += 1
            log.error("every request of the step failed alone too: the worker is broken")
            for s in seqs:
                loop.fail(s.request, WorkerError(error))
            return
        for s, cause in search.culprits:
            loop.fail(s.request, cause if isinstance(cause, EngineError) else EngineError(cause))
    log.warning(
        "isolated %d failing request(s) in %d forwards", len(search.culprits), search.num_runs
    )
