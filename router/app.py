"""Start and stop the router's front doors (gRPC, and HTTP when configured) on one loop."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from dataclasses import dataclass

from grpc_plumbing.auth import resolve_cluster_token
from router.core import Router
from router.grpc_server import start_grpc_server
from router.security import ApiSecurity, check_api_exposure
from router.settings import RouterSettings

API_KEY_ENV = "PDSERVE_API_KEY"
DRAIN_ERROR_S = 3.0  # after a drain's grace: how long the ended requests' errors may take

log = logging.getLogger("pdserve.router")


@dataclass
class RouterServers:
    router: Router
    grpc_server: object
    grpc_address: str
    http_server: object | None = None
    http_address: str = ""

    async def drain(self, grace_s: float) -> int:
        """A graceful stop's first half: refuse new requests from now (HTTP 429 and gRPC
        UNAVAILABLE, with retry-after; health NOT_SERVING), let running ones finish for up to
        ``grace_s``, then end those left with a clean error (router/drain.py) and give them
        a moment to reach their clients. Returns how many were ended so."""
        loop = asyncio.get_running_loop()
        self.router.drain.start()
        health = getattr(self.grpc_server, "pdserve_health", None)
        if health is not None:
            await health.update()  # NOT_SERVING now, not at its next poll
        deadline = loop.time() + grace_s
        while self.router.inflight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = self.router.inflight
        if left:
            log.warning("drain grace period (%.0f s) over: ending %d requests", grace_s, left)
            self.router.drain.expire()
            deadline = loop.time() + DRAIN_ERROR_S
            while self.router.inflight and loop.time() < deadline:
                await asyncio.sleep(0.05)
        return left

    async def stop(self) -> None:
        if self.http_server is not None:
            await self.http_server.stop()
        health = getattr(self.grpc_server, "pdserve_health", None)
        if health is not None:
            await health.stop()
        await self.grpc_server.stop(grace=1.0)
        await self.router.close()


async def start_router(
    cfg: RouterSettings,
    prefill: list[str],
    decode: list[str],
    host: str = "127.0.0.1",
    grpc_port: int = 0,
    http_port: int | None = None,
    api_key: str | None = None,
    cluster_token: str | None = None,
    security: ApiSecurity | None = None,
) -> RouterServers:
    """Build the router over the given workers and start serving. ``http_port=None`` means no
    HTTP server; 0 picks a free port. ``api_key`` (else ``cfg.api_key``, else PDSERVE_API_KEY)
    guards the public API; ``cluster_token`` (else ``cfg.cluster_token``, else
    PDSERVE_CLUSTER_TOKEN) is sent on every call to a worker. ``security``: TLS for both
    APIs, whether /metrics needs the key, and --allow-unauthenticated. Off loopback without
    an API key (and without allow_unauthenticated) it raises OpenBindError before binding."""
    env = os.environ.get
    security = security or ApiSecurity()
    cfg = dataclasses.replace(
        cfg,
        api_key=api_key or cfg.api_key or env(API_KEY_ENV) or None,
        cluster_token=resolve_cluster_token(cluster_token or cfg.cluster_token),
    )
    check_api_exposure(host, cfg.api_key, security)
    cap = cfg.limits.max_tokens
    if cap is not None and cfg.default_max_tokens > cap:  # the default must pass its own limit
        cfg = dataclasses.replace(cfg, default_max_tokens=cap)
    router = Router(cfg, prefill, decode)
    await router.start()
    try:
        grpc_server, grpc_address = await start_grpc_server(router, host, grpc_port, security.tls)
    except BaseException:
        await router.close()
        raise
    servers = RouterServers(router, grpc_server, grpc_address)
    if http_port is not None:
        from router.http.listen import start_http_server  # fastapi only when HTTP is served

        try:
            servers.http_server = await start_http_server(
                router, host, http_port, cfg.api_key, security
            )
        except BaseException:
            await servers.stop()
            raise
        servers.http_address = servers.http_server.address
    return servers
