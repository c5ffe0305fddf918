"""What runs inside Ray actors: one prefill or decode worker per actor, and the router.

Actors only host the project's own servers: requests and KV move over gRPC (or NCCL), never
through Ray's object store; Ray carries the control calls (start, status, drain, stop).
These classes are plain; the controller wraps them with ``ray.remote`` and the pool's resources.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

from pdserve.cluster.autoscaler import latency_summary
from pdserve.cluster.workers import build_worker
from pdserve.config import ClusterConfig
from pdserve.settings import settings_from_config
from pdserve.share_cores import with_core_share


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


class WorkerActor:
    """One worker: builds the engine with the pool's thread count, serves gRPC, and answers the
    controller's status/drain/stop calls."""

    def __init__(self, role: str, worker_id: str, cfg: dict, group: int | None = None):
        """``group``: its node group under share_cores (its ledger with its partner)."""
        c = ClusterConfig.model_validate(cfg)
        settings = settings_from_config(c, c.host or node_ip()).worker(role)
        settings = with_core_share(settings, c, group)
        self.role = role
        self.worker_id = worker_id
        server = dataclasses.replace(settings.server, worker_id=worker_id)
        self.drain_grace_s = server.drain_grace_s
        self.running = build_worker(role, dataclasses.replace(settings, server=server))
        self.worker, self.address = self.running.worker, self.running.address

    def ready(self) -> dict:
        import ray

        from engine import hugepages

        return {
            "address": self.address,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": _pid(),
            "huge_pages": hugepages.active(),  # the runtime_env asked torch for them
        }

    def status(self) -> dict:
        st = self.worker.status()
        st["busy"] = (
            st["num_running"]
            + st["num_waiting"]
            + st.get("num_leases", 0)  # decode
            + st.get("num_transfers", 0)  # prefill: KV still streaming after the first token
        ) > 0
        return st

    def set_draining(self) -> None:
        self.worker.draining = True  # decode: no new reservations; both: Status shows it

    def stop(self) -> None:
        self.running.drain(self.drain_grace_s)  # at once when idle (the router drained first)
        self.running.stop()


def _pid() -> int:
    import os

    return os.getpid()


class RouterActor:
    """The router and its front doors on an asyncio loop of their own (a thread in this actor),
    so the controller's admin calls never wait behind request traffic."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="router", daemon=True)
        self._thread.start()
        self.servers = None

    def _run(self, coro, timeout: float | None = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self, cfg: dict, model_dir: str) -> dict:
        self.servers = self._run(_start_router(ClusterConfig.model_validate(cfg), model_dir))
        return {"grpc": self.servers.grpc_address, "http": self.servers.http_address or ""}

    @property
    def router(self):
        return self.servers.router

    def warm_up(self) -> float:
        """One request down the router's own paths once its pools are ready (router/warmup.py)."""
        from router.warmup import warm_up_router

        return self._run(warm_up_router(self.servers), timeout=300)

    def add_worker(self, role: str, address: str) -> None:
        self._run(self.router.add_worker(role, address))

    def drain_worker(self, role: str, address: str) -> None:
        self._run(_call(self.router.drain_worker, role, address))

    def remove_worker(self, role: str, address: str) -> None:
        self._run(self.router.remove_worker(role, address))

    def inflight_on(self, role: str, address: str) -> int:
        return self._run(_call(self.router.inflight_on, role, address))

    def served_on(self, role: str, address: str) -> int | None:
        """Requests the router has sent to that worker so far (None: not in the pool)."""

        def served():
            pool = self.router.prefill if role == "prefill" else self.router.decode
            w = pool.workers.get(address)
            return None if w is None else w.served_requests

        return self._run(_call(served))

    def pool_status(self) -> dict:
        return self._run(_call(self.router.pool_status))

    def latency(self, window_s: float) -> tuple[float | None, float | None]:
        """Mean TTFT and TPOT of requests that finished in the last ``window_s`` seconds."""
        obs = self._run(_call(lambda: list(self.router.recent_latencies)))
        return latency_summary(obs, time.monotonic(), window_s)

    def recent_requests(self) -> tuple[list[tuple], float]:
        """The finished requests the router keeps: (finish time, TTFT, TPOT, arrival time,
        prompt tokens, output tokens), on this process's monotonic clock, and that clock now."""
        return self._run(_call(lambda: (list(self.router.recent_latencies), time.monotonic())))

    def set_planner_prediction(self, prediction: dict | None) -> None:
        """The planner's prediction for the recent traffic beside what was measured
        (pdserve/planner/drift.py), exported as ``pdserve:planner_prediction_error``."""

        def put():
            self.router.planner_prediction = prediction

        self._run(_call(put))

    def drain(self, grace_s: float) -> int:
        """A graceful stop's first half (RouterServers.drain); returns the requests ended."""
        if self.servers is None:
            return 0
        return self._run(self.servers.drain(grace_s), timeout=grace_s + 10)

    def stop(self) -> None:
        if self.servers is not None:
            self._run(self.servers.stop())
            self.servers = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


async def _call(fn, *args):
    """Run a plain function on the router's loop (the router's state belongs to that loop)."""
    return fn(*args)


async def _start_router(c: ClusterConfig, model_dir: str):
    from router.app import start_router

    s = settings_from_config(c, c.host or node_ip(), model_dir)
    return await start_router(
        s.router, [], [], s.host, s.grpc_port, s.http_port, security=s.api_security
    )
