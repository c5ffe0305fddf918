"""Tokenization and chat templates off the event loop, at both front doors (HTTP, gRPC).
The router's one asyncio loop carries every stream's tokens; a 1 MiB prompt takes the
tokenizer about 0.6 s on one core, and a chat template is Python, so either on the loop would
stall every concurrent stream by as much.

They run in a small pool of threads instead (``TOKENIZE_THREADS``: bounded, so a burst queues
here rather than starting a thread per request; the queue is bounded by the requests the
servers hold, each already under ``max_request_bytes``). The tokenizer lets go of the GIL for
long texts (``engine.tokenizer.Tokenizer.encode``), and a template's Python yields it every
switch interval, so the loop keeps sending tokens meanwhile; and they run at a lower CPU
priority, so on a machine short of cores the streams' work goes first.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

# Half the cores (1 to 4): tokenizing a burst must leave the loop, and on a small machine the
# workers, a core to run on.
TOKENIZE_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))


# The pool's threads run this much nicer than the router (Linux: a thread's own niceness), so
# that where cores are short, the streams' work runs first and a burst of tokenizing waits.
TOKENIZE_NICENESS = 10


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TOKENIZE_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at the same priority
        pass


class Offload:
    def __init__(self, threads: int = TOKENIZE_THREADS):
        self._pool = ThreadPoolExecutor(
            threads, thread_name_prefix="pdserve-tokenize", initializer=_lower_priority
        )

    async def run(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` in one of the pool's threads; its exception is raised here."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
