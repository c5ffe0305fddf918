"""The torch_dist receiver's pairing port: one thread runs every unauthenticated connection's
handshake (kv_transfer.torch_dist.handshake) with a selector, so a client that has not proved
the token costs a socket, never a thread.

Limits. Each connection must finish its handshake within ``handshake_timeout_s`` of its
accept or it is closed; at most ``max_pending`` handshakes run at once, and past that a new
connection closes the oldest (a flood of silent connections ages out, a real sender finishes
in milliseconds). At most ``max_pairs`` authenticated pairs live at once; a sender past that
hears BUSY and is closed. Only a sender that proved the token gets a slot, and only then is
``on_pair`` called (the server starts the pair's thread there).

Guard. Whatever one connection does (garbage, a reset, an error in the code it reaches) closes
that connection and nothing else. Should the loop itself die, ``problem()`` says why and the
server reports unhealthy.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

from kv_transfer.torch_dist.handshake import (
    BUSY,
    HELLO_LEN,
    OK,
    PROOF_LEN,
    REFUSED,
    challenge,
    check_sender,
    pair_key,
    parse_hello,
)

log = logging.getLogger("pdserve.kv")

POLL_S = 0.1  # the longest the loop sleeps (it looks at stop and deadlines this often)
ACCEPT_BURST = 64  # connections accepted per wake-up before the others get a turn
ACCEPT_BACKOFF_S = 0.05  # after accept fails (out of file descriptors): breathe, retry


class _Pending:
    """A connection in its handshake: what it sent so far, what comes next."""

    __slots__ = ("buf", "deadline", "n_r", "n_s", "need", "sock")

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline = sock, deadline
        self.buf = bytearray()
        self.need = HELLO_LEN
        self.n_s = self.n_r = None


def _send_now(sock: socket.socket, data: bytes) -> None:
    """A short message to a non-blocking socket: all of it now, or the peer is not reading."""
    if sock.send(data) != len(data):
        raise ConnectionError("pairing peer is not reading")


class PairAcceptor:
    """Takes pairing connections on ``listen`` (bound, listening) and hands each one that
    proves ``token`` to ``on_pair(sock, pair_key, n)`` with a pair slot taken; the pair's
    owner gives the slot back with ``release``."""

    def __init__(
        self,
        listen: socket.socket,
        token: str | None,
        on_pair: Callable[[socket.socket, bytes, int], None],
        max_pairs: int,
        max_pending: int,
        handshake_timeout_s: float,
    ):
        if max_pairs < 1 or max_pending < 1 or handshake_timeout_s <= 0:
            raise ValueError("max_pairs, max_pending and handshake_timeout_s must be positive")
        self._listen, self._token, self._on_pair = listen, token, on_pair
        self.max_pairs, self.max_pending = max_pairs, max_pending
        self.handshake_timeout_s = handshake_timeout_s
        listen.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(listen, selectors.EVENT_READ, None)
        self._pending: dict[socket.socket, _Pending] = {}  # oldest first
        self._active = 0
        self._pairs_made = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.death: str | None = None
        self._thread = threading.Thread(target=self._run, name="kv-pairs", daemon=True)

    # -- life
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.ident is not None:
            self._thread.join()
        self._listen.close()

    def problem(self) -> str | None:
        """Why the pairing port takes no pairs (None: it does)."""
        if self.death is not None:
            return f"torch_dist pair acceptor died: {self.death}"
        started = self._thread.ident is not None
        if started and not self._thread.is_alive() and not self._stopping.is_set():
            return "torch_dist pair acceptor is not running"
        return None

    @property
    def active_pairs(self) -> int:
        return self._active

    @property
    def pending(self) -> int:
        return len(self._pending)

    def release(self) -> None:
        """A pair ended: its slot is free again."""
        with self._lock:
            self._active -= 1

    # -- the loop
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._tick()
        except Exception as e:  # the port is dead: say so (problem, health), do not hide it
            self.death = f"{type(e).__name__}: {e}"
            log.exception("torch_dist pair acceptor died")
        finally:
            for sock in list(self._pending):
                self._drop(sock)
            self._sel.close()

    def _tick(self) -> None:
        wait = POLL_S
        if self._pending:
            oldest = next(iter(self._pending.values()))
            wait = min(wait, max(0.0, oldest.deadline - time.monotonic()))
        for key, _events in self._sel.select(wait):
            if key.data is None:
                self._accept_all()
            elif key.fileobj in self._pending:
                self._guarded(key.data)
        self._expire(time.monotonic())

    def _accept_all(self) -> None:
        for _ in range(ACCEPT_BURST):
            try:
                sock, _addr = self._listen.accept()
            except BlockingIOError:
                return
            except OSError as e:  # out of descriptors, a reset before accept: not fatal
                log.warning("torch_dist pairing accept failed: %s", e)
                self._stopping.wait(ACCEPT_BACKOFF_S)
                return
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        if len(self._pending) >= self.max_pending:
            self._drop(next(iter(self._pending)))  # the oldest handshake makes room
        sock.setblocking(False)
        pending = _Pending(sock, time.monotonic() + self.handshake_timeout_s)
        self._pending[sock] = pending
        self._sel.register(sock, selectors.EVENT_READ, pending)

    def _expire(self, now: float) -> None:
        while self._pending:
            sock, oldest = next(iter(self._pending.items()))
            if oldest.deadline > now:
                return
            self._drop(sock)

    def _forget(self, sock: socket.socket) -> None:
        if self._pending.pop(sock, None) is not None:
            self._sel.unregister(sock)

    def _drop(self, sock: socket.socket) -> None:
        self._forget(sock)
        sock.close()

    def _guarded(self, pending: _Pending) -> None:
        """One step of one connection's handshake; any error closes that connection only."""
        try:
            self._advance(pending)
        except Exception as e:  # noqa: BLE001 -- garbage, resets, bugs: this client only
            log.info("torch_dist pairing connection dropped: %s: %s", type(e).__name__, e)
            self._drop(pending.sock)

    def _advance(self, p: _Pending) -> None:
        data = p.sock.recv(p.need - len(p.buf))
        if not data:
            raise ConnectionError("closed before pairing")
        p.buf += data
        if len(p.buf) < p.need:
            return
        if p.n_s is None:
            p.n_s = parse_hello(bytes(p.buf))
            message, p.n_r = challenge(self._token, p.n_s)
            _send_now(p.sock, message)
            p.buf, p.need = bytearray(), PROOF_LEN
        else:
            self._forget(p.sock)
            self._conclude(p, bytes(p.buf))

    def _conclude(self, p: _Pending, proof: bytes) -> None:
        """The sender's proof is in: refuse it, turn it away (full), or pair it."""
        sock = p.sock
        try:
            if not check_sender(self._token, p.n_s, p.n_r, proof):
                log.warning("torch_dist pair refused: missing or bad cluster token")
                _send_now(sock, REFUSED)
            elif not self._take_slot():
                log.warning("torch_dist pair refused: %d pairs open (max)", self.max_pairs)
                _send_now(sock, BUSY)
            else:
                self._hand_over(sock, pair_key(self._token, p.n_s, p.n_r))
                return
        except Exception as e:  # noqa: BLE001 -- the close below is all this client gets
            log.info("torch_dist pairing ended: %s: %s", type(e).__name__, e)
        sock.close()

    def _take_slot(self) -> bool:
        with self._lock:
            if self._active >= self.max_pairs:
                return False
            self._active += 1
            return True

    def _hand_over(self, sock: socket.socket, key: bytes) -> None:
        try:
            _send_now(sock, OK)
            self._pairs_made += 1
            self._on_pair(sock, key, self._pairs_made)
        except BaseException:
            self.release()
            sock.close()
            raise
