"""``pdserve demo``: the embedded default cluster on Ray, a handful of concurrent streamed chat
requests through prefill -> KV transfer -> decode, and a table of where each one's time went.

The same launch path as ``pdserve serve`` (cluster_configs/local.yaml), on free ports, stopped
again at the end. Right after ready it measures the first request's TTFT against the median of
the next ten (pdserve/measure/cold_start.py: the workers warm up before they report ready). TTFT
is split into prefill queue, prefill, KV transfer (the part not hidden behind prefill compute)
and decode queue, as the router measured them.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field

from pdserve.config import ClusterConfig

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in one sentence what a GPU is.",
    "Name three colors of the rainbow.",
    "What does HTTP stand for?",
    "Suggest a name for a friendly robot.",
]


@dataclass
class StreamedRequest:
    question: str
    text: str = ""
    n_tokens: int = 0
    first_token_at: float = 0.0
    finished_at: float = 0.0
    prompt_tokens: int = 0
    timings: object = None
    chunk_times: list[float] = field(default_factory=list)


def run_demo(cfg: ClusterConfig, max_tokens: int = 48) -> int:
    from pdserve.cluster.ray_launcher import launch

    # Free ports and this machine only: the demo must not clash with a running `serve`.
    cfg = cfg.with_overrides(grpc_port=0, http_port=None, host="127.0.0.1")
    print(
        f"launching {cfg.pools.prefill.replicas} prefill + {cfg.pools.decode.replicas} decode "
        f"workers on Ray (model: {cfg.model}, KV over {cfg.kv_transport})",
        flush=True,
    )
    with launch(cfg, log_to_driver=False) as cluster:
        print(f"router at {cluster.grpc_address}", flush=True)
        print(asyncio.run(_cold_start(cluster.grpc_address)).line(), flush=True)
        print(f"sending {len(DEMO_QUESTIONS)} concurrent chat requests", flush=True)
        start = time.monotonic()
        results = asyncio.run(_send_all(cluster.grpc_address, max_tokens))
        wall = time.monotonic() - start
        print_table(results, start, wall)
    return 0


async def _cold_start(address: str):
    """Eleven same-size greedy requests, one at a time, before anything else reaches the
    cluster."""
    from pdserve.client import AsyncClient
    from pdserve.measure.cold_start import (
        PROBE_MAX_TOKENS,
        Stopwatch,
        measure_cold_start,
        probe_prompt,
    )

    client = AsyncClient(address)

    async def first_token_after(i: int) -> float:
        watch = Stopwatch()
        prompt = probe_prompt(i, "demo")
        async for chunk in client.stream(prompt, max_tokens=PROBE_MAX_TOKENS, temperature=0):
            if chunk.token_ids:
                watch.token()
        if watch.ttft_s is None:
            raise RuntimeError(f"cold-start request {i} streamed no token")
        return watch.ttft_s

    try:
        return await measure_cold_start(first_token_after)
    finally:
        await client.close()


async def _send_all(address: str, max_tokens: int) -> list[StreamedRequest]:
    from tqdm import tqdm

    from pdserve.client import AsyncClient

    client = AsyncClient(address)
    bar = tqdm(desc="streaming", unit="tok", file=sys.stderr, leave=False)
    try:
        results = [StreamedRequest(q) for q in DEMO_QUESTIONS]
        await asyncio.gather(*(_stream_one(client, r, max_tokens, bar) for r in results))
        return results
    finally:
        bar.close()
        await client.close()


async def _stream_one(client, r: StreamedRequest, max_tokens: int, bar) -> None:
    messages = [{"role": "user", "content": r.question}]
    async for chunk in client.stream(
        messages=messages, max_tokens=max_tokens, include_timings=True
    ):
        now = time.monotonic()
        if chunk.token_ids and not r.first_token_at:
            r.first_token_at = now
        r.n_tokens += len(chunk.token_ids)
        r.text += chunk.text
        bar.update(len(chunk.token_ids))
        if chunk.finish_reason:
            r.finished_at = now
            r.prompt_tokens = chunk.usage.prompt_tokens
            r.timings = chunk.timings if chunk.HasField("timings") else None


def print_table(results: list[StreamedRequest], start: float, wall: float) -> None:
    ms = 1e3
    print(
        f"{'#':>2} {'prompt':>6} {'out':>4} {'p.queue':>8} {'prefill':>8} {'kv xfer':>8} "
        f"{'d.queue':>8} {'TTFT':>8} {'tok/s':>6} {'KV bytes':>9}  completion"
    )
    print(f"{'':>14} {'(ms)':>8} {'(ms)':>8} {'(ms)':>8} {'(ms)':>8} {'(ms)':>8}")
    total = 0
    for n, r in enumerate(results):
        t = r.timings
        decode_s = max(r.finished_at - r.first_token_at, 1e-9)
        rate = (r.n_tokens - 1) / decode_s if r.n_tokens > 1 else 0.0
        total += r.n_tokens
        text = r.text.replace("\n", " ").strip()[:48]
        if t is None:
            print(f"{n:>2} {r.prompt_tokens:>6} {r.n_tokens:>4}  (no timings)  {text}")
            continue
        print(
            f"{n:>2} {r.prompt_tokens:>6} {r.n_tokens:>4} {t.prefill_queue_s * ms:>8.1f} "
            f"{t.prefill_s * ms:>8.1f} {t.kv_transfer_s * ms:>8.1f} {t.decode_queue_s * ms:>8.1f} "
            f"{t.ttft_s * ms:>8.1f} {rate:>6.1f} {t.kv_bytes:>9,}  {text}"
        )
    print(
        f"{len(results)} requests, {total} tokens in {wall:.2f} s "
        f"({total / max(wall, 1e-9):.1f} tok/s across the cluster)"
    )
    print(TABLE_LEGEND)


TABLE_LEGEND = """\
columns: prompt / out = prompt and completion tokens; p.queue = waiting for the prefill worker;
prefill = the prefill worker's compute for this request's batch; kv xfer = KV transfer time not
hidden behind prefill; d.queue = waiting on the decode worker before the first decode step;
TTFT = time to first token as the client saw it (the rest is routing, reservation, network);
tok/s = this stream's decode rate after its first token; KV bytes = KV cache shipped to decode"""
