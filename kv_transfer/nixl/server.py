"""nixl transport, decode side: the receiver's NIXL agent holds the KV cache registered; a
control port (kv_transfer.nixl.control) hands each sender that proved the cluster token the
agent's metadata and, per lease, the addresses of that lease's blocks only; commit
notifications from those senders' agents are checked and applied (KVReceiver.commit_written).

Notifications are drained by whichever control thread waits for a verdict (so an ack comes
as soon as its commit landed) and by a slow poller (so a commit whose sender left still
counts). A notification from an agent no authenticated peer announced is dropped unread; one
that fails its CRCs, names a lease that is gone, positions outside its lease, or bytes whose
digest does not match the leased blocks is refused, and the refusal is the sender's ack.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import numpy as np

from grpc_plumbing.auth import OpenBindError, is_loopback
from kv_transfer.errors import FrameError
from kv_transfer.nixl.agent import NixlAgent, mem_type
from kv_transfer.nixl.commit import (
    WRITTEN,
    block_rows,
    decode_notification,
    decode_written,
    notification_key,
    write_hashes,
)
from kv_transfer.nixl.control import PROTOCOL, ControlConnection, field
from kv_transfer.one_sided import (
    ControlServer,
    HandedLeases,
    digest_check,
    refuse_open_without_token,
)

log = logging.getLogger("pdserve.kv")

MAX_VERDICTS = 4096  # verdicts kept for acks still to come
# The background drain: it also progresses the agent, which UCX's WRITEs over TCP need on the
# receiving side to land; fast for a while after a sender asked for a lease's blocks.
POLL_INTERVAL_S = 0.02
BUSY_POLL_INTERVAL_S = 0.001
BUSY_FOR_S = 10.0  # a long prefill writes its last layers seconds after its first
ACK_POLL_S = (0.0002, 0.005)  # an ack's drain backs off between these


def check_exposure(host: str, token: str | None, private_network: bool) -> None:
    """Off loopback: only with the cluster token (its control port hands out the agent's
    metadata) and the operator's private-network flag (UCX's data path is neither
    authenticated nor encrypted past the metadata)."""
    if is_loopback(host):
        return
    refuse_open_without_token("nixl", host, token)
    if not private_network:
        raise OpenBindError(
            f"refusing to serve nixl KV on {host}: UCX's WRITEs are neither authenticated nor "
            "encrypted past the metadata exchange. Bind 127.0.0.1, or set kv_private_network "
            "(--kv-private-network) if only the cluster can reach that network."
        )


def cache_layout(kv_caches) -> dict:
    """What a sender needs to write into these caches: per-block bytes, block shape, dtype,
    memory type (identical for every layer's K and V)."""
    k0 = kv_caches[0][0]
    kind, device = mem_type(k0)
    for k, v in kv_caches:
        if k.shape != k0.shape or v.shape != k0.shape or k.dtype != k0.dtype != v.dtype:
            raise ValueError("nixl needs every layer's K and V cache of one shape and dtype")
    return {
        "num_layers": len(kv_caches),
        "block_shape": list(k0.shape[1:]),
        "dtype": str(k0.dtype).removeprefix("torch."),
        "block_bytes": k0[0].numel() * k0.element_size(),
        "mem_type": kind,
        "device": device,
    }


class NixlReceiverServer(ControlServer):
    kind = "nixl"

    def __init__(
        self,
        receiver,
        host: str,
        port: int,
        token: str | None = None,
        private_network: bool = False,
        max_pairs: int = 64,
        max_pending: int = 64,
        handshake_timeout_s: float = 5.0,
        ack_timeout_s: float = 10.0,
    ):
        check_exposure(host, token, private_network)
        self._receiver = receiver
        caches = receiver.kv_caches
        self.layout = cache_layout(caches)
        self.agent = NixlAgent("decode")
        for k, v in caches:
            self.agent.register(k)
            self.agent.register(v)
        self._bases = np.array([[k.data_ptr(), v.data_ptr()] for k, v in caches], dtype=np.uint64)
        on_host = self.layout["mem_type"] == "DRAM"
        self._rows = [(block_rows(k), block_rows(v)) for k, v in caches] if on_host else None
        self._ack_timeout_s = ack_timeout_s
        self._peers: dict[str, int] = {}  # agent names announced by authenticated peers
        self._verdicts: OrderedDict[tuple[str, int], list[str]] = OrderedDict()
        self._cond = threading.Condition()
        self._drain_lock = threading.Lock()
        self.notifications_ignored = 0
        # Leases whose addresses control connections hold; the last writer's settle drops
        # the hashes taken for the lease.
        self._handed = HandedLeases(receiver, lambda lease_id: self._early.pop(lease_id, None))
        # lease id -> {write index: (layer, positions, (K hash, V hash))}, hashed as each landed
        self._early: dict[str, dict[int, tuple]] = {}
        self._busy_until = 0.0
        self.death: str | None = None
        args = (max_pairs, max_pending, handshake_timeout_s)
        self._open_port(receiver, host, port, token, *args)
        self._poller = threading.Thread(target=self._poll, name="kv-nixl-notifs", daemon=True)
        self._acceptor.start()
        self._poller.start()

    # -- life
    def stop(self) -> None:
        self._close_port()
        with self._cond:  # acks waiting for a verdict: the server is stopping
            self._cond.notify_all()
        self._poller.join(timeout=5)

    def problem(self) -> str | None:
        if self.death is not None:
            return f"nixl notification poller died: {self.death}"
        return self._acceptor.problem()

    # -- one authenticated peer
    def _greet(self, conn: ControlConnection) -> str:
        """The agent's metadata and the cache layout; the peer's agent name, remembered so
        that its notifications are applied."""
        hello = {"agent": self.agent.name, "metadata": self.agent.metadata()}
        conn.send({"protocol": PROTOCOL, **hello, "layout": self.layout})
        name = field(conn.recv(self._handshake_timeout_s), "agent", str)
        with self._cond:
            self._peers[name] = self._peers.get(name, 0) + 1
        return name

    def _peer_gone(self, name: str | None) -> None:
        """A peer that goes away is forgotten: its notifications are ignored from now on."""
        with self._cond:
            if name is not None:
                self._peers[name] -= 1
                if not self._peers[name]:
                    del self._peers[name]

    def _answer(self, conn: ControlConnection, peer: str, message: dict, handed: dict) -> None:
        op = field(message, "op", str)
        if op == "lease":
            conn.send(self._lease_addresses(message, handed))
        elif op == "settle":  # its stream ended without a commit: it writes no more
            self._settle(field(message, "lease", str), handed)
            conn.send({"ok": True})
        elif op == "ack":
            notification = field(message, "notification", int)
            conn.send({"errors": self._wait_verdict(peer, notification)})
            # Its sender waited for every WRITE before the notification, whatever the verdict:
            # one damaged past decoding named no lease to settle, so its ack does.
            if "lease" in message:
                self._settle(field(message, "lease", str), handed)
        else:
            raise ConnectionError(f"unknown nixl control op {op[:32]!r}")

    def _lease_addresses(self, message: dict, handed: dict) -> dict:
        """The K and V addresses of each layer x block of one live lease, and its time left;
        nothing about any other block."""
        self._busy_until = time.monotonic() + BUSY_FOR_S  # WRITEs will come: progress often
        try:
            lease = self._handed.hand(message, handed)
        except FrameError as e:
            return {"ok": False, "error": e.reason}
        ids = np.array(lease.block_ids, dtype=np.uint64) * np.uint64(self.layout["block_bytes"])
        k = self._bases[:, 0:1] + ids[None, :]
        v = self._bases[:, 1:2] + ids[None, :]
        # Blocks the lease holds from the prefix cache (shared, their KV in): no address.
        k[:, : lease.first_block] = 0
        v[:, : lease.first_block] = 0
        return {
            "ok": True,
            "blocks": len(lease.block_ids),
            "first_block": lease.first_block,
            "k": k.astype("<u8").tobytes(),
            "v": v.astype("<u8").tobytes(),
            "seconds_left": max(0.0, lease.deadline - time.monotonic()),
        }

    # -- commits
    def _wait_verdict(self, peer: str, notification: int) -> list[str]:
        key = (peer, notification)
        deadline = time.monotonic() + self._ack_timeout_s
        pause = ACK_POLL_S[0]
        while not self._stopping.is_set():
            self._drain()
            with self._cond:
                if key in self._verdicts:
                    return self._verdicts.pop(key)
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(pause, left))
            pause = min(pause * 2, ACK_POLL_S[1])
        return [f"commit notification did not arrive within {self._ack_timeout_s:g} s"]

    def _poll(self) -> None:
        try:
            while not self._stopping.wait(self._poll_interval()):
                self._drain()
        except Exception as e:  # the commits stop landing: say so (health), do not hide it
            self.death = f"{type(e).__name__}: {e}"
            log.exception("nixl notification poller died")

    def _poll_interval(self) -> float:
        busy = time.monotonic() < self._busy_until
        return BUSY_POLL_INTERVAL_S if busy else POLL_INTERVAL_S

    def _drain(self) -> None:
        if not self._drain_lock.acquire(blocking=False):
            return  # another thread drains now; its verdicts wake this one
        try:
            for agent_name, messages in self.agent.notifications().items():
                for message in messages:
                    self._apply(agent_name, message)
        finally:
            self._drain_lock.release()

    def _apply(self, peer: str, message: bytes) -> None:
        with self._cond:
            known = peer in self._peers
        if not known:
            self.notifications_ignored += 1
            log.warning("nixl notification from agent %.80s, which proved no token: ignored", peer)
            return
        if message[: len(WRITTEN)] == WRITTEN:
            self._hash_written(message)
            return
        try:
            commit = decode_notification(message)
        except FrameError as e:  # a damaged one is a rejected commit frame, counted as one
            with self._receiver.lock:
                self._receiver.frames_rejected += 1
            log.warning("rejected kv commit notification: %s", e.reason)
            commit, errors = None, [e.reason]
        if commit is not None:
            try:
                self._receiver.commit_written(commit, self._verifier(commit))
                errors = []
            except FrameError as e:  # counted and logged there
                errors = [e.reason]
            # Its sender waited for every WRITE before it sent this: it writes no more.
            self._settle(commit.header.lease_id)
        with self._cond:
            self._verdicts[(peer, notification_key(message))] = errors
            while len(self._verdicts) > MAX_VERDICTS:
                self._verdicts.popitem(last=False)
            self._cond.notify_all()

    def _hash_written(self, message: bytes) -> None:
        """Hash the blocks one WRITE just filled (NIXL delivers its notification after its
        bytes), for the commit's check; a notification for a lease no writer holds now, or
        naming blocks outside it, is dropped (the commit then hashes, or refuses, itself)."""
        try:
            w = decode_written(message)
        except FrameError as e:
            log.warning("kv write notification dropped: %s", e.reason)
            return
        if self._rows is None or not 0 <= w.layer < len(self._rows):
            return
        with self._receiver.lock:  # no block of the lease is freed meanwhile
            lease = self._handed.held(w.lease_id)
            n = len(lease.block_ids) if lease is not None else 0
            if lease is None or not all(lease.first_block <= p < n for p in w.positions):
                return
            blocks = [lease.block_ids[p] for p in w.positions]
            hashes = write_hashes(*self._rows[w.layer], blocks)
            self._early.setdefault(w.lease_id, {})[w.index] = (w.layer, w.positions, hashes)

    def _settle(self, lease_id: str, handed: dict | None = None) -> None:
        self._handed.settle(lease_id, handed)

    def _verifier(self, commit):
        """The check of the written bytes against the commit's digest (host caches), with
        the hashes taken as each WRITE landed."""
        early = self._early.pop(commit.header.lease_id, {}) if self._rows is not None else {}
        return digest_check(self._rows, commit, early)
