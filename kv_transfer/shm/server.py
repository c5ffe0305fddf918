"""shm transport, decode side: the worker's KV cache moved into shared memory
(engine.shared_kv_cache); a control port hands each sender that proved the cluster token the
cache file's name and layout once, and per lease only that lease's block ids; commits come over
the same connection and are checked like nixl's (kv_transfer.one_sided): positions inside the
lease, every cell covered, the digest of the bytes in the leased blocks.

Messages (kv_transfer.nixl.control's authenticated msgpack), the sender asking:
``{"op": "lease", "lease", "request"}`` -> ``{"ok", "blocks": [block ids], "first_block",
"seconds_left"}``; ``{"op": "commit", "notification": bytes}`` (kv_transfer.nixl.commit's
encoding) -> ``{"errors": [...]}``, settling the lease for this connection whatever the
verdict; ``{"op": "settle", "lease"}`` (a stream ended without a commit) -> ``{"ok": true}``.
"""

from __future__ import annotations

import logging
import time

from engine.shared_kv_cache import SHM_DIR, SharedKVCache
from kv_transfer.errors import FrameError
from kv_transfer.nixl.commit import block_rows, decode_notification
from kv_transfer.nixl.control import ControlConnection, field
from kv_transfer.one_sided import (
    ControlServer,
    HandedLeases,
    digest_check,
    refuse_open_without_token,
)

log = logging.getLogger("pdserve.kv")

PROTOCOL = "pdserve-shm/1"


class ShmReceiverServer(ControlServer):
    kind = "shm"

    def __init__(
        self,
        receiver,
        host: str,
        port: int,
        token: str | None = None,
        shm_dir: str = SHM_DIR,
        max_pairs: int = 64,
        max_pending: int = 64,
        handshake_timeout_s: float = 5.0,
    ):
        """Moves ``receiver.kv_caches`` into shared memory: start it before the engine runs a
        step (the decode worker's server does), as a step meanwhile would write the old
        memory."""
        refuse_open_without_token("shm", host, token)
        with receiver.lock:
            self.cache = SharedKVCache(receiver.kv_caches, shm_dir)
        self._rows = [(block_rows(k), block_rows(v)) for k, v in receiver.kv_caches]
        self._handed = HandedLeases(receiver)
        try:
            args = (max_pairs, max_pending, handshake_timeout_s)
            self._open_port(receiver, host, port, token, *args)
        except BaseException:
            self.cache.remove()
            raise
        self._acceptor.start()

    def stop(self) -> None:
        """Stop serving and remove the shared-memory file (the worker's tensors stay valid)."""
        self._close_port()
        self.cache.remove()

    def _greet(self, conn: ControlConnection) -> None:
        conn.send({"protocol": PROTOCOL, "path": self.cache.path, "layout": self.cache.layout})

    def _answer(self, conn: ControlConnection, peer, message: dict, handed: dict) -> None:
        op = field(message, "op", str)
        if op == "lease":
            conn.send(self._lease_blocks(message, handed))
        elif op == "commit":
            errors = self._commit(field(message, "notification", bytes))
            # Its sender copied every block before it asked: whatever the verdict (one
            # damaged past decoding names no lease), the lease it holds here is settled.
            if "lease" in message:
                self._handed.settle(field(message, "lease", str), handed)
            conn.send({"errors": errors})
        elif op == "settle":  # its stream ended without a commit: it writes no more
            self._handed.settle(field(message, "lease", str), handed)
            conn.send({"ok": True})
        else:
            raise ConnectionError(f"unknown shm control op {op[:32]!r}")

    def _lease_blocks(self, message: dict, handed: dict) -> dict:
        """The block ids of one live lease and its time left; nothing about any other."""
        try:
            lease = self._handed.hand(message, handed)
        except FrameError as e:
            return {"ok": False, "error": e.reason}
        return {
            "ok": True,
            "blocks": list(lease.block_ids),
            "first_block": lease.first_block,  # before it: cached KV, never written
            "seconds_left": max(0.0, lease.deadline - time.monotonic()),
        }

    def _commit(self, notification: bytes) -> list[str]:
        """Check and apply a commit; the reasons it was refused (none: committed)."""
        try:
            commit = decode_notification(notification)
        except FrameError as e:  # a damaged one is a rejected commit frame, counted as one
            with self._receiver.lock:
                self._receiver.frames_rejected += 1
            log.warning("rejected kv commit: %s", e.reason)
            return [e.reason]
        try:
            self._receiver.commit_written(commit, digest_check(self._rows, commit))
            errors = []
        except FrameError as e:  # counted and logged there
            errors = [e.reason]
        self._handed.settle(commit.header.lease_id)  # its writer copied all: it writes no more
        return errors
