"""A hostile client on the torch_dist pairing port (#46): it inflates the pair count, tries to
overwrite the rendezvous keys the senders used to trust, sends garbage, or connects and stalls.
In each case a legitimate sender still pairs within 5 s and its blocks land exactly, the
receiver's Python thread count stays bounded (a client without the token costs no thread),
and the receiver stays healthy. Mutual proof, the pair cap and the guarded acceptor:
tests/test_torch_dist_mutual.py."""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from kv_transfer.lease import LeaseTable
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import make_sender, start_receiver_server
from kv_transfer.torch_dist import handshake

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

TOKEN = "hostile-test-token"
LAYERS, SHAPE = 2, (8, 4, 2, 8)  # blocks, block size, kv heads, head dim
PAIR_WITHIN_S = 5.0
HANDSHAKE_S = 1.0  # the receiver's handshake deadline in these tests
THREAD_SLACK = 2  # the legitimate pair's thread, and the sender's own


class Served:
    """A torch_dist receiver with the token, and what a test needs to attack and check it."""

    def __init__(self, **opts):
        cache = [(torch.zeros(SHAPE), torch.zeros(SHAPE)) for _ in range(LAYERS)]
        self.receiver = KVReceiver(cache, LeaseTable(30.0), pending_lease_wait_s=0.2)
        self.server = start_receiver_server(
            "torch_dist", self.receiver, "127.0.0.1", 0, token=TOKEN, **opts
        )
        host, _, port = self.server.endpoint.rpartition(":")
        self.addr = (host, int(port))
        self.threads_before = threading.active_count()
        self.pushes = 0

    def connect(self) -> socket.socket:
        return socket.create_connection(self.addr, timeout=5.0)

    def push(self, token: str = TOKEN) -> float:
        """A legitimate sender pairs and pushes two blocks; returns the seconds pairing took."""
        self.pushes += 1
        lease = self.receiver.leases.open(f"r{self.pushes}", [1, 6])
        src = [(torch.randn(SHAPE), torch.randn(SHAPE)) for _ in range(LAYERS)]
        started = time.monotonic()
        sender = make_sender("torch_dist", self.server.endpoint, token=token)
        paired_s = time.monotonic() - started
        try:
            stream = sender.open_stream(lease.request_id, lease.lease_id)
            for layer, (k, v) in enumerate(src):
                stream.send_layer(layer, [3, 5], [0, 1], k, v)
            assert stream.commit(timeout=20).frames == LAYERS
            assert threading.active_count() <= self.threads_before + THREAD_SLACK
        finally:
            sender.close()
        assert lease.is_committed
        for layer, (k, v) in enumerate(src):
            k_dst, v_dst = self.receiver.kv_caches[layer]
            assert torch.equal(k_dst[1], k[3]) and torch.equal(k_dst[6], k[5])
            assert torch.equal(v_dst[1], v[3]) and torch.equal(v_dst[6], v[5])
        return paired_s

    def assert_bounded_and_healthy(self) -> None:
        assert self.server.healthy and self.server.problem() is None
        deadline = time.monotonic() + 5.0  # the closed pair's thread ends after its CLOSE
        while self.server.active_pairs and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.server.active_pairs == 0
        assert threading.active_count() <= self.threads_before + 1

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def served():
    s = Served(handshake_timeout_s=HANDSHAKE_S)
    yield s
    s.stop()


def closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        while sock.recv(4096):
            pass  # the challenge, if it got one
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_an_inflated_pair_count_gives_no_pairs_and_no_threads(served):
    """Hundreds of connections that start the handshake and never finish it, and dozens that
    claim a pair with forged proofs: no pair slot, no thread, and the real sender pairs."""
    stalled = []
    for _ in range(200):
        sock = served.connect()
        sock.sendall(handshake.hello()[0])
        stalled.append(sock)
    for _ in range(50):
        with served.connect() as sock:
            sock.sendall(handshake.hello()[0])
            handshake.recv_exact(sock, handshake.CHALLENGE_LEN)
            sock.sendall(os.urandom(handshake.PROOF_LEN))  # a proof without the token
            assert handshake.recv_exact(sock, 1) == handshake.REFUSED
    assert served.server.active_pairs == 0
    assert threading.active_count() <= served.threads_before
    assert served.push() < PAIR_WITHIN_S
    served.assert_bounded_and_healthy()
    for sock in stalled:
        sock.close()


def test_the_old_store_keys_cannot_be_overwritten(served):
    """What an attacker did to the old TCPStore rendezvous (rewrite the backend, the idle
    timeout, the pair count, a pair's verdict) finds no store on the port: nothing the sender
    reads comes from there, and it pairs with the receiver's own parameters."""
    for _ in range(3):
        with pytest.raises(Exception, match="(?i)recv|closed|connect|timeout"):
            store = dist.TCPStore(
                served.addr[0], served.addr[1], is_master=False,
                timeout=datetime.timedelta(seconds=2),
            )  # fmt: skip
            store.set("backend", "nccl")
            store.set("idle_timeout_ms", "1")
            store.add("pairs", 1000)
            store.set("pair/1/verdict", b"ok")
    assert served.push() < PAIR_WITHIN_S
    sender = make_sender("torch_dist", served.server.endpoint, token=TOKEN)
    try:
        assert sender._link.idle_interval_s == 30.0 / 4  # the receiver's, not the attacker's
    finally:
        sender.close()
    served.assert_bounded_and_healthy()


GARBAGE = [
    lambda: os.urandom(4096),
    lambda: os.urandom(handshake.HELLO_LEN),  # the right length, the wrong magic
    lambda: b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 4,
    lambda: handshake.hello()[0] + os.urandom(10_000),  # a hello, then junk as its proof
    lambda: b"\x00" * 100_000,
]


def test_garbage_closes_only_the_sender_of_it(served):
    socks = []
    for i in range(60):
        sock = served.connect()
        try:
            sock.sendall(GARBAGE[i % len(GARBAGE)]())
        except (BrokenPipeError, ConnectionResetError):
            pass  # already thrown out
        socks.append(sock)
    assert all(closed_by_peer(sock, HANDSHAKE_S + 2.0) for sock in socks)
    assert served.push() < PAIR_WITHIN_S
    served.assert_bounded_and_healthy()
    for sock in socks:
        sock.close()


def test_a_stalled_connection_times_out_and_blocks_nobody(served):
    silent = [served.connect() for _ in range(20)]
    halves = []
    for _ in range(20):
        sock = served.connect()
        sock.sendall(handshake.hello()[0][:20])  # half a hello, then nothing
        halves.append(sock)
    assert served.push() < PAIR_WITHIN_S  # while every stalled one is still open
    started = time.monotonic()
    assert all(closed_by_peer(sock, HANDSHAKE_S + 2.0) for sock in silent + halves)
    assert time.monotonic() - started < HANDSHAKE_S + 2.0
    assert served.server._acceptor.pending == 0
    served.assert_bounded_and_healthy()
    for sock in silent + halves:
        sock.close()


def test_a_flood_past_the_pending_cap_evicts_the_oldest_not_the_sender():
    """More stalled handshakes than ``max_pending``: the oldest are closed to make room, and a
    sender arriving after the flood still pairs."""
    served = Served(max_pending=8, handshake_timeout_s=30.0)
    try:
        flood = [served.connect() for _ in range(40)]
        time.sleep(0.3)  # let the acceptor take them all
        assert served.server._acceptor.pending <= 8
        assert served.push() < PAIR_WITHIN_S
        assert sum(closed_by_peer(sock, 0.2) for sock in flood) >= 40 - 8
        served.assert_bounded_and_healthy()
        for sock in flood:
            sock.close()
    finally:
        served.stop()
