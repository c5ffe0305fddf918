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

A text of ``LARGE_TEXT_LEN`` characters or more goes to one thread of its own at
the lowest CPU class there is (SCHED_IDLE, Linux): it runs on CPU time nothing else wants,
and a stream's thread that wakes takes its core back at once. Niceness 10 still gets about a
tenth of a core against each busy thread and may keep the core until its slice ends: beside
a burst of 1 MiB texts on 2 cores, that moved a stream's p99 gap 2.0-2.7x, SCHED_IDLE 1.8-2.0x.
Texts that large are longer than most models' context (a /completions prompt that long is
refused once tokenized) or a /tokenize call, so waiting for idle cores costs no one a stream;
ordinary prompts stay in the first pool, whose short GIL-holding work should not wait there.
"""

from __future__ import annotations

import asyncio
import contextlib
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


# A text this long (characters) is tokenized at SCHED_IDLE (about 64k tokens: past most contexts).
LARGE_TEXT_LEN = 256 * 1024


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TOKENIZE_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at the same priority
        pass


def _idle_priority() -> None:
    """This thread runs only where no other thread wants the CPU (SCHED_IDLE; a thread may
    always lower its own class); where that is refused, at the highest niceness."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, tid, 19)


class Offload:
    def __init__(self, threads: int = TOKENIZE_THREADS):
        self._pool = ThreadPoolExecutor(
            threads, thread_name_prefix="pdserve-tokenize", initializer=_lower_priority
        )
        self._large = ThreadPoolExecutor(
            1, thread_name_prefix="pdserve-tokenize-large", initializer=_idle_priority
        )

    async def run(self, fn, *args, text_len: int = 0, **kwargs):
        """``fn(*args, **kwargs)`` in one of the pools' threads; its exception is raised here.
        ``text_len``: the length of the text it works on (prompts, messages, or a body that
        is mostly text), which picks the pool: from ``LARGE_TEXT_LEN`` on, the idle-class one."""
        pool = self._large if text_len >= LARGE_TEXT_LEN else self._pool
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        for pool in (self._pool, self._large):
            pool.shutdown(wait=False, cancel_futures=True)


def text_len(messages) -> int:
    """The characters of chat messages' contents (``Offload.run``'s ``text_len``)."""
    return sum(len(str(m.get("content") or "")) for m in messages)
