"""What runs inside Ray actors: one prefill or decode worker per actor, and the router.

Actors only host the project's own servers: requests and KV move over gRPC (or NCCL), never
through Ray's object store; Ray carries the control calls (start, status, drain, stop).
These classes are plain; the controller wraps them with ``ray.remote`` and the pool's resources.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import threading
import time

from pdserve.cluster.autoscaler import latency_summary
from pdserve.config import ClusterConfig
from pdserve.security_config import api_security, cluster_tls, request_limits

log = logging.getLogger("pdserve.ray")


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def supported_kwargs(fn, **kw) -> dict:
    """The keyword arguments ``fn`` accepts (others are optional features not built yet)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kw.items() if k in params and v is not None}


class WorkerActor:
    """One worker: builds the engine with the pool's thread count, serves gRPC, and answers the
    controller's status/drain/stop calls."""

    def __init__(self, role: str, worker_id: str, cfg: dict):
        import torch

        c = ClusterConfig.model_validate(cfg)
        pool = c.pools[role]
        if pool.threads:
            torch.set_num_threads(pool.threads)
        self.role = role
        self.worker_id = worker_id
        self.worker, self.address, self._closers = _start_worker(role, worker_id, c)

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
        for close in self._closers:
            try:
                close()
            except Exception:  # stopping anyway
                log.exception("closing %s", self.worker_id)
        self.worker.stop()


def _pid() -> int:
    import os

    return os.getpid()


def _engine(c: ClusterConfig):
    from engine.config import CacheConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine.from_model_path(
        c.model,
        cache=CacheConfig(block_size=c.block_size, num_blocks=c.num_blocks),
        scheduler=SchedulerConfig(c.max_num_batched_tokens, c.max_num_seqs, c.prefill_chunk_size),
        max_model_len=c.max_model_len,
        progress=False,
        device=c.device,
    )


def _start_worker(role: str, worker_id: str, c: ClusterConfig):
    """(worker, gRPC address, closers) for one worker hosted in this process."""
    host = c.host or node_ip()
    if role == "prefill":
        from prefill_worker.server import serve_prefill_worker
        from prefill_worker.worker import PrefillWorker

        worker = PrefillWorker(_engine(c), worker_id)
        kw = supported_kwargs(
            serve_prefill_worker, cluster_token=c.cluster_token, tls=cluster_tls(c)
        )
        server, address, senders = serve_prefill_worker(worker, host, 0, **kw)
        return worker, address, [lambda: server.stop(grace=2).wait(), senders.close]
    from decode_worker.server import serve_decode_worker
    from decode_worker.worker import DecodeWorker

    worker = DecodeWorker(_engine(c), worker_id, c.lease_ttl_s)
    worker.leases.max_ttl_s = c.limits.max_lease_seconds
    kw = supported_kwargs(
        serve_decode_worker,
        cluster_token=c.cluster_token,
        kv_private_network=c.security.kv_private_network,
        tls=cluster_tls(c),
    )
    server, address, kv_server = serve_decode_worker(worker, host, 0, c.kv_transport, **kw)
    closers = [lambda: server.stop(grace=2).wait()]
    if kv_server is not None:
        closers.append(kv_server.stop)
    return worker, address, closers


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
    from router.core import RouterConfig

    fields = {f.name for f in dataclasses.fields(RouterConfig)}
    opts = {
        "model_dir": model_dir,
        "model_name": c.model_name,
        "max_model_len": c.max_model_len,
        "block_size": c.block_size,
        "prefill_policy": c.router.prefill_policy,
        "decode_policy": c.router.decode_policy,
        "max_inflight_requests": c.router.max_inflight_requests,
        "default_max_tokens": c.router.default_max_tokens,
        "local_prefill_max_tokens": c.router.local_prefill_max_tokens,
        "concurrent_reserve_headroom": c.router.concurrent_reserve_headroom,
        "api_key": c.api_key,
        "cluster_token": c.cluster_token,
        "cluster_tls": cluster_tls(c),
        "limits": request_limits(c),
    }
    cfg = RouterConfig(**{k: v for k, v in opts.items() if k in fields})
    host = c.host or node_ip()
    auth = supported_kwargs(
        start_router, api_key=c.api_key, cluster_token=c.cluster_token, security=api_security(c)
    )
    return await start_router(cfg, [], [], host, c.grpc_port, c.http_port, **auth)
