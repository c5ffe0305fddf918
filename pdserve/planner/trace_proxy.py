"""``pdserve trace``: record a live cluster's traffic as a planner trace.

A pass-through in front of the router's OpenAI HTTP API: clients talk to the proxy, which
forwards every request to ``--url`` unchanged and records, per completed request, its arrival,
prompt and output token counts (from ``usage``) and lifetime (first token, end). Streamed
requests get ``stream_options.include_usage`` added so the counts are exact; the usage chunk is
passed on only when the client asked for it. Each line of the JSONL is
``{"arrival_s", "prompt_tokens", "output_tokens", "ttft_s", "e2e_s"}``: what ``pdserve plan
--trace`` replays. Nothing in the router changes.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route


class TraceWriter:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self.t0 = time.monotonic()
        self.count = 0
        self._lock = threading.Lock()

    def write(self, arrival: float, usage: dict | None, first: float | None, end: float) -> None:
        if not usage or not usage.get("completion_tokens") or not usage.get("prompt_tokens"):
            return  # failed, or no counts: not a request the planner can replay
        row = {
            "arrival_s": round(arrival - self.t0, 6),
            "prompt_tokens": int(usage["prompt_tokens"]),
            "output_tokens": int(usage["completion_tokens"]),
            "ttft_s": round((first or end) - arrival, 6),
            "e2e_s": round(end - arrival, 6),
        }
        with self._lock, open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            self.count += 1


def _sse_usage(line: str) -> tuple[dict | None, bool, bool]:
    """(usage, has tokens, usage-only chunk) of one SSE line."""
    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
        return None, False, False
    try:
        chunk = json.loads(line[5:])
    except ValueError:
        return None, False, False
    choices = chunk.get("choices") or []
    text = any((c.get("delta") or {}).get("content") or c.get("text") for c in choices)
    return chunk.get("usage"), text, not choices and bool(chunk.get("usage"))


def make_app(upstream: httpx.AsyncClient, writer: TraceWriter) -> Starlette:
    async def forward(request: Request) -> Response:
        arrival = time.monotonic()
        body = await request.body()
        payload, wants_usage = None, True
        if body and request.method == "POST":
            try:
                payload = json.loads(body)
            except ValueError:
                payload = None
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() in ("authorization", "content-type")
        }
        if isinstance(payload, dict) and payload.get("stream"):
            opts = payload.setdefault("stream_options", {}) or {}
            wants_usage = bool(opts.get("include_usage"))
            payload["stream_options"] = {**opts, "include_usage": True}
            body = json.dumps(payload).encode()
            return await _stream(upstream, request, body, headers, arrival, wants_usage, writer)
        resp = await upstream.request(
            request.method, request.url.path, content=body, headers=headers
        )
        if request.url.path.startswith("/v1/") and resp.status_code == 200 and payload is not None:
            try:
                usage = resp.json().get("usage")
            except ValueError:
                usage = None
            writer.write(arrival, usage, None, time.monotonic())
        return Response(resp.content, resp.status_code, media_type=resp.headers.get("content-type"))

    return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])


async def _stream(upstream, request, body, headers, arrival, wants_usage, writer):
    req = upstream.build_request("POST", request.url.path, content=body, headers=headers)
    resp = await upstream.send(req, stream=True)
    if resp.status_code != 200:
        content = await resp.aread()
        await resp.aclose()
        return Response(content, resp.status_code, media_type=resp.headers.get("content-type"))

    async def lines():
        first, usage = None, None
        try:
            async for line in resp.aiter_lines():
                got, text, usage_only = _sse_usage(line)
                usage = got or usage
                if text and first is None:
                    first = time.monotonic()
                if usage_only and not wants_usage:
                    continue
                yield line + "\n"
        finally:
            await resp.aclose()
            writer.write(arrival, usage, first, time.monotonic())

    return StreamingResponse(lines(), media_type="text/event-stream")


def serve(url: str, out: str, host: str, port: int, duration_s: float | None) -> int:
    import uvicorn

    writer = TraceWriter(out)
    upstream = httpx.AsyncClient(
        base_url=url.rstrip("/").removesuffix("/v1"), timeout=None, trust_env=False
    )
    config = uvicorn.Config(make_app(upstream, writer), host=host, port=port, log_level="warning")
    server = uvicorn.Server(config)
    if duration_s:
        threading.Timer(duration_s, lambda: setattr(server, "should_exit", True)).start()
    print(f"recording {url} at http://{host}:{port} -> {out} (Ctrl-C ends)", flush=True)
    server.run()
    print(f"wrote {writer.count} requests to {out}")
    return 0
