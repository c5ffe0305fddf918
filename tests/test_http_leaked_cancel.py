"""A cancel that leaks out of a worker call into the HTTP handler (issue 19: a
``CancelledError`` from the router's prefill reached ``_respond`` and came out as a plain-text
500). The client did not leave, so it must get an answer: 503 with an OpenAI-shaped JSON body
before the first token, an error event ending the stream after it; never a bare 500, never a
stream that waits forever. The server keeps serving and every block comes back."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.conftest import tiny_llama_dir
from tests.http_utils import open_stream, post, sse_events

BODY = {"prompt": "w5 w6 w7", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def openai_tiny(tmp_path_factory):
    """This module's own tiny model, which conftest's ``openai_cluster`` serves."""
    return tiny_llama_dir(tmp_path_factory.mktemp("leak"), num_heads=4, num_kv_heads=2, seed=12)


def _leak_cancel(monkeypatch, router, after_items: int) -> None:
    """Make the router's ``generate`` raise CancelledError (not the client's) after yielding
    ``after_items`` of the real request's items, closing the real one (its cleanup frees its
    KV) first."""
    real = router.generate

    async def leaking(inp):
        gen = real(inp)
        try:
            n = 0
            async for item in gen:
                if n == after_items:
                    raise asyncio.CancelledError
                yield item
                n += 1
        finally:
            await gen.aclose()

    monkeypatch.setattr(router, "generate", leaking)


def _still_serves(cluster, model: str) -> None:
    status, body = post(cluster.http_address, "/v1/completions", {**BODY, "model": model})
    assert status == 200 and body["usage"]["completion_tokens"] == BODY["max_tokens"]


def test_a_leaked_cancel_before_the_first_token_is_503_json(
    openai_cluster, served_model, monkeypatch
):
    _leak_cancel(monkeypatch, openai_cluster.router, after_items=0)
    status, body = post(
        openai_cluster.http_address, "/v1/completions", {**BODY, "model": served_model}
    )
    assert status == 503
    assert "cancelled at a worker" in body["error"]["message"]
    monkeypatch.undo()
    _still_serves(openai_cluster, served_model)


def test_a_leaked_cancel_mid_stream_ends_it_with_an_error_event(
    openai_cluster, served_model, monkeypatch
):
    # The first token comes alone (from the prefill); the decode worker may send the rest in
    # one chunk, so the leak comes with the second item, which always exists.
    _leak_cancel(monkeypatch, openai_cluster.router, after_items=1)
    body = {**BODY, "model": served_model, "stream": True}
    conn, resp = open_stream(openai_cluster.http_address, "/v1/completions", body)
    try:
        assert resp.status == 200  # the first token went out before the cancel
        events = list(sse_events(resp))  # returns: the stream ends, it does not hang
    finally:
        conn.close()
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    assert chunks[0]["choices"][0]["text"] != "" and len(chunks) == 2
    assert "cancelled at a worker" in chunks[-1]["error"]["message"]
    assert "[DONE]" not in events  # an error, not a normal end
    monkeypatch.undo()
    _still_serves(openai_cluster, served_model)
