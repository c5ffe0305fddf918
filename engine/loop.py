"""The engine thread a worker runs: step while there is work, sleep until woken when idle.

RPC threads and the engine thread share the scheduler and block manager through ``lock``;
the step (engine/step.py) runs the forward outside the lock, so admissions never wait for a
whole step.

Liveness (``problem``): the thread records when the step in progress began, so a watchdog
(grpc_plumbing/health.py) can tell a step that has run past a bound (a forward stuck in a
kernel, a lock never released) from an idle engine; and a thread that died (its error handler
raised) says so, instead of leaving a worker that looks alive with nothing stepping.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("pdserve.engine")

IDLE_WAIT_S = 0.05  # an idle engine looks for work this often even if nobody wakes it


class EngineThread:
    def __init__(
        self,
        step: Callable[[], bool],
        on_error: Callable[[BaseException], None],
        name: str,
        lock: threading.RLock | None = None,
    ):
        """``step()`` returns whether it did work; ``on_error`` fails in-flight requests as a
        worker error (the step raised outside any one request: a failing request or forward is
        handled inside the step, engine/step_isolation.py); ``lock`` is the one ``step`` takes
        around scheduling (a new one if None)."""
        self.lock = lock if lock is not None else threading.RLock()
        self._step = step
        self._on_error = on_error
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.step_started: float | None = None  # monotonic, while a step runs
        self.death: str | None = None  # why the thread ended on its own

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def stopped(self) -> bool:
        """``stop`` was called."""
        return self._stopped.is_set()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    def problem(self, stall_timeout_s: float) -> str | None:
        """Why this engine cannot serve (None: it can): its thread died, or the step in
        progress has run longer than ``stall_timeout_s``. An idle engine is fine."""
        if self.death is not None:
            return f"engine thread died: {self.death}"
        if self._thread.ident is not None and not self._thread.is_alive():
            return "engine thread is not running"
        started = self.step_started
        if started is not None and time.monotonic() - started > stall_timeout_s:
            return f"engine step stalled for {time.monotonic() - started:.1f} s"
        return None

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # the error handler raised: the thread ends, and says so
            self.death = f"{type(e).__name__}: {e}"
            log.exception("engine thread died: the worker reports NOT_SERVING")

    def _loop(self) -> None:
        while not self._stopped.is_set():
            self.step_started = time.monotonic()
            try:
                busy = self._step()
            except Exception as e:  # a bad batch must not kill the worker
                log.exception("engine step failed")
                self._on_error(e)
                busy = False
            finally:
                self.step_started = None
            if not busy:
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
