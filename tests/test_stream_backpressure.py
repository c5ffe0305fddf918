"""Backpressure on large outputs: a streamed response reads its request's deltas at most a
bounded number ahead of the client (router/http/pump.py), and a batch of prompts merges theirs
through a bounded queue (router/http/prompt_batch.py); a whole response is bounded by
``limits.max_total_tokens`` (tests/test_request_caps.py)."""

from __future__ import annotations

import asyncio

from router.core import Delta
from router.http.prompt_batch import PROMPT_QUEUE_DEPTH, merge_prompts
from router.http.pump import PUMP_DEPTH, Pump

MANY = 10_000


class Source:
    """An endless-looking request: counts how many deltas were taken from it."""

    def __init__(self):
        self.taken = 0

    async def deltas(self):
        for i in range(MANY):
            self.taken += 1
            yield Delta([i], f"w{i}")


async def settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


def test_a_client_that_stops_reading_holds_at_most_the_pumps_depth():
    async def run():
        src = Source()
        pump = Pump(src.deltas())
        first = await pump.next()
        await settle()  # the client reads no more: the pump must stop reading too
        held = src.taken
        await settle()
        assert src.taken == held <= PUMP_DEPTH + 2, src.taken
        got = [first] + [await pump.next() for _ in range(100)]  # and it goes on when read
        assert [d.token_ids[0] for d in got] == list(range(101))
        pump.stop()

    asyncio.run(run())


def test_a_batch_of_prompts_reads_at_most_its_queues_depth_ahead():
    async def run():
        sources = [Source() for _ in range(4)]
        merged = merge_prompts([s.deltas() for s in sources], n=1)
        await merged.__anext__()
        await settle()
        held = sum(s.taken for s in sources)
        await settle()
        assert sum(s.taken for s in sources) == held
        assert held <= PROMPT_QUEUE_DEPTH + 2 * len(sources), held
        await merged.aclose()

    asyncio.run(run())
