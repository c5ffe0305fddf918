"""The decode side the one-sided transports' tests (nixl, shm) write into: a cache, its leases
and a receiver server holding the cluster token; what a module's ``rx`` fixture opens and
closes; and the refusals both transports must make alike."""

from __future__ import annotations

import time

import pytest
import torch

from kv_transfer.lease import LeaseTable
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import TransferError, make_sender, start_receiver_server

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 3, 16, 4, 2, 8
TOKEN = "one-sided-test-token"


def kv_cache(zero: bool):
    new = torch.zeros if zero else torch.randn
    shape = (BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
    return [(new(shape), new(shape)) for _ in range(LAYERS)]


class Receiver:
    """A decode side's cache, leases and ``transport`` server (with the cluster token); with
    ``inner=`` among ``opts`` the faults transport wraps it."""

    def __init__(self, transport: str, **opts):
        self.transport = "faults" if "inner" in opts else transport
        self.src, self.dst = kv_cache(zero=False), kv_cache(zero=True)
        self.leases = LeaseTable(default_ttl_s=30.0, num_layers=LAYERS)
        self.receiver = KVReceiver(self.dst, self.leases, pending_lease_wait_s=0.2)
        self.server = start_receiver_server(
            self.transport, self.receiver, "127.0.0.1", 0, token=TOKEN, **opts
        )
        self.inner = getattr(self.server, "_inner", self.server)  # past the faults, if any
        self.clean_transport = transport
        self.senders = []

    def sender(self, token: str | None = TOKEN):
        self.senders.append(make_sender(self.transport, self.endpoint, token=token))
        return self.senders[-1]

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def transfer(self, sender, request_id, src_ids, dst_ids, ttl_s=None, before_commit=None):
        lease = self.leases.open(request_id, dst_ids, ttl_s=ttl_s)
        stream = sender.open_stream(request_id, lease.lease_id)
        for layer, (k, v) in enumerate(self.src):
            stream.send_layer(layer, src_ids, range(len(src_ids)), k, v)
        if before_commit is not None:
            before_commit(stream)
        return lease, stream.commit(timeout=20)

    def assert_arrived(self, src_ids, dst_ids) -> None:
        for (k_src, v_src), (k_dst, v_dst) in zip(self.src, self.dst, strict=True):
            assert torch.equal(k_dst[dst_ids], k_src[src_ids])
            assert torch.equal(v_dst[dst_ids], v_src[src_ids])

    def assert_still_serving(self) -> None:
        """A clean sender's transfer (past any faults) lands exactly and commits."""
        clean = make_sender(self.clean_transport, self.inner.endpoint, token=TOKEN)
        self.senders.append(clean)
        lease, stats = self.transfer(clean, f"clean-{time.monotonic_ns()}", [2, 7], [11, 4])
        assert lease.is_committed and stats.frames == LAYERS
        self.assert_arrived([2, 7], [11, 4])
        self.leases.close(lease.lease_id)

    def close(self) -> None:
        for s in self.senders:
            s.close()
        self.server.stop()


def receivers(transport: str):
    """The body of a test module's ``rx`` fixture: yields an opener of ``transport``'s
    Receivers, closes each after the test."""
    opened = []

    def open_one(**opts) -> Receiver:
        opened.append(Receiver(transport, **opts))
        return opened[-1]

    yield open_one
    for r in opened:
        r.close()


def refuses_a_write_into_the_leases_cached_blocks(r: Receiver) -> None:
    """The lease's leading blocks came from the prefix cache (shared): never written."""
    lease = r.leases.open("cached", [3, 4, 5], first_block=1)
    stream = r.sender().open_stream("cached", lease.lease_id)
    stream.send_layer(0, [1, 2], [0, 1], *r.src[0])
    with pytest.raises(TransferError, match="outside lease"):
        stream.commit(timeout=20)
    assert all(not k.any() and not v.any() for k, v in r.dst)
    r.assert_still_serving()


def refuses_an_incomplete_commit(r: Receiver) -> None:
    lease = r.leases.open("req", [1, 2])
    stream = r.sender().open_stream("req", lease.lease_id)
    stream.send_layer(0, [3, 4], [0, 1], *r.src[0])  # one layer of three
    with pytest.raises(TransferError, match="incomplete commit"):
        stream.commit(timeout=20)
    assert not lease.is_committed
    r.assert_still_serving()
