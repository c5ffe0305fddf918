"""An ASGI layer in front of the whole HTTP app: the API key on every route but /health (and,
optionally, /metrics), and the request body cap, before FastAPI parses anything.

A middleware rather than route dependencies so nothing is left open by omission: /docs,
/openapi.json, /metrics, /tokenize and routes added later all need the key. The body is read
here whole (up to the cap) and replayed to the app: the handlers read it whole anyway, and a
body over the cap is answered without reading the rest.
"""

from __future__ import annotations

import json

from router.auth import bearer_ok

OPEN_PATHS = frozenset({"/health"})  # probes carry no key


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
        too_long = length is not None and length.isdigit() and int(length) > self.max_body_bytes
        body = None if too_long else await self._read_body(receive)
        if body is None:
            message = (
                f"body: the request body is over {self.max_body_bytes} bytes "
                "(limit max_request_bytes)"
            )
            body = error_body(message, "invalid_request_error", "body", "request_too_large")
            return await _respond(send, 400, body)
        await self.app(scope, _replay(body, receive), send)

    def _needs_key(self, scope) -> bool:
        return bool(self.api_key) and scope["path"] not in self.open_paths

    async def _read_body(self, receive) -> bytes | None:
        """The whole body, or None once it passes the cap."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


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


async def _respond(send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
