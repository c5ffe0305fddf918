"""torch_dist transport, sender side: a link is one pair group to one receiver, over one
authenticated pairing connection (the protocol and its security: kv_transfer.torch_dist.pair)."""

from __future__ import annotations

import itertools
import logging
import socket
import threading

import torch

from kv_transfer.interfaces import Channel, Link, ReceiverServer
from kv_transfer.torch_dist.handshake import pair_as_sender
from kv_transfer.torch_dist.pair import (
    OP_ABORT,
    OP_CLOSE,
    OP_COMMIT,
    OP_FRAME,
    OP_PING,
    TAG_ACK,
    TAG_DATA,
    Pair,
    as_tensor,
    make_pair_group,
)
from kv_transfer.torch_dist.pairstore import PairStore
from kv_transfer.torch_dist.receiver import DistReceiverServer

log = logging.getLogger("pdserve.kv")


class _DistChannel(Channel):
    def __init__(self, link: _DistLink, tag: int):
        self._link, self._tag = link, tag
        self._errors: list[str] | None = None

    def push(self, header, payload) -> None:
        self._link.send_message(OP_FRAME, self._tag, header, payload)

    def push_commit(self, header, payload) -> None:
        self._errors = self._link.commit(self._tag, header)

    def wait_ack(self, timeout: float) -> list[str]:
        return list(self._errors or [])  # push_commit already waited for the ack

    def cancel(self) -> None:
        if self._errors is None and not self._link.broken:
            self._link.abort_stream(self._tag)


class _DistLink(Link):
    def __init__(
        self,
        endpoint: str,
        timeout_s: float = 60.0,
        bind_host: str | None = None,
        token: str | None = None,
        connect_timeout_s: float = 5.0,
    ):
        host, _, port = endpoint.rpartition(":")
        host = host.strip("[]")
        # A peer that is gone fails here at once (connection refused); that is what a sender
        # reconnecting a broken link meets first. The pairing connection stays open, idle, as
        # a watch on the receiver's pair (_check_peer).
        sock = socket.create_connection((host, int(port)), timeout=connect_timeout_s)
        try:
            group, device = self._join(sock, host, timeout_s, bind_host, token)
        except BaseException:
            sock.close()
            raise
        self._pair = Pair(group, peer=1, device=device)
        self._tags = itertools.count()
        self._lock = threading.Lock()
        self.broken = False

    def _join(self, sock, host, timeout_s, bind_host, token):
        """Prove the token to each other (every read bounded by the connect timeout), then
        build the pair group over the authenticated connection (kv_transfer.torch_dist.pair)."""
        key = pair_as_sender(sock, token)
        self._store = PairStore(sock, key, rank=0, timeout_s=timeout_s)
        self._store.set_timeout(sock.gettimeout())  # the receiver's params come at once
        params = self._store.read_params()
        self._store.set_timeout(timeout_s)
        backend = params.get("backend")
        if backend not in ("gloo", "nccl"):
            raise ConnectionError(f"torch_dist receiver named backend {backend!r}")
        self.idle_interval_s = int(params["idle_timeout_ms"]) / 4000
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        group = make_pair_group(backend, self._store, 0, timeout_s, bind_host or _local_ip(host))
        return group, device or torch.device("cpu")

    def open_channel(self, request_id: str, lease_id: str) -> Channel:
        if self.broken:
            raise ConnectionError("torch_dist pair is broken; make a new sender")
        self._check_peer()
        return _DistChannel(self, next(self._tags))

    def _check_peer(self) -> None:
        """Whether the receiver's pair is still there, without a round trip: the idle pairing
        connection reads end-of-file (or a reset) once its process is gone or it dropped the
        pair. A receiver killed while this link sat idle is not always noticed by gloo: the
        next send can wait out the pair's whole timeout on the dead peer (seen under load). A
        receiver that hangs instead keeps the connection open; its streams fail at their
        commit's timeout. (Not a request: one to a hung receiver would block without a bound.)"""
        if self._store.peer_closed():
            self.broken = True
            raise ConnectionError("torch_dist receiver is gone: its pairing connection closed")

    def abort_stream(self, tag: int) -> None:
        """Tell the receiver to drop stream ``tag``. A commit that timed out calls this while
        the sender thread may still be inside a gloo op under the lock, for as long as the
        pair's timeout; waiting for it would stretch the commit's own timeout to that. A pair
        with an op stuck that long is not trusted again: it is marked broken instead, and the
        receiver's lease expires."""
        if not self._lock.acquire(blocking=False):
            self.broken = True
            return
        try:
            self._send_locked(OP_ABORT, tag, b"", b"")
        finally:
            self._lock.release()

    def send_message(self, op: int, tag: int, header, payload) -> None:
        with self._lock:
            self._send_locked(op, tag, header, payload)

    def _send_locked(self, op: int, tag: int, header, payload) -> None:
        try:
            self._pair.send_ints([op, tag, len(header), len(payload)], TAG_DATA)
            if len(header):
                self._pair.send(as_tensor(header, self._pair.device), TAG_DATA)
            if len(payload):
                self._pair.send(as_tensor(payload, self._pair.device), TAG_DATA)
        except Exception:
            self.broken = True  # a half-sent message desynchronizes the pair for good
            raise

    def commit(self, tag: int, header) -> list[str]:
        with self._lock:
            self._send_locked(OP_COMMIT, tag, header, b"")
            try:
                ack = self._pair.recv(4, torch.int64, TAG_ACK).tolist()
                reasons = self._pair.recv(ack[3], torch.uint8, TAG_ACK) if ack[3] else None
            except Exception:
                self.broken = True
                raise
        if ack[0] != tag:
            self.broken = True
            raise ConnectionError(f"ack for stream {ack[0]}, expected {tag}")
        errors = reasons.numpy().tobytes().decode(errors="replace").split("\n") if ack[3] else []
        if ack[2] and not errors:
            errors = [f"{ack[2]} frames rejected"]
        return errors

    def on_idle(self) -> None:
        if not self.broken:
            self.send_message(OP_PING, -1, b"", b"")

    def close(self) -> None:
        if not self.broken:
            try:
                self.send_message(OP_CLOSE, -1, b"", b"")
            # The receiver may be gone already; there is nobody left to tell.
            except Exception as e:  # noqa: BLE001
                log.info("torch_dist close: %s", e)
        self.broken = True
        self._pair = None
        self._store.sock.close()


def _local_ip(remote_host: str) -> str:
    """The local address that routes to the receiver, for gloo to bind (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((remote_host, 9))
        return s.getsockname()[0]


def connect(endpoint: str, **opts) -> Link:
    return _DistLink(endpoint, **opts)


def serve(receiver, host: str, port: int, **opts) -> ReceiverServer:
    return DistReceiverServer(receiver, host, port, **opts)
