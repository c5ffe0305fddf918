"""The router's own warm-up before it is reported ready: one tiny request down each path.

Workers warm their kernels before they serve (engine/warmup.py), but a router's first request
still pays one-off costs of its own: the chat template's compilation, the first calls on its
channels to the workers, the prefill worker's first KV channel to a decode worker, and the
HTTP stack's first request. So the launcher sends one short greedy chat request through the
router's request path and, when HTTP is served in the clear, one through its HTTP front door,
before it prints ``ready``. They are ordinary requests (counted in /metrics like any other).
"""

from __future__ import annotations

import asyncio
import logging
import time

from protos import pdserve_pb2 as pb

log = logging.getLogger("pdserve.router")

WARMUP_MESSAGES = [{"role": "user", "content": "Hello!"}]
WARMUP_TOKENS = 2


async def warm_up_router(servers, ready_timeout_s: float = 120.0) -> float:
    """Wait until every pool has a ready worker, then run the warm-up requests; returns the
    seconds they took. Failures are logged, never raised: serving goes on cold."""
    router = servers.router
    deadline = time.monotonic() + ready_timeout_s
    while not router.ready:
        if time.monotonic() > deadline:
            log.warning("router warm-up skipped: no ready worker in every pool")
            return 0.0
        await asyncio.sleep(0.05)
    start = time.monotonic()
    try:
        await _through_the_flow(router)
        if servers.http_address and servers.http_server.scheme == "http":
            await _through_http(servers.http_address, router.cfg.api_key)
    except Exception as e:  # noqa: BLE001 - a warm-up is an optimisation
        log.warning("router warm-up failed: %s: %s", type(e).__name__, e)
    seconds = time.monotonic() - start
    log.info("router warm-up in %.2f s", seconds)
    return seconds


async def _through_the_flow(router) -> None:
    sampling = pb.SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0)
    inp = router.prepare(router.tokenizer.encode_chat(WARMUP_MESSAGES), sampling)
    async for _ in router.generate(inp):
        pass


async def _through_http(address: str, api_key: str | None) -> None:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {
        "model": "",  # replaced below: the served name
        "messages": WARMUP_MESSAGES,
        "max_tokens": WARMUP_TOKENS,
        "temperature": 0,
    }
    async with httpx.AsyncClient(base_url=f"http://{address}", headers=headers, timeout=60) as c:
        models = (await c.get("/v1/models")).json()["data"]
        body["model"] = models[0]["id"]
        (await c.post("/v1/chat/completions", json=body)).raise_for_status()
