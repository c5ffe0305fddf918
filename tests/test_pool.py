"""The router's worker pool: status polls survive workers being removed under them; a worker
slow to answer stays in routing for a few polls, a gone one leaves at once."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
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


@contextlib.contextmanager
def decode_servers(*delays: float) -> Iterator[list[tuple[grpc.Server, str]]]:
    """A fake decode worker per delay (its Status answers after that long), as (server,
    address); every one stopped after the block (stopping one twice is harmless)."""
    servers = [_serve(SlowDecode(delay)) for delay in delays]
    try:
        yield servers
    finally:
        for server, _ in servers:
            server.stop(None)


def pool_of(*addresses: str) -> WorkerPool:
    pool = WorkerPool("decode")
    for address in addresses:
        pool.add(address)
    return pool


def test_removing_a_worker_during_a_poll_keeps_polling_the_others():
    async def run(slow, fast):
        pool = pool_of(slow, fast)
        polling = asyncio.ensure_future(pool.poll(timeout=5.0))
        await asyncio.sleep(0.3)  # the slow worker's Status is in flight
        await pool.remove(slow)  # closes its channel under the call
        await polling  # must not raise (a CancelledError here used to end the router's poller)
        await pool.poll(timeout=5.0)
        handle = pool.workers[fast]
        await pool.close()
        return handle

    with decode_servers(1.0, 0.0) as [(_, slow), (_, fast)]:
        handle = asyncio.run(run(slow, fast))
    assert handle.healthy and handle.free_blocks == 7


def test_cancelling_a_poll_still_cancels_it():
    async def run(address):
        pool = pool_of(address)
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

    with decode_servers(2.0) as [(_, address)]:
        assert asyncio.run(run(address))


def test_a_slow_worker_stays_routable_for_a_few_polls_and_a_gone_one_leaves_at_once():
    from router.pool import MAX_SLOW_POLLS

    async def run(slow, gone, gone_server):
        pool = pool_of(slow, gone)
        await pool.poll(timeout=5.0)  # both answer: healthy
        assert [w.address for w in pool.routable()] == [slow, gone]
        gone_server.stop(None)  # connection refused from now on
        seen = []
        for _ in range(MAX_SLOW_POLLS):
            await pool.poll(timeout=0.1)  # the slow one times out each time
            seen.append([w.address for w in pool.routable()])
        await pool.close()
        return seen

    with decode_servers(0.5, 0.0) as [(_, slow), (gone_server, gone)]:
        seen = asyncio.run(run(slow, gone, gone_server))
    assert seen == [[slow]] * (MAX_SLOW_POLLS - 1) + [[]]
