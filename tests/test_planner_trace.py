"""`pdserve trace`'s recorder: requests pass through unchanged, each completed one becomes a
trace line the planner reads back."""

from __future__ import annotations

import asyncio
import json

import httpx

from pdserve.planner.trace_proxy import TraceWriter, make_app
from pdserve.planner.workload import read_trace


def _upstream(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    if not body.get("stream"):
        return httpx.Response(200, json={"choices": [{"text": "abc"}], "usage": usage})
    assert body["stream_options"]["include_usage"] is True  # added by the recorder
    chunks = [{"choices": [{"text": t}]} for t in "abc"] + [{"choices": [], "usage": usage}]
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})


async def _run(tmp_path):
    writer = TraceWriter(tmp_path / "t.jsonl")
    upstream = httpx.AsyncClient(transport=httpx.MockTransport(_upstream), base_url="http://up")
    app = make_app(upstream, writer)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://p") as c:
        plain = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        streamed = await c.post("/v1/completions", json={"prompt": "x", "stream": True})
    return writer, plain, streamed


def test_recorder_passes_requests_through_and_writes_a_trace(tmp_path):
    writer, plain, streamed = asyncio.run(_run(tmp_path))
    assert plain.json()["usage"]["completion_tokens"] == 3
    # The client did not ask for usage: the usage-only chunk is not passed on.
    assert '"usage"' not in streamed.text and streamed.text.count("data:") == 4
    trace = read_trace(tmp_path / "t.jsonl")
    assert [(r.prompt_tokens, r.output_tokens) for r in trace] == [(7, 3), (7, 3)]
    assert writer.count == 2
    row = json.loads((tmp_path / "t.jsonl").read_text().splitlines()[1])
    assert 0 <= row["ttft_s"] <= row["e2e_s"]
