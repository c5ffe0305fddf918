"""The one engine step: schedule → run → update, shared by the colocated engine, both workers
and the planner's simulator. What differs between them are the hooks and the executor.

Locking: ``lock`` is held while the scheduler plans and while it takes the tokens back, never
while the executor runs, so an RPC thread that admits a request (reserve, submit, abort) waits
for at most a scheduling pass, not a whole forward.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Protocol

from engine.scheduler import Scheduler, SchedulerOutput

if TYPE_CHECKING:
    from engine.model import LayerCallback
    from engine.model_runner import ModelRunner
    from engine.request import Request
    from engine.sampler import Sampler

TokensDone = Callable[[list[int]], None]


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
        """The requests that got a token this step (some may have finished)."""


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
        done(self.sampler.sample(logits, [s.request for s in plan.scheduled if s.samples]))


class StepLoop:
    """One engine step; whoever drives it (an engine thread, ``LLMEngine.generate``, the
    simulator's event queue) calls ``step()`` while it returns True."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        hooks: StepHooks,
        lock: AbstractContextManager | None = None,
    ):
        self.scheduler = scheduler
        self.executor = executor
        self.hooks = hooks
        self.lock = lock if lock is not None else nullcontext()

    def step(self) -> bool:
        """Plan and start one step; False when there was nothing to run."""
        with self.lock:
            self.hooks.before_schedule()
            plan = self.scheduler.schedule()
            self.hooks.on_planned(plan)
        if plan.is_empty:
            return False
        after_layer = self.hooks.layer_callback(plan)
        self.executor.run(plan, after_layer, lambda tokens: self._update(plan, tokens))
        return True

    def _update(self, plan: SchedulerOutput, tokens: list[int]) -> None:
        with self.lock:
            updated = self.scheduler.update(plan, tokens, check_stop=self.hooks.check_stop)
            self.hooks.on_updated(updated)
