"""The standard gRPC health service (``grpc.health.v1.Health``) on the router's client API.

SERVING once every pool has a ready worker (what ``/health`` answers 200 for), NOT_SERVING
before that, whenever a pool has none left and from the start of a drain (a graceful stop), so Kubernetes' gRPC probes and
``grpc-health-probe`` route traffic only to a router that can serve it. Open without the API key:
probes carry none. The status follows the router's worker polls, checked every half second.
"""

from __future__ import annotations

import asyncio
import contextlib

from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos import pdserve_pb2 as pb

HEALTH_SERVICE = health.SERVICE_NAME
GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
POLL_S = 0.5


class RouterHealth:
    """The health servicer and the task that keeps it in step with ``router.ready``."""

    def __init__(self, router):
        self.router = router
        self.servicer = health_aio.HealthServicer()
        self._task: asyncio.Task | None = None

    def add_to(self, server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def start(self) -> None:
        await self.update()
        self._task = asyncio.ensure_future(self._follow())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.servicer.enter_graceful_shutdown()

    async def update(self) -> None:
        """Set the status from ``router.ready`` now (a drain calls it: no wait for the poll)."""
        serving = health_pb2.HealthCheckResponse.SERVING
        status = serving if self.router.ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", GENERATION_SERVICE):
            await self.servicer.set(name, status)

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            await self.update()
