"""The router's worker pool: status polls survive workers being removed under them; a worker
slow to answer stays in routing for a few polls, a gone one leaves at once."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent import futures

import grpc

from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router.pool import WorkerPool


class SlowDecode(pb_grpc.DecodeWorkerServicer):
    """Answers Status after ``delay`` seconds (a worker too busy to answer at once)."""

    def __init__(self, delay: float):
        self.delay = delay
        self.calls = threading.Event()

    def Status(self, request, context):
        self.calls.set()
        time.sleep(self.delay)
        return pb.WorkerStatus(role="decode", num_free_blocks=7, num_total_blocks=8)


def _serve(servicer):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_removing_a_worker_during_a_poll_keeps_polling_the_others():
    slow_server, slow = _serve(SlowDecode(delay=1.0))
    fast_server, fast = _serve(SlowDecode(delay=0.0))

    async def run():
        pool = WorkerPool("decode")
        pool.add(slow)
        pool.add(fast)
        polling = asyncio.ensure_future(pool.poll(timeout=5.0))
        await asyncio.sleep(0.3)  # the slow worker's Status is in flight
        await pool.remove(slow)  # closes its channel under the call
        await polling  # must not raise (a CancelledError here used to end the router's poller)
        await pool.poll(timeout=5.0)
        handle = pool.workers[fast]
        await pool.close()
        return handle

    try:
        handle = asyncio.run(run())
    finally:
        slow_server.stop(None)
        fast_server.stop(None)
    assert handle.healthy and handle.free_blocks == 7


def test_cancelling_a_poll_still_cancels_it():
    server, address = _serve(SlowDecode(delay=2.0))

    async def run():
        pool = WorkerPool("decode")
        pool.add(address)
        polling = asyncio.ensure_future(pool.poll(timeout=5.0))
        await asyncio.sleep(0.3)
        polling.cancel()
        try:
            await polling
        except asyncio.CancelledError:
            return True
        finally:
            await pool.close()
        return False

    try:
        assert asyncio.run(run())
    finally:
        server.stop(None)


def test_a_slow_worker_stays_routable_for_a_few_polls_and_a_gone_one_leaves_at_once():
    from router.pool import MAX_SLOW_POLLS

    slow_server, slow = _serve(SlowDecode(delay=0.5))
    gone_server, gone = _serve(SlowDecode(delay=0.0))

    async def run():
        pool = WorkerPool("decode")
        pool.add(slow)
        pool.add(gone)
        await pool.poll(timeout=5.0)  # both answer: healthy
        assert [w.address for w in pool.routable()] == [slow, gone]
        gone_server.stop(None)  # connection refused from now on
        seen = []
        for _ in range(MAX_SLOW_POLLS):
            await pool.poll(timeout=0.1)  # the slow one times out each time
            seen.append([w.address for w in pool.routable()])
        await pool.close()
        return seen

    try:
        seen = asyncio.run(run())
    finally:
        slow_server.stop(None)
    assert seen == [[slow]] * (MAX_SLOW_POLLS - 1) + [[]]
