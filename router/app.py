"""Start and stop the router's front doors (gRPC, and HTTP when configured) on one loop."""

from __future__ import annotations

from dataclasses import dataclass

from router.core import Router, RouterConfig
from router.grpc_server import start_grpc_server


@dataclass
class RouterServers:
    router: Router
    grpc_server: object
    grpc_address: str
    http_server: object | None = None
    http_address: str = ""

    async def stop(self) -> None:
        await self.grpc_server.stop(grace=1.0)
        await self.router.close()


async def start_router(
    cfg: RouterConfig,
    prefill: list[str],
    decode: list[str],
    host: str = "127.0.0.1",
    grpc_port: int = 0,
    http_port: int | None = None,
) -> RouterServers:
    """Build the router over the given workers and start serving. ``http_port=None`` means no
    HTTP server; 0 picks a free port."""
    router = Router(cfg, prefill, decode)
    await router.start()
    grpc_server, grpc_address = await start_grpc_server(router, host, grpc_port)
    return RouterServers(router, grpc_server, grpc_address)
