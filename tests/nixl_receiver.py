"""The decode side the nixl transport tests write into: a cache, its leases and a nixl
server holding the cluster token, and what a module's ``rx`` fixture opens and closes."""

from __future__ import annotations

import time

import torch

from kv_transfer.lease import LeaseTable
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import make_sender, start_receiver_server

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 3, 16, 4, 2, 8
TOKEN = "nixl-test-token"


def kv_cache(zero: bool):
    new = torch.zeros if zero else torch.randn
    shape = (BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
    return [(new(shape), new(shape)) for _ in range(LAYERS)]


class Receiver:
    """A decode side's cache, leases and nixl server (with the cluster token)."""

    def __init__(self, **opts):
        transport = "faults" if "inner" in opts else "nixl"  # faults wraps nixl
        self.src, self.dst = kv_cache(zero=False), kv_cache(zero=True)
        self.leases = LeaseTable(default_ttl_s=30.0, num_layers=LAYERS)
        self.receiver = KVReceiver(self.dst, self.leases, pending_lease_wait_s=0.2)
        self.server = start_receiver_server(
            transport, self.receiver, "127.0.0.1", 0, token=TOKEN, **opts
        )
        self.senders = []

    def sender(self, token: str | None = TOKEN):
        self.senders.append(
            make_sender("faults" if "#" in self.endpoint else "nixl", self.endpoint, token=token)
        )
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
        """A clean sender's transfer lands exactly and commits."""
        lease, stats = self.transfer(self.sender(), f"clean-{time.monotonic_ns()}", [2, 7], [11, 4])
        assert lease.is_committed and stats.frames == LAYERS
        self.assert_arrived([2, 7], [11, 4])
        self.leases.close(lease.lease_id)

    def close(self) -> None:
        for s in self.senders:
            s.close()
        self.server.stop()


def receivers():
    """The body of a test module's ``rx`` fixture: yields an opener of Receivers, closes each
    after the test."""
    opened = []

    def open_one(**opts) -> Receiver:
        opened.append(Receiver(**opts))
        return opened[-1]

    yield open_one
    for r in opened:
        r.close()
