"""What a prefill worker and a decode worker share: an engine driven by its own thread through
the engine's one step (engine/step.py; the worker is its hooks), aborts deferred to that
thread, and a draining flag. No networking here."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable

from engine.llm_engine import LLMEngine
from engine.loop import EngineThread
from engine.request import Request, SamplingParams, check_token_ids
from engine.step import StepHooks, StepLoop
from engine.step_trace import StepTrace
from engine.warmup import warm_up


class EngineWorker(StepHooks):
    role = "worker"

    def __init__(self, engine: LLMEngine, worker_id: str | None = None):
        self.engine = engine
        self.worker_id = worker_id or f"{self.role}-{uuid.uuid4().hex[:8]}"
        self.scheduler = engine.scheduler
        self.blocks = engine.blocks
        lock = threading.RLock()
        trace = StepTrace.from_env(self.worker_id)  # PDSERVE_STEP_TRACE: per-step timings
        self.step_loop = StepLoop(self.scheduler, engine.executor, self, lock, trace)
        self.loop = EngineThread(
            self.step_loop.step, self._fail_all, name=f"{self.worker_id}-engine", lock=lock
        )
        self._aborts: set[str] = set()
        self._draining = False
        # Called with the new value whenever ``draining`` changes (health services follow it).
        self.on_draining_change: list[Callable[[bool], None]] = []
        self.warmup_s: float | None = None  # seconds the warm-up took (None: not run yet)
        # Core sharing with the other worker of a node group (engine/core_share.py): this
        # role's side, called from the step's hooks; None: the thread count stays as built.
        self.cores = None
        self._threads_built = 0  # torch threads of the process that built the engine

    @property
    def draining(self) -> bool:
        """No new work is accepted; what runs finishes."""
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        changed = value != self._draining
        self._draining = value
        if changed:
            for callback in self.on_draining_change:
                callback(value)

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    def start(self) -> None:
        """Warm every kernel path up, then start the engine thread: the worker's server starts
        (and the worker reports ready) only after this returns, so no request meets a cold
        process."""
        import torch

        self.warmup_s = warm_up(self.engine)
        self._threads_built = torch.get_num_threads()
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()
        if self.cores is not None:  # after the engine thread: it publishes to the ledger
            self.cores.close()

    def abort(self, request_id: str) -> None:
        """Abort from an RPC thread: applied by the engine thread between steps, so a batch in
        flight never loses blocks it is writing."""
        with self.loop.lock:
            self._aborts.add(request_id)
        self.loop.wake()

    def new_request(
        self, request_id: str, prompt: list[int], outputs: list[int], sampling: SamplingParams
    ) -> Request:
        """A request arriving over RPC: its prompt, tokens generated before (a re-prefill after
        preemption, or a prefilled first token) and this model's EOS ids. Every token id is
        checked against the vocabulary here, at admission, so a bad one is refused alone
        instead of failing the batch it would join."""
        check_token_ids(self.engine.config.model.vocab_size, prompt, sampling, outputs)
        if sampling.guide is not None:  # compiles, and can begin: refused here, not in a step
            self.engine.sampler.check_guide(*sampling.guide)
        return Request(
            request_id,
            list(prompt),
            sampling,
            eos_token_ids=self.engine.eos_token_ids,
            output_token_ids=list(outputs),
        )

    def base_status(self) -> dict:
        """Status fields every worker reports (call with ``loop.lock`` held)."""
        return {
            "worker_id": self.worker_id,
            "role": self.role,
            "num_free_blocks": self.blocks.num_free,
            "num_total_blocks": self.blocks.num_total,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "draining": self.draining,
            "cpu_kernels": self._cpu_kernels(),
            **self._thread_share(),
            **self._ranks(),
        }

    def _ranks(self) -> dict:
        """A tensor-parallel worker's ranks (size; each rank's pid and whether it lives)."""
        tp = self.engine.runner.tensor_parallel_status()
        return {"tensor_parallel": tp} if tp["size"] > 1 else {}

    def _thread_share(self) -> dict:
        """The torch threads this worker's engine runs with now, and the cores it shares with
        its node group's other worker (0: not shared)."""
        if self.cores is None:
            return {"threads": self._threads_built, "node_cores": 0}
        return {"threads": self.cores.threads, "node_cores": self.cores.settings.cores}

    def _cpu_kernels(self) -> str:
        """Which build of the CPU extension runs this worker's kernels ("" on a GPU)."""
        if self.engine.runner.device.type != "cpu":
            return ""
        from kernels import cpu_extension

        return cpu_extension.selected_variant()

    def _fail_all(self, error: BaseException) -> None:
        raise NotImplementedError
