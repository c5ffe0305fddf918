"""An ASGI layer in front of the whole HTTP app: the API key on every route but the probes
(/health, /ping) and optionally /metrics, and the request body cap, before FastAPI parses
anything.

A middleware rather than route dependencies so nothing is left open by omission: /docs,
/openapi.json, /metrics, /tokenize and routes added later all need the key. The body is read
here whole (up to the cap) and replayed to the app: the handlers read it whole anyway.

A body over the cap is answered 413 naming ``max_request_bytes``, after reading and dropping
the rest of it: a client such as Python's urllib sends its whole body before it reads the
answer, and a server that closed while it was still sending would leave it a broken pipe
instead of the error. What is dropped is bounded (``drain_limit``: 4x the cap, at least
64 MiB); a body declared past that is answered at once and the connection closed.
"""

from __future__ import annotations

import json

from router.auth import bearer_ok

OPEN_PATHS = frozenset({"/health", "/ping"})  # probes carry no key
MIN_DRAIN_BYTES = 64 << 20  # an oversized body read and dropped before its 413, at least


def error_body(message: str, kind: str, param: str | None, code: str) -> bytes:
    error = {"message": message, "type": kind, "param": param, "code": code}
    return json.dumps({"error": error}).encode()


class ApiGuard:
    def __init__(self, app, api_key: str | None, max_body_bytes: int, open_metrics: bool = False):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.open_paths = OPEN_PATHS | ({"/metrics"} if open_metrics else set())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self._needs_key(scope) and not bearer_ok(_header(scope, b"authorization"), self.api_key):
            message = "Incorrect or missing API key (Authorization: Bearer <key>)."
            body = error_body(message, "authentication_error", None, "invalid_api_key")
            return await _respond(send, 401, body)
        length = _header(scope, b"content-length")
        declared = int(length) if length is not None and length.isdigit() else 0
        if declared > self.drain_limit:  # too much even to drop: answer, then hang up
            return await _respond(send, 413, self._too_large(), close=True)
        body, ended = await self._read_body(receive)
        if body is None:
            return await _respond(send, 413, self._too_large(), close=not ended)
        await self.app(scope, _replay(body, receive), send)

    @property
    def drain_limit(self) -> int:
        return max(4 * self.max_body_bytes, MIN_DRAIN_BYTES)

    def _too_large(self) -> bytes:
        message = (
            f"body: the request body is over {self.max_body_bytes} bytes (limit max_request_bytes)"
        )
        return error_body(message, "invalid_request_error", "body", "request_too_large")

    def _needs_key(self, scope) -> bool:
        return bool(self.api_key) and scope["path"] not in self.open_paths

    async def _read_body(self, receive) -> tuple[bytes | None, bool]:
        """The whole body (None: it passed the cap, and the rest was read and dropped up to
        ``drain_limit``), and whether it was read to its end."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                return (b"".join(chunks) if size <= self.max_body_bytes else None), False
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.drain_limit:
                return None, False
            if size <= self.max_body_bytes:
                chunks.append(chunk)
            else:
                chunks.clear()  # over the cap: dropped as it comes
            if not message.get("more_body", False):
                return (b"".join(chunks) if size <= self.max_body_bytes else None), True


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later reads wait for the disconnect, as Starlette expects

    return replay


async def _respond(send, status: int, body: bytes, close: bool = False) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if close:  # the rest of the body is unread: this connection cannot carry another request
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
