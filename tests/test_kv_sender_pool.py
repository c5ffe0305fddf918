"""The prefill worker's sender pool closes senders whose destination is gone (broken link, or
idle past the bound), never one with a stream still open, and a new destination still works."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kv_transfer import transport_grpc
from kv_transfer.lease import LeaseTable
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import TransferError, start_receiver_server
from kv_transfer.sender_pool import SenderPool, SenderPoolSettings
from kv_transfer.transport_faults import FaultPolicy

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 2, 8, 4, 2, 8
FAST = SenderPoolSettings(idle_close_s=0.4, broken_grace_s=0.05, check_interval_s=0.05)
SRC = [(torch.randn(BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM),) * 2 for _ in range(LAYERS)]


class Destination:
    """A decode worker's KV side: a receiver behind a server."""

    def __init__(self, transport: str = "grpc", **opts):
        shape = (BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
        self.cache = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(LAYERS)]
        self.leases = LeaseTable(default_ttl_s=30.0)
        receiver = KVReceiver(self.cache, self.leases, pending_lease_wait_s=0.2)
        self.server = start_receiver_server(transport, receiver, "127.0.0.1", 0, **opts)
        self.transport, self.endpoint = transport, self.server.endpoint

    def open_stream(self, pool: SenderPool, request_id: str, blocks: list[int]):
        lease = self.leases.open(request_id, blocks)
        sender = pool.get(self.transport, self.endpoint)
        return sender, lease, sender.open_stream(request_id, lease.lease_id)

    def transfer(self, pool: SenderPool, request_id: str, blocks: list[int]):
        sender, lease, stream = self.open_stream(pool, request_id, blocks)
        for layer, (k, v) in enumerate(SRC):
            stream.send_layer(layer, [1, 2], range(len(blocks)), k, v)
        stream.commit(timeout=20)
        for (k_dst, _), (k_src, _) in zip(self.cache, SRC, strict=True):
            assert torch.equal(k_dst[blocks], k_src[[1, 2]])
        return sender, lease


def _kv_send_threads(endpoint: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"kv-send {endpoint}" and t.is_alive()]


def _wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def pool():
    pool = SenderPool(settings=FAST)
    yield pool
    pool.close()


def test_a_dead_destinations_sender_is_closed_and_a_new_destination_works(pool, monkeypatch):
    closed_links = []
    close = transport_grpc._GrpcLink.close
    monkeypatch.setattr(
        transport_grpc._GrpcLink, "close", lambda link: (closed_links.append(link), close(link))
    )
    gone = Destination()
    sender, lease = gone.transfer(pool, "r1", [3, 4])
    assert lease.is_committed and _kv_send_threads(gone.endpoint)
    gone.server.stop()  # the decode worker dies; nobody asks for its endpoint again

    # close() flags the sender first, then joins its thread and closes its link: wait for
    # the whole close, not only the flag.
    _wait_until(lambda: sender.closed and closed_links)
    assert not _kv_send_threads(gone.endpoint)  # its thread has ended (joined before the link)
    assert closed_links == [sender._link]  # its gRPC channel is closed
    assert ("grpc", gone.endpoint) not in pool.endpoints() and pool.closed_senders == 1

    fresh = Destination()  # its replacement, at a new endpoint
    new_sender, lease = fresh.transfer(pool, "r2", [5, 6])
    assert lease.is_committed and new_sender is not sender and not new_sender.closed
    fresh.server.stop()


def test_a_sender_with_an_open_stream_is_not_closed_while_idle(pool):
    dest = Destination()
    sender, lease, stream = dest.open_stream(pool, "r1", [0, 1])
    time.sleep(FAST.idle_close_s * 2)  # no frame for longer than the idle bound: still in use
    assert not sender.closed and pool.endpoints() == [("grpc", dest.endpoint)]
    for layer, (k, v) in enumerate(SRC):
        stream.send_layer(layer, [1, 2], [0, 1], k, v)
    stream.commit(timeout=20)
    assert lease.is_committed
    _wait_until(lambda: sender.closed)  # finished and idle: now it goes
    assert pool.get("grpc", dest.endpoint) is not sender  # asked again: a fresh one
    dest.server.stop()


def test_a_broken_link_is_closed_soon_after_its_last_stream(pool):
    """A link that broke (a torch_dist pair whose peer died; here the faults transport cuts
    it) is closed after the short grace, without waiting for the idle bound."""
    cut = Destination("faults", inner="grpc", policy=FaultPolicy(disconnect_p=1.0))
    with pytest.raises(TransferError, match="the link broke"):
        cut.transfer(pool, "r1", [0, 1])
    sender = pool.get(cut.transport, cut.endpoint)
    assert sender.link_broken
    started = time.monotonic()
    _wait_until(lambda: sender.closed)
    assert time.monotonic() - started < FAST.idle_close_s
    assert not _kv_send_threads(cut.endpoint)
    cut.server.stop()
