"""A streamed response's deltas, read in a task of their own, a bounded number ahead of the
client.

When the client leaves, Starlette cancels the response under an anyio cancel scope, which
would cancel every await of the request's cleanup too (releasing its KV lease over gRPC); a
plain task cancelled once cleans up.

Backpressure: the SSE writer (Starlette's StreamingResponse) awaits the transport, which waits
while the client's socket is full; the pump holds at most ``PUMP_DEPTH`` deltas ahead of it
and then stops reading the request's stream, so a slow client holds a bounded buffer here.
The worker keeps decoding meanwhile (its queue of the request's tokens is bounded by
max_tokens x n, which ``limits.max_total_tokens`` caps) and hands them over in larger chunks
once the client reads again; a worker call's deadline runs only while it is being read.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

from router.flow.types import WorkerFailure

PUMP_DEPTH = 64  # deltas read ahead of a slow client


class Pump:
    _running: ClassVar[set[asyncio.Task]] = set()  # strong references until each ends

    def __init__(self, deltas, depth: int = PUMP_DEPTH):
        self._items: asyncio.Queue = asyncio.Queue(maxsize=depth)
        self._stopping = False
        self._task = asyncio.ensure_future(self._run(deltas))
        self._running.add(self._task)
        self._task.add_done_callback(self._running.discard)

    async def _run(self, deltas) -> None:
        try:
            async for delta in deltas:
                await self._items.put(delta)  # waits while the client is behind
        except Exception as e:  # noqa: BLE001 - the reader raises it; a cancel just ends us
            await self._items.put(e)
        except asyncio.CancelledError:
            if self._stopping:
                raise
            # Not ours: a worker call's cancel leaked out; the reader must not wait forever.
            await self._items.put(WorkerFailure("the request was cancelled at a worker"))

    async def next(self):
        item = await self._items.get()
        if isinstance(item, Exception):
            raise item
        return item

    def stop(self) -> None:
        if not self._task.done():
            self._stopping = True
            self._task.cancel()
