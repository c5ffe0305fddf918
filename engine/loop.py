"""The engine thread a worker runs: step while there is work, sleep until woken when idle.

RPC threads and the engine thread share the scheduler and block manager through ``lock``;
the step (engine/step.py) runs the forward outside the lock, so admissions never wait for a
whole step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("pdserve.engine")


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
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                busy = self._step()
            except Exception as e:  # a bad batch must not kill the worker
                log.exception("engine step failed")
                self._on_error(e)
                busy = False
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()
