"""The router's graceful stop: refuse new requests, let running ones finish within a grace
period, and end those still running at its end with a clean error, never a cut connection.

``RouterServers.drain`` (router/app.py) drives it: ``start`` turns admission off (HTTP 429 with
``Retry-After``, gRPC UNAVAILABLE with ``retry-after``, health NOT_SERVING); ``expire`` at the
deadline cancels each request where it waits on its flow (never where its front door writes to
the client), and ``Router.generate`` turns that cancel into a ``WorkerFailure`` (HTTP 503 or an
SSE error event; gRPC UNAVAILABLE), after the flow's own cleanup: worker calls aborted, leases
released, every block back.
"""

from __future__ import annotations

import asyncio
import weakref

from router.flow.types import Overloaded, WorkerFailure

# What a client refused during a drain waits before it tries again (another router by then).
DRAIN_RETRY_AFTER_S = 5
SHUTDOWN_MESSAGE = "the server is shutting down: its drain grace period ended before this request"


class Draining(Overloaded):
    """A request that arrived while the router drains (HTTP 429 + Retry-After, gRPC
    UNAVAILABLE + retry-after)."""

    def __init__(self):
        super().__init__("the server is shutting down (draining)", DRAIN_RETRY_AFTER_S)


class Drain:
    """Whether the router drains, and the requests waiting on their flow right now."""

    def __init__(self):
        self.draining = False
        self.expired = False
        self._inside: set[asyncio.Task] = set()  # tasks awaiting a flow's next item now
        self._ended: weakref.WeakSet[asyncio.Task] = weakref.WeakSet()

    def start(self) -> None:
        self.draining = True

    def expire(self) -> int:
        """The grace period is over: end every request that waits on its flow (the others end
        at their next item). Returns how many were cancelled here."""
        self.expired = True
        inside = list(self._inside)
        for task in inside:
            self._ended.add(task)
            task.cancel(SHUTDOWN_MESSAGE)
        return len(inside)

    async def next(self, items):
        """``items``' next item, None at its end; WorkerFailure once expired."""
        if self.expired:
            raise WorkerFailure(SHUTDOWN_MESSAGE)
        task = asyncio.current_task()
        self._inside.add(task)
        try:
            return await items.__anext__()
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            if task not in self._ended:
                raise
            self._ended.discard(task)
            task.uncancel()
            raise WorkerFailure(SHUTDOWN_MESSAGE) from None
        finally:
            self._inside.discard(task)
