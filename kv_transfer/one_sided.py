"""What the receivers of one-sided writes share (nixl: NIXL WRITEs; shm: copies into a shared
memory cache): a sender that proved the cluster token is handed one live lease's blocks, writes
into them itself, and commits with the cells it wrote and a digest of their bytes
(kv_transfer.nixl.commit); the receiver checks that digest against its leased blocks.

- ``refuse_open_without_token``: neither serves off loopback without the cluster token.
- ``HandedLeases``: which control connections hold which leases' blocks. A write cannot be
  refused once posted, so a lease counts its writers (Lease.remote_writers) from hand-out
  until each settles (its commit came, its stream ended, its connection closed); the decode
  worker parks a released lease's blocks until then.
- ``digest_check``: the commit's check of the leased blocks' bytes against its digest.
- ``ControlServer`` / ``ControlLink``: the two ends of the control port (kv_transfer.nixl.
  control's authenticated connection after the torch_dist handshake): one thread per peer
  that greets it and answers its requests until it leaves, settling what it held; a link
  that asks one request at a time and notices a receiver that went away.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

from grpc_plumbing.auth import OpenBindError, is_loopback
from kv_transfer.errors import FrameError, ReceiverFault
from kv_transfer.interfaces import Channel, Link, ReceiverServer
from kv_transfer.lease import Lease
from kv_transfer.nixl.commit import NO_DIGEST, digest, final_positions, write_hashes
from kv_transfer.nixl.control import ControlConnection, field
from kv_transfer.torch_dist.acceptor import PairAcceptor
from kv_transfer.torch_dist.handshake import pair_as_sender
from kv_transfer.torch_dist.receiver import _listen

log = logging.getLogger("pdserve.kv")


class LeaseRefused(Exception):
    """The receiver refused to name the lease's blocks (unknown, expired, someone else's)."""


def refuse_open_without_token(transport: str, host: str, token: str | None) -> None:
    """Off loopback only with the cluster token: the control port hands out where the cache
    is (its blocks' addresses, or its shared memory), which only cluster members may learn."""
    if token is None and not is_loopback(host):
        raise OpenBindError(f"refusing to serve {transport} KV on {host} without a cluster token")


class HandedLeases:
    """Leases whose blocks were handed to writers, per control connection. A connection keeps
    ``handed`` (lease id -> Lease, the ones it holds); every method that changes a lease's
    writers takes the receiver's lock, under which the worker frees blocks."""

    def __init__(self, receiver, on_none_left: Callable[[str], None] | None = None):
        self._receiver = receiver
        # lease id -> the handed maps of the connections holding it (a sender that reconnected
        # after a break may hold it on two until the old connection ends)
        self._holders: dict[str, list[dict]] = {}
        self._on_none_left = on_none_left  # called under the lock when its last writer settles

    def hand(self, message: dict, handed: dict) -> Lease:
        """The live lease ``message`` names (``lease``, ``request``), now counted as written by
        the connection of ``handed``; FrameError when it is unknown, expired, another
        request's, committed or refused."""
        lease_id, request_id = field(message, "lease", str), field(message, "request", str)
        leases = self._receiver.leases
        leases.wait_for(lease_id, self._receiver.pending_lease_wait_s)
        lease = leases.get(lease_id)
        if lease.request_id != request_id:
            raise FrameError(f"lease {lease_id[:64]} belongs to another request")
        if lease.is_committed or lease.commit_refused is not None:
            raise FrameError(f"lease {lease_id[:64]} is committed or refused")
        with self._receiver.lock:  # the worker frees blocks under it: no release in between
            if lease.lease_id not in handed:
                lease.remote_writers += 1
                handed[lease.lease_id] = lease
                self._holders.setdefault(lease.lease_id, []).append(handed)
        return lease

    def held(self, lease_id: str) -> Lease | None:
        """The lease if a writer holds it now; call under the receiver's lock."""
        holders = self._holders.get(lease_id)
        return holders[0].get(lease_id) if holders else None

    def settle(self, lease_id: str, handed: dict | None = None) -> None:
        """The writer of ``lease_id`` on the connection of ``handed`` is done (None: every
        writer, its commit came): its blocks may be reused once none is left."""
        with self._receiver.lock:
            holders = self._holders.get(lease_id, [])
            for holder in [h for h in holders if handed is None or h is handed]:
                holders.remove(holder)
                lease = holder.pop(lease_id, None)
                if lease is not None:
                    lease.remote_writers -= 1
            if not holders:
                self._holders.pop(lease_id, None)
                if self._on_none_left is not None:
                    self._on_none_left(lease_id)

    def settle_all(self, handed: dict) -> None:
        """The connection of ``handed`` is gone: it writes no more."""
        for lease_id in list(handed):
            self.settle(lease_id, handed)


def digest_check(rows, commit, early: dict | None = None) -> Callable[[Lease], str | None] | None:
    """The check of a commit's written bytes against its digest, for
    KVReceiver.commit_written (None where the cache is not on the host: ``rows`` None).
    ``rows``: per layer, the K and V caches as [blocks, bytes] arrays (commit.block_rows);
    ``early``: {write index: (layer, positions, (K hash, V hash))} of writes hashed as they
    landed."""
    if rows is None:
        return None
    if commit.digest == NO_DIGEST:
        return lambda lease: "commit notification carries no digest of its KV"
    early = early or {}

    def check(lease) -> str | None:
        # A write's hash covers its positions no later write of its layer rewrites. One hashed
        # as it landed is reused when no later write rewrote any of its positions: nothing
        # but that write put those bytes there, and a sender writes a layer again only once
        # its previous write of it completed, so they are the final bytes. Any other write
        # (rewritten in part, or not hashed as it landed) is hashed now.
        hashes = []
        finals = final_positions(commit.writes)
        for index, ((layer, positions), final) in enumerate(zip(commit.writes, finals)):
            hashed = early.get(index)
            whole = tuple(positions)
            if hashed is not None and hashed[:2] == (layer, whole) and final == whole:
                hashes.append(hashed[2])
            else:
                blocks = [lease.block_ids[p] for p in final]
                hashes.append(write_hashes(rows[layer][0], rows[layer][1], blocks))
        if digest(hashes) != commit.digest:
            return "KV in the leased blocks does not match the commit's digest"
        return None

    return check


class ControlServer(ReceiverServer):
    """The receiving end: ``_open_port`` listens (the caller starts ``_acceptor``), each
    authenticated peer gets a thread that ``_greet``s it and passes its requests to
    ``_answer`` until it leaves; then ``_peer_gone`` and its leases settle."""

    kind = "one-sided"  # the transport's name, in logs and thread names

    def _open_port(
        self, receiver, host: str, port: int, token, max_pairs, max_pending, handshake_timeout_s
    ) -> None:
        """Listen on ``host``:``port`` (PairAcceptor's limits); the caller starts
        ``_acceptor`` once it is ready for peers."""
        self._receiver = receiver
        self._handshake_timeout_s = handshake_timeout_s
        self._socks: set[socket.socket] = set()
        self._socks_lock = threading.Lock()
        self._stopping = threading.Event()
        sock = _listen(host, port)
        real_port = sock.getsockname()[1]
        self.endpoint = f"[{host}]:{real_port}" if ":" in host else f"{host}:{real_port}"
        self._acceptor = PairAcceptor(
            sock, token, self._start_peer, max_pairs, max_pending, handshake_timeout_s
        )

    def _close_port(self) -> None:
        """Stop accepting and end every peer's connection (their threads settle them)."""
        self._stopping.set()
        self._acceptor.stop()
        with self._socks_lock:
            socks = list(self._socks)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by its thread

    def problem(self) -> str | None:
        return self._acceptor.problem()

    def _greet(self, conn: ControlConnection):
        """Say what the peer needs first; what names the peer from then on."""
        raise NotImplementedError

    def _answer(self, conn: ControlConnection, peer, message: dict, handed: dict) -> None:
        raise NotImplementedError

    def _peer_gone(self, peer) -> None:
        """The peer's connection ended (``peer`` None: before its greeting was done)."""

    def _start_peer(self, sock: socket.socket, key: bytes, number: int) -> None:
        sock.setblocking(True)
        with self._socks_lock:
            self._socks.add(sock)
        name = f"kv-{self.kind}-peer {number}"
        threading.Thread(target=self._serve_peer, args=(sock, key), name=name, daemon=True).start()

    def _serve_peer(self, sock: socket.socket, key: bytes) -> None:
        conn, peer = ControlConnection(sock, key, side=1), None
        handed: dict[str, Lease] = {}  # leases whose blocks this peer got, not settled
        try:
            peer = self._greet(conn)
            sock.settimeout(None)  # an idle link waits for its next stream
            while not self._stopping.is_set():
                self._answer(conn, peer, conn.recv(), handed)
        except (OSError, ConnectionError) as e:
            log.info("%s control connection ended: %s: %s", self.kind, type(e).__name__, e)
        except Exception:  # a bug answering one peer ends that peer only
            log.exception("%s control connection failed", self.kind)
        finally:
            self._peer_gone(peer)
            with self._socks_lock:
                self._socks.discard(sock)
            self._acceptor.release()
            sock.close()
            self._handed.settle_all(handed)  # its link is gone: it writes no more


class ControlLink(Link):
    """The sending end: ``_connect`` proves the token (the receiver first), reads the
    receiver's greeting and hands it to ``_greeted``; ``request`` asks one thing at a time."""

    kind = "one-sided"
    protocol = ""

    def __init__(
        self,
        endpoint: str,
        token: str | None = None,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 5.0,
    ):
        self._connect(endpoint, token, timeout_s, connect_timeout_s)

    def _connect(self, endpoint: str, token, timeout_s: float, connect_timeout_s: float) -> None:
        host, _, port = endpoint.rpartition(":")
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=connect_timeout_s)
        try:
            self._conn = ControlConnection(sock, pair_as_sender(sock, token), side=0)
            hello = self._conn.recv(connect_timeout_s)
            if hello.get("protocol") != self.protocol:
                raise ConnectionError(f"{endpoint} does not speak {self.protocol}")
            self._greeted(hello)  # only now: the receiver proved the token in pair_as_sender
        except BaseException:
            sock.close()
            raise
        self._timeout_s = timeout_s
        self._lock = threading.Lock()  # one control request at a time
        self._closed = False
        self.broken = False

    def _greeted(self, hello: dict) -> None:
        raise NotImplementedError

    def lease(self, request_id: str, lease_id: str) -> dict:
        """The receiver's answer naming where ``lease_id``'s blocks are; LeaseRefused if it
        will not name them (unknown, expired, another request's)."""
        reply = self.request({"op": "lease", "lease": lease_id, "request": request_id})
        if not reply.get("ok"):
            raise LeaseRefused(str(reply.get("error", "lease refused"))[:512])
        return reply

    def _new_channel(self, request_id: str, lease_id: str) -> Channel:
        raise NotImplementedError

    def _while_waiting(self) -> None:
        """Until the receiver's answer is readable (``request(progress=True)``)."""

    def _forget(self) -> None:
        """Drop what the greeting set up (the link is closing)."""

    @property
    def closed(self) -> bool:
        return self._closed

    def request(self, message: dict, progress: bool = False) -> dict:
        """Ask the receiver and wait for its answer; ``progress``: ``_while_waiting`` first."""
        with self._lock:
            try:
                if self._closed:
                    raise ConnectionError(f"{self.kind} link was closed here (replaced)")
                self._conn.send(message)
                if progress:
                    self._while_waiting()
                return self._conn.recv(self._timeout_s)
            except (OSError, ValueError) as e:  # ValueError: select on a socket closed here
                self.broken = True
                if self._closed:  # this side closed it: the receiver did nothing wrong
                    raise ConnectionError(f"{self.kind} link was closed here: {e}") from e
                raise ReceiverFault(f"{self.kind} control connection failed: {e}") from e

    def open_channel(self, request_id: str, lease_id: str) -> Channel:
        if self.broken:
            raise ConnectionError(f"{self.kind} link is broken; make a new sender")
        if self._lock.acquire(blocking=False):  # busy: in use, so not closed
            try:
                gone = self._conn.peer_closed()
            finally:
                self._lock.release()
            if gone:
                self.broken = True
                raise ReceiverFault(f"{self.kind} receiver is gone: its control connection closed")
        return self._new_channel(request_id, lease_id)

    def close(self) -> None:
        """Close the control connection and drop what the greeting set up."""
        if self._closed:
            return
        self._closed = self.broken = True
        try:
            self._forget()
        # What it set up may be unusable already; the link is gone either way.
        except Exception as e:  # noqa: BLE001
            log.info("%s: closing a link: %s: %s", self.kind, type(e).__name__, e)
        self._conn.close()
