"""The prefill worker's KV senders: one per (transport, endpoint), reused across requests, and
closed once their destination is gone.

A decode worker that dies, drains or is replaced (a new endpoint) leaves its sender behind:
a thread, a link (a gRPC channel, a gloo pair), whatever they hold. The pool closes and drops a
sender whose link is broken (torch_dist marks it so when its peer is gone) once it has no
unfinished stream, and any sender that carried no stream for ``idle_close_s`` (a gRPC channel
never reports a dead peer: it goes idle). A later request to that endpoint gets a fresh sender.

Connecting (a gRPC channel, a torch_dist pairing and gloo rendezvous) happens on a thread of its
own, outside the pool's lock: one slow or dead peer holds up only the Prefills to that endpoint,
each for at most ``connect_timeout_s``; callers asking for one endpoint at once share one connect.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from kv_transfer.sender import KVSender, make_sender
from kv_transfer.transports import TLS_TRANSPORTS, TOKEN_TRANSPORTS

log = logging.getLogger("pdserve.kv")


@dataclass(frozen=True)
class SenderPoolSettings:
    idle_close_s: float = 60.0  # a sender with no stream this long is closed
    # A broken link's sender is closed once unused this long: enough that a sender just
    # handed out is never closed before its caller opens its stream.
    broken_grace_s: float = 1.0
    check_interval_s: float = 5.0  # how often the pool looks for senders to close
    # A connect that takes longer fails the Prefills waiting on it (ConnectionError: the router
    # goes around); the connect itself goes on, and its sender serves the next request.
    connect_timeout_s: float = 30.0


class SenderPool:
    """One KV sender per (transport, endpoint); idle and broken ones are closed."""

    def __init__(self, cluster_token: str | None = None, tls=None, settings=None):
        self.settings = settings or SenderPoolSettings()
        self._senders: dict[tuple[str, str], KVSender] = {}
        self._token = cluster_token
        self._tls = tls  # grpc_plumbing.tls.ClusterTls for gRPC and Flight KV
        self._lock = threading.Lock()
        self._connecting: dict[tuple[str, str], Future] = {}  # one connect per endpoint at once
        self.closed_senders = 0  # evicted as broken or idle (close() not counted)
        self._stopped = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="kv-sender-reaper", daemon=True)
        self._reaper.start()

    def get(self, transport: str, endpoint: str) -> KVSender:
        """The endpoint's sender, connecting one first if needed (outside the lock, within
        ``connect_timeout_s``; ConnectionError past it, or the connect's own error)."""
        key = (transport, endpoint)
        with self._lock:
            sender = self._senders.get(key)
            if sender is not None and not sender.closed:
                sender.touch()
                return sender
            pending = self._connecting.get(key)
            if pending is None:
                pending = self._connecting[key] = Future()
                threading.Thread(
                    target=self._connect_into,
                    args=(key, pending),
                    name=f"kv-connect {endpoint}",
                    daemon=True,
                ).start()
        timeout = self.settings.connect_timeout_s
        try:
            sender = pending.result(timeout)
        except TimeoutError:
            raise ConnectionError(
                f"connecting a {transport} kv sender to {endpoint} took over {timeout:g} s"
            ) from None
        sender.touch()
        return sender

    def _connect_into(self, key: tuple[str, str], pending: Future) -> None:
        """The connect thread: make the sender, publish it, wake everyone waiting on it."""
        try:
            sender = self._connect(*key)
        except BaseException as e:  # noqa: BLE001 - the waiters get it
            with self._lock:
                self._connecting.pop(key, None)
            pending.set_exception(e)
            return
        with self._lock:
            self._connecting.pop(key, None)
            stopped = self._stopped.is_set()
            if not stopped:
                self._senders[key] = sender
        if stopped:  # the pool closed while it connected
            _close_quietly(sender)
            pending.set_exception(ConnectionError(f"kv sender pool closed ({key[1]})"))
            return
        pending.set_result(sender)

    def endpoints(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self._senders)

    def close_unused(self, now: float | None = None) -> list[KVSender]:
        """Close and drop senders whose link broke or that sat idle past the bound."""
        s = self.settings
        now = time.monotonic() if now is None else now
        with self._lock:
            unused = {
                key: sender
                for key, sender in self._senders.items()
                if (idle := sender.idle_s(now)) > s.idle_close_s
                or (sender.link_broken and idle > s.broken_grace_s)
            }
            for key in unused:
                del self._senders[key]
            self.closed_senders += len(unused)
        for (transport, endpoint), sender in unused.items():  # a close may wait on a dead peer
            log.info("closing the %s kv sender to %s (broken or idle)", transport, endpoint)
            _close_quietly(sender)
        return list(unused.values())

    def close(self) -> None:
        self._stopped.set()
        with self._lock:
            senders = list(self._senders.values())
            self._senders.clear()
        for sender in senders:
            sender.close()

    def _connect(self, transport: str, endpoint: str) -> KVSender:
        # Every socket transport carries the cluster token (torch_dist at its rendezvous).
        use_token = self._token and transport in TOKEN_TRANSPORTS
        opts = {"token": self._token} if use_token else {}
        if self._tls is not None and transport in TLS_TRANSPORTS:
            opts["tls"] = self._tls
        return make_sender(transport, endpoint, **opts)

    def _reap(self) -> None:
        while not self._stopped.wait(self.settings.check_interval_s):
            self.close_unused()


def _close_quietly(sender: KVSender) -> None:
    try:
        sender.close()
    # Its peer is gone or its link broke: there is nobody to say goodbye to.
    except Exception as e:  # noqa: BLE001
        log.info("closing a kv sender to %s: %s: %s", sender.endpoint, type(e).__name__, e)
