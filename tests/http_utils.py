"""Plain-HTTP helpers for the OpenAI API tests: JSON requests and a minimal SSE parser, with
the standard library only (what any client could do without the openai package)."""

from __future__ import annotations

import http.client
import json


def request(address: str, method: str, path: str, body=None, headers: dict | None = None):
    """Returns (status, parsed JSON or raw text). ``body``: a dict (sent as JSON) or bytes."""
    conn = http.client.HTTPConnection(address, timeout=30)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(
            method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})}
        )
        resp = conn.getresponse()
        raw = resp.read().decode()
        try:
            return resp.status, json.loads(raw)
        except json.JSONDecodeError:
            return resp.status, raw
    finally:
        conn.close()


def post(address: str, path: str, body, headers: dict | None = None):
    return request(address, "POST", path, body, headers)


def get(address: str, path: str, headers: dict | None = None):
    return request(address, "GET", path, None, headers)


def sse_events(resp: http.client.HTTPResponse):
    """Yield each event's data (the text after ``data: ``), per the SSE spec's framing: lines
    up to a blank line make one event; every line here must be a ``data:`` field."""
    lines: list[str] = []
    for raw in resp:
        line = raw.decode().rstrip("\r\n")
        if line:
            assert line.startswith("data: "), f"not an SSE data line: {line!r}"
            lines.append(line[len("data: ") :])
            continue
        if lines:
            yield "\n".join(lines)
            lines = []
    assert not lines, "stream ended inside an event"


def open_stream(address: str, path: str, body: dict, headers: dict | None = None):
    """POST and return (connection, response) for reading the event stream."""
    conn = http.client.HTTPConnection(address, timeout=30)
    conn.request(
        "POST",
        path,
        body=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    return conn, conn.getresponse()
