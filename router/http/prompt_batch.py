"""A completions request with a batch of prompts: each prompt is a request of its own on the
router's path, and their deltas merge into one response, choice k * n + i for sequence i of
prompt k (OpenAI's and vLLM's order)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from protos import pdserve_pb2 as pb

# Deltas the prompts' readers may hold ahead of the response: past it they stop reading.
PROMPT_QUEUE_DEPTH = 64


async def merge_prompts(streams: list[AsyncIterator], n: int) -> AsyncIterator:
    """The prompts' deltas as they come, re-indexed; only the very last carries usage (summed
    over prompts) and timings (its own prompt's)."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield delta
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=PROMPT_QUEUE_DEPTH)
    tasks = [asyncio.ensure_future(_pump(k, s, queue)) for k, s in enumerate(streams)]
    usage, running, finished = pb.Usage(), len(streams), 0
    try:
        while running:
            k, delta = await queue.get()
            if isinstance(delta, BaseException):
                raise delta
            if delta is None:  # that prompt's stream ended
                running -= 1
                continue
            delta.index += k * n
            if delta.usage is not None:
                usage.prompt_tokens += delta.usage.prompt_tokens
                usage.completion_tokens += delta.usage.completion_tokens
                usage.cached_prompt_tokens += delta.usage.cached_prompt_tokens
                finished += 1  # a prompt's last delta: the others' usage waits for the last
                delta.usage = usage if finished == len(streams) else None
            yield delta
    finally:
        for t in tasks:  # a client that left: each prompt's request cleans up in its task
            t.cancel()


async def _pump(k: int, stream: AsyncIterator, queue: asyncio.Queue) -> None:
    try:
        async for delta in stream:
            await queue.put((k, delta))  # waits while the response is behind (backpressure)
        await queue.put((k, None))
    except Exception as e:  # noqa: BLE001 - raised by the reader
        await queue.put((k, e))
