"""The standard gRPC health service (``grpc.health.v1.Health``) on a worker's server (both
roles; the router has its own, on its asyncio server, in router/), and the worker's watchdog.

What Kubernetes' gRPC probes and ``grpc-health-probe`` speak. A worker's server starts only
after its warm-up, so it answers SERVING from the first call it can take; it turns NOT_SERVING
while draining (no new work: routing and probes stop sending), on shutdown, and while the
watchdog finds its engine unable to serve: the engine thread died, or a step has run past
``stall_timeout_s`` (a forward stuck in a kernel). The worker's Status answers UNAVAILABLE then
(``Liveness.check``), so the router takes it out of routing at its next poll, and the Ray
controller replaces it if it stays so. Probes carry no cluster token, so the token check lets
these two methods through (auth.py).
"""

from __future__ import annotations

import logging
import threading

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

log = logging.getLogger("pdserve.worker")

# A step that takes longer than this means the engine is stuck: generous, so a slow CPU's long
# prefill chunk (seconds) never trips it; configurable per cluster (step_stall_timeout_s).
DEFAULT_STALL_TIMEOUT_S = 60.0
WATCH_PERIOD_S = 0.25  # how often the watchdog looks


class Liveness:
    """The worker's watchdog: a thread that follows the engine's liveness and draining flag
    into the health service."""

    def __init__(self, worker, servicer, service_name: str, stall_timeout_s: float):
        self.worker = worker
        self.stall_timeout_s = stall_timeout_s
        self._servicer = servicer
        self._names = ("", service_name)
        self._stop = threading.Event()
        self._serving: bool | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="liveness", daemon=True)
        # More parts the worker cannot serve without, each a () -> problem or None: the decode
        # worker adds its KV receiver server's (a dead torch_dist pair acceptor).
        self.checks: list = []

    def problem(self) -> str | None:
        """Why the worker cannot serve now (None: it can): its engine, then ``checks``."""
        problem = self.worker.loop.problem(self.stall_timeout_s)
        for check in self.checks:
            problem = problem or check()
        return problem

    def check(self, context) -> None:
        """For a Status call: UNAVAILABLE naming the problem while the engine cannot serve."""
        problem = self.problem()
        if problem is not None:
            import grpc

            context.abort(grpc.StatusCode.UNAVAILABLE, f"worker unhealthy: {problem}")

    def update(self) -> None:
        problem = self.problem()
        serving = problem is None and not self.worker.draining
        with self._lock:
            if serving == self._serving:
                return
            if problem is not None:
                log.error("worker %s NOT_SERVING: %s", self.worker.worker_id, problem)
            elif self._serving is False and not self.worker.draining:
                log.warning("worker %s serving again", self.worker.worker_id)
            self._set(serving)

    def _set(self, serving: bool) -> None:
        self._serving = serving
        status = health_pb2.HealthCheckResponse
        for name in self._names:
            self._servicer.set(name, status.SERVING if serving else status.NOT_SERVING)

    def start(self) -> None:
        self.update()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_PERIOD_S):
            if self.worker.loop.stopped:  # the worker stopped: so does its watchdog
                self._set(False)
                return
            try:
                self.update()
            except Exception:  # the watchdog must outlive any one look
                log.exception("liveness check failed")


def add_worker_health(
    server, worker, service_name: str, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
) -> Liveness:
    """Register the health service for ``worker`` (an EngineWorker) on ``server`` and start its
    watchdog; the overall status ("") and ``service_name`` follow the worker's draining flag
    and its engine's liveness."""
    servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    liveness = Liveness(worker, servicer, service_name, stall_timeout_s)
    # A tensor-parallel engine whose rank died or hung cannot step again: the worker is down.
    liveness.checks.append(worker.engine.runner.problem)
    worker.on_draining_change.append(lambda _draining: liveness.update())
    liveness.start()
    return liveness


WAIT_SLICE_S = 1.0  # a server thread's waits are cut into slices this long


class CallerGone(Exception):
    """The call ended (the caller cancelled or its deadline passed) while its thread waited."""


def bounded_get(items, context, liveness: Liveness | None):
    """The next item of ``items`` (a queue.Queue) for a server thread: waits in slices, and
    between them ends the wait with CallerGone once the call is over, or aborts the call
    UNAVAILABLE while the engine cannot serve (the router migrates the request). So no worker
    thread waits forever on an engine that will never answer."""
    import queue

    while True:
        try:
            return items.get(timeout=WAIT_SLICE_S)
        except queue.Empty:
            pass
        if not context.is_active():
            raise CallerGone
        if liveness is not None:
            liveness.check(context)
