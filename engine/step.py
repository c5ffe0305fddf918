"""The one engine step: schedule → run → update, shared by the colocated engine, both workers
and the planner's simulator. What differs between them are the hooks and the executor.

Locking: ``lock`` is held while the scheduler plans and while it takes the tokens back, never
while the executor runs, so an RPC thread that admits a request (reserve, submit, abort) waits
for at most a scheduling pass, not a whole forward.

Failures are the request's own (engine/step_isolation.py): work done per request (sampling,
bookkeeping, the hooks) that raises fails that request alone (FINISHED_ERROR, ``on_failed``);
a forward that raises is run again on halves of the batch to find the request(s) it fails for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Protocol

from engine.errors import EngineError, StepUpdateError, WorkerError
from engine.request import RequestStatus
from engine.scheduler import Scheduler, SchedulerOutput
from engine.step_isolation import isolate_failed_forward
from engine.step_trace import PlanShape, StepTrace

if TYPE_CHECKING:
    from engine.model import LayerCallback
    from engine.model_runner import ModelRunner
    from engine.request import Request
    from engine.sampler import Sampler

log = logging.getLogger("pdserve.engine")

# Called as done(tokens, failed=None): one token per sampling sequence of the plan, less those
# in ``failed`` (request id -> the exception its own sampling raised).
TokensDone = Callable[..., None]


class StepHooks:
    """What an owner of the loop adds to a step. Every hook but ``layer_callback`` runs with
    the loop's lock held; the defaults do nothing."""

    # Whether ``Scheduler.update`` ends requests at EOS / max_tokens. A prefill worker's
    # requests instead leave the batch at their first token, their KV still to be shipped.
    check_stop: bool = True

    def before_schedule(self) -> None:
        """Work deferred to the engine thread: aborts, lease expiry."""

    def on_planned(self, plan: SchedulerOutput) -> None:
        """Called for every plan, an empty one too (it may still have preempted requests)."""

    def layer_callback(self, plan: SchedulerOutput) -> LayerCallback | None:
        """Called outside the lock before the forward; the callback runs after each layer."""
        return None

    def on_updated(self, updated: list[Request]) -> None:
        """A request that got a token this step (some may have finished). Called once per
        request, ``[req]``, so that what raises for one request fails it alone."""

    def on_failed(self, req: Request, error: EngineError) -> None:
        """``req`` failed inside the step and is finished already (FINISHED_ERROR, its blocks
        freed, ``req.error`` set): tell its client. ``error`` is a ``WorkerError`` when the
        step failed for every request in it."""


class Executor(Protocol):
    """Runs a plan's forward and sampling, then calls ``done`` with one token per sampling
    sequence: at once (the model), or later on a simulated clock (the planner)."""

    def run(
        self, plan: SchedulerOutput, after_layer: LayerCallback | None, done: TokensDone
    ) -> None: ...


class ModelExecutor:
    """The real forward: the model runner's logits, then the sampler."""

    def __init__(self, runner: ModelRunner, sampler: Sampler):
        self.runner = runner
        self.sampler = sampler

    def run(
        self, plan: SchedulerOutput, after_layer: LayerCallback | None, done: TokensDone
    ) -> None:
        logits = self.runner.execute(plan.scheduled, after_layer)
        requests = [s.request for s in plan.scheduled if s.samples]
        tokens, errors = self.sampler.sample_isolated(logits, requests)
        failed = {requests[i].request_id: e for i, e in errors.items()}
        done([t for i, t in enumerate(tokens) if i not in errors], failed)


class StepLoop:
    """One engine step; whoever drives it (an engine thread, ``LLMEngine.generate``, the
    simulator's event queue) calls ``step()`` while it returns True."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        hooks: StepHooks,
        lock: AbstractContextManager | None = None,
        trace: StepTrace | None = None,
    ):
        self.scheduler = scheduler
        self.executor = executor
        self.hooks = hooks
        self.lock = lock if lock is not None else nullcontext()
        self.trace = trace  # a live worker's per-step timings (engine/step_trace.py), or None
        self.num_request_errors = 0  # requests failed alone, engine errors
        self.num_worker_errors = 0  # steps that failed for every request in them

    def step(self) -> bool:
        """Plan and start one step; False when there was nothing to run."""
        with self.lock:
            self.hooks.before_schedule()
            plan = self.scheduler.schedule()
            self.hooks.on_planned(plan)
        if plan.is_empty:
            return False
        if self.trace is not None:  # the shape before the update advances it
            shape, started, t0 = PlanShape.of(plan.scheduled), time.time(), time.perf_counter()
        try:
            self.run(plan)
        except StepUpdateError:
            raise
        except Exception as error:  # noqa: BLE001 - the forward: find whom it fails for
            isolate_failed_forward(self, plan, error)
        if self.trace is not None:
            self.trace.record(started, time.perf_counter() - t0, shape)
        return True

    def run(self, plan: SchedulerOutput) -> None:
        """The executor on ``plan`` (all of a step, or a part of it being isolated)."""
        after_layer = self.hooks.layer_callback(plan)
        self.executor.run(
            plan, after_layer, lambda tokens, failed=None: self._done(plan, tokens, failed)
        )

    def fail(self, req: Request, error: BaseException) -> None:
        """Finish ``req`` alone with FINISHED_ERROR (blocks freed once, by the scheduler) and
        tell its owner. Call with the lock held."""
        error = error if isinstance(error, EngineError) else EngineError(error)
        log.warning("request %s failed: %s", req.request_id, error)
        req.error = str(error)
        if req.is_finished:  # failed in a hook after it finished: its blocks are gone already
            req.status = RequestStatus.FINISHED_ERROR
        else:
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        self.num_request_errors += not isinstance(error, WorkerError)  # those count per step
        self.hooks.on_failed(req, error)

    def _done(self, plan: SchedulerOutput, tokens: list[int], failed) -> None:
        try:
            self._update(plan, tokens, failed or {})
        except Exception as e:
            raise StepUpdateError(f"step update failed: {type(e).__name__}: {e}") from e

    def _update(self, plan: SchedulerOutput, tokens: list[int], failed: dict) -> None:
        with self.lock:
            if failed:
                for s in plan.scheduled:
                    if s.request.request_id in failed:
                        self.fail(s.request, failed[s.request.request_id])
                kept = [s for s in plan.scheduled if s.request.request_id not in failed]
                plan = SchedulerOutput(kept)
            updated = self.scheduler.update(
                plan, tokens, check_stop=self.hooks.check_stop, on_error=self.fail
            )
            for req in updated:
                try:
                    self.hooks.on_updated([req])
                except Exception as e:  # noqa: BLE001 - this request's bookkeeping: its own
                    self.fail(req, e)
