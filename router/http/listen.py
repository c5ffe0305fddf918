"""Serving the HTTP app: uvicorn as a task on the router's running loop, on a socket bound to
the configured host, behind the API guard (router/http/guard.py), over TLS when configured."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl

import uvicorn

from grpc_plumbing.tls import TlsFiles
from router.core import Router
from router.http.guard import ApiGuard
from router.security import ApiSecurity


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # The process that embeds the router owns its signals; uvicorn must not take them.
        yield


def _tls_options(tls: TlsFiles | None) -> dict:
    if tls is None:
        return {}
    return {
        "ssl_certfile": tls.cert,
        "ssl_keyfile": tls.key,
        "ssl_ca_certs": tls.client_ca,
        "ssl_cert_reqs": ssl.CERT_REQUIRED if tls.client_ca else ssl.CERT_NONE,
    }


class HttpServer:
    """uvicorn serving ``app`` as a task on the running loop, on a socket bound to ``host``."""

    def __init__(self, app, host: str, port: int, tls: TlsFiles | None = None):
        config = uvicorn.Config(
            app,
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="off",
            http="h11",
            ws="none",
            timeout_graceful_shutdown=2,
            **_tls_options(tls),
        )
        config.load()  # reads the certificate now: a bad path fails before the port is bound
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family)
        bound = self._sock.getsockname()[1]
        self.address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        self.scheme = "https" if tls is not None else "http"
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # startup failed: raise why
                raise RuntimeError("the HTTP server stopped during startup")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout=5)
        except asyncio.TimeoutError:
            self._server.force_exit = True
            self._task.cancel()
        self._sock.close()


async def start_http_server(
    router: Router,
    host: str,
    port: int,
    api_key: str | None = None,
    security: ApiSecurity | None = None,
) -> HttpServer:
    from router.http.routes import build_app  # fastapi only when HTTP is served

    security = security or ApiSecurity()
    app = ApiGuard(
        build_app(router, api_key),
        api_key,
        router.cfg.limits.max_request_bytes,
        open_metrics=security.open_metrics,
    )
    server = HttpServer(app, host, port, security.tls)
    await server.start()
    return server
