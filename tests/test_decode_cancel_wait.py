"""A Decode on a lease waits for the lease's KV. When its caller cancels the call, the wait
ends at once: the server thread and the stream it counted in the budget come back, and the
lease's blocks are freed, instead of all three being held until the lease's deadline
(RELIABILITY.md, issue 19's open item)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from decode_worker.server import serve_decode_worker
from decode_worker.worker import CallerLeft, DecodeWorker
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from tests.conftest import tiny_llama_dir

LEASE_S = 30.0  # the KV never comes; without the wake-up the wait would last this long
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("cancel-wait"), seed=6)
    return path


@pytest.fixture
def decode_server(tiny, make_engine):
    worker = DecodeWorker(make_engine(tiny, num_blocks=64))
    server, address, _ = serve_decode_worker(worker, max_streams=4)
    channel = grpc.insecure_channel(address)
    try:
        yield worker, pb_grpc.DecodeWorkerStub(channel)
    finally:
        channel.close()
        server.stop(grace=None)
        worker.stop()


def _decode_on(stub, lease_id: str):
    req = pb.DecodeRequest(
        request_id="waiting",
        lease_id=lease_id,
        prompt_token_ids=PROMPT,
        output_token_ids=[8],
        sampling=pb.SamplingParams(max_tokens=4),
    )
    return stub.Decode(req, timeout=2 * LEASE_S)


def _wait_for_status(stub, done, timeout: float) -> tuple[pb.WorkerStatus, float]:
    """Poll Status until ``done(status)``; returns the last status and the seconds it took."""
    start = time.monotonic()
    while True:
        st = stub.Status(pb.StatusRequest(), timeout=2)
        if done(st) or time.monotonic() - start > timeout:
            return st, time.monotonic() - start
        time.sleep(0.02)


def test_a_cancelled_decode_waiting_for_its_kv_gives_back_its_thread_and_lease(decode_server):
    _, stub = decode_server
    reserve = pb.ReserveRequest(request_id="waiting", num_tokens=8, lease_seconds=LEASE_S)
    lease = stub.Reserve(reserve, timeout=2)
    call = _decode_on(stub, lease.lease_id)
    st, _ = _wait_for_status(stub, lambda s: s.open_streams == 1, timeout=5)
    assert st.open_streams == 1 and st.num_leases == 1  # it waits for the KV, holding both
    assert st.num_free_blocks < st.num_total_blocks
    call.cancel()
    st, seconds = _wait_for_status(
        stub,
        lambda s: (
            s.open_streams == 0 and s.num_leases == 0 and s.num_free_blocks == s.num_total_blocks
        ),
        timeout=LEASE_S,
    )
    assert st.open_streams == 0 and st.num_leases == 0, st
    assert st.num_free_blocks == st.num_total_blocks
    assert seconds < 1.0, f"the wait lasted {seconds:.1f} s after the cancel"
    assert not stub.Release(pb.ReleaseRequest(lease_id=lease.lease_id), timeout=2).released
    # The worker serves on: a stream to its end.
    local = pb.DecodeRequest(
        request_id="after",
        prompt_token_ids=PROMPT,
        sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True),
    )
    chunks = list(stub.Decode(local, timeout=10))
    assert sum(len(c.token_ids) for c in chunks) == 3 and chunks[-1].finish_reason == "length"


def test_attach_returns_when_its_caller_leaves_and_only_its_own(decode_server):
    """``leave`` wakes the attach of the call that ended; another attach waiting on its own
    lease goes on waiting."""
    worker, _ = decode_server
    mine = worker.reserve("mine", 8, ttl_s=LEASE_S)
    other = worker.reserve("other", 8, ttl_s=LEASE_S)
    mine_left, other_left = threading.Event(), threading.Event()
    results: dict[str, BaseException | None] = {}

    def attach(name, lease, left):
        try:
            worker.attach(name, lease.lease_id, PROMPT, [8], pb.SamplingParams(), (), left)
            results[name] = None
        except BaseException as e:  # noqa: BLE001 - what the attach ended with
            results[name] = e

    threads = {
        name: threading.Thread(target=attach, args=(name, lease, left))
        for name, lease, left in [("mine", mine, mine_left), ("other", other, other_left)]
    }
    for t in threads.values():
        t.start()
    time.sleep(0.2)  # both wait for their KV
    start = time.monotonic()
    worker.leave(mine.lease_id, mine_left)
    threads["mine"].join(timeout=5)
    assert time.monotonic() - start < 1.0
    assert isinstance(results["mine"], CallerLeft)
    assert mine.lease_id not in worker.leases  # released
    assert threads["other"].is_alive() and other.lease_id in worker.leases
    worker.leave(other.lease_id, other_left)
    threads["other"].join(timeout=5)
    assert isinstance(results["other"], CallerLeft)
    assert worker.blocks.num_free == worker.blocks.num_total
