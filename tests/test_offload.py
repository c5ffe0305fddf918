"""router/offload.py: which pool a call runs in, at which CPU priority (Linux)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest

from router.offload import LARGE_TEXT_LEN, TOKENIZE_NICENESS, Offload, text_len

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="per-thread priorities: Linux")


def where() -> tuple[str, int, int]:
    """The calling thread's name, scheduling policy and niceness."""
    tid = threading.get_native_id()
    name = threading.current_thread().name
    return name, os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)


def test_a_large_text_runs_at_the_idle_class_and_an_ordinary_one_niced():
    async def both():
        offload = Offload(threads=1)
        try:
            small = await offload.run(where, text_len=LARGE_TEXT_LEN - 1)
            large = await offload.run(where, text_len=LARGE_TEXT_LEN)
            return small, large
        finally:
            offload.close()

    small, large = asyncio.run(both())
    assert small[0].startswith("pdserve-tokenize_") and small[1] == os.SCHED_OTHER
    assert small[2] == TOKENIZE_NICENESS
    assert large[0].startswith("pdserve-tokenize-large") and large[1] == os.SCHED_IDLE


def test_chat_text_len_counts_the_messages_contents():
    assert text_len([{"role": "user", "content": "abc"}, {"role": "x", "content": None}]) == 3
