"""torch.distributed transport: point-to-point send/recv over a 2-rank group per sender.

Pairs form dynamically, so there is no global ``init_process_group``. The receiver hosts a
TCPStore at host:port as the rendezvous; each new sender takes a pair number with
``store.add("pairs", 1)`` and both sides build ``ProcessGroupGloo(PrefixStore("pair/<n>"),
rank, 2)`` directly (sender rank 0, receiver rank 1), bound to the given host. The backend
follows the cache device ("nccl" for CUDA, else "gloo"); the receiver publishes it in the store.

Messages (all tensors, no pickle) from sender to receiver, in order on tag 0:
    int64 [op, stream_tag, header_len, payload_len], then uint8 header, then uint8 payload.
After a COMMIT the receiver answers on tag 1 with int64 [stream_tag, accepted, rejected,
reasons_len] and, if reasons_len > 0, the utf-8 reasons joined by newlines as uint8.

A gloo recv that times out closes the pair, so an idle sender sends PING every
idle_timeout/4 and the receiver drops a pair silent for idle_timeout (a dead sender).
Only the sender thread talks on a pair, so each message is sent whole under one lock.

Security. With a cluster token the rendezvous is authenticated: for pair n the receiver
writes a random nonce under ``pair/<n>/nonce``, the sender answers HMAC-SHA256(token, nonce)
under ``pair/<n>/proof``, and the receiver builds the pair's group only for a right answer
(``pair/<n>/verdict``), so a sender without the token never gets a pair. The store, gloo and
NCCL themselves carry no authentication or encryption, though: anyone on the network can
reach the store's port. So the receiver refuses to listen off loopback unless the operator
declares the network private (``private_network=True``, config ``kv_private_network``).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import itertools
import logging
import secrets
import socket
import threading

import torch
import torch.distributed as dist

from grpc_plumbing.auth import OpenBindError, is_loopback
from kv_transfer.errors import FrameError
from kv_transfer.frame import MAX_FRAME_BYTES, MAX_HEADER_BYTES
from kv_transfer.sender import Channel, Link, ReceiverServer

log = logging.getLogger("pdserve.kv")

OP_FRAME, OP_COMMIT, OP_ABORT, OP_PING, OP_CLOSE = 1, 2, 3, 4, 5
TAG_DATA, TAG_ACK = 0, 1
MAX_REASON_BYTES = 16 * 1024
POLL_S = 0.05  # how often the receiver looks for new pairs


VERDICT_OK, VERDICT_REFUSED = b"ok", b"refused"


def _proof(token: str, nonce: bytes) -> bytes:
    return hmac.new(token.encode(), nonce, hashlib.sha256).hexdigest().encode()


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def make_pair_group(backend: str, store, rank: int, timeout_s: float, host: str):
    """A 2-rank process group on ``store`` (already prefixed for the pair)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        opts._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, 2, opts)
    # NCCL: untested here (no GPU in CI); a CUDA cache needs the tensors below on its device.
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, 2, opts)


def _as_tensor(data, device: torch.device) -> torch.Tensor:
    # bytearray: torch.frombuffer wants a writable buffer; headers are small, payloads
    # arrive as writable views of the gathered tensor and are not copied.
    buf = data if isinstance(data, memoryview) and not data.readonly else bytearray(data)
    return torch.frombuffer(buf, dtype=torch.uint8).to(device)


class _Pair:
    """One end of a pair group; sends and receives whole messages."""

    def __init__(self, group, peer: int, device: torch.device):
        self.group, self.peer, self.device = group, peer, device

    def send(self, t: torch.Tensor, tag: int) -> None:
        self.group.send([t], self.peer, tag).wait()

    def recv(self, n: int, dtype: torch.dtype, tag: int) -> torch.Tensor:
        t = torch.empty(n, dtype=dtype, device=self.device)
        self.group.recv([t], self.peer, tag).wait()
        return t.cpu()

    def send_ints(self, values, tag: int) -> None:
        self.send(torch.tensor(values, dtype=torch.int64, device=self.device), tag)


# ------------------------------- sender side -------------------------------


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
        # A peer that is gone fails here at once (connection refused), not after TCPStore's
        # connect retries; that is what a sender reconnecting a broken link meets first. The
        # connection stays open, idle, as a watch on the receiver's process (_check_peer).
        self._watch = socket.create_connection((host, int(port)), timeout=connect_timeout_s)
        self._watch.setblocking(False)
        try:
            group, device = self._join(host, int(port), timeout_s, bind_host, token,
                                       connect_timeout_s)  # fmt: skip
        except BaseException:
            self._watch.close()
            raise
        self._pair = _Pair(group, peer=1, device=device)
        self._tags = itertools.count()
        self._lock = threading.Lock()
        self.broken = False

    def _join(self, host, port, timeout_s, bind_host, token, connect_timeout_s):
        """Take a pair number from the receiver's store, prove the token, build the group."""
        connect = datetime.timedelta(seconds=connect_timeout_s)
        self._store = dist.TCPStore(host, port, is_master=False, timeout=connect)
        self._store.set_timeout(datetime.timedelta(seconds=timeout_s))
        backend = self._store.get("backend").decode()
        self.idle_interval_s = int(self._store.get("idle_timeout_ms").decode()) / 4000
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        n = self._store.add("pairs", 1)
        prefixed = dist.PrefixStore(f"pair/{n}", self._store)
        _answer_challenge(prefixed, token)
        group = make_pair_group(backend, prefixed, 0, timeout_s, bind_host or _local_ip(host))
        return group, device or torch.device("cpu")

    def open_channel(self, request_id: str, lease_id: str) -> Channel:
        if self.broken:
            raise ConnectionError("torch_dist pair is broken; make a new sender")
        self._check_peer()
        return _DistChannel(self, next(self._tags))

    def _check_peer(self) -> None:
        """Whether the receiver's process is still there, without a round trip: the idle watch
        connection to its store reads end-of-file (or a reset) once the process is gone. A
        receiver killed while this link sat idle is not always noticed by gloo: the next send
        can wait out the pair's whole timeout on the dead peer (seen under load). A receiver
        that hangs instead keeps the connection open; its streams fail at their commit's
        timeout. (Not a store request: one to a hung receiver would block without a bound.)"""
        try:
            alive = self._watch.recv(1, socket.MSG_PEEK) != b""
        except BlockingIOError:
            return  # nothing to read: the connection is open
        except OSError:
            alive = False
        if not alive:
            self.broken = True
            raise ConnectionError("torch_dist receiver is gone: its store connection closed")

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
                self._pair.send(_as_tensor(header, self._pair.device), TAG_DATA)
            if len(payload):
                self._pair.send(_as_tensor(payload, self._pair.device), TAG_DATA)
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
        self._watch.close()


def _answer_challenge(store, token: str | None) -> None:
    """Prove the cluster token for this pair (the nonce's key blocks until the receiver wrote
    it); ConnectionError when the receiver refuses the pair."""
    nonce = store.get("nonce")
    store.set("proof", _proof(token, nonce) if token else b"")
    if store.get("verdict") != VERDICT_OK:
        raise ConnectionError("torch_dist receiver refused the pair: missing or bad cluster token")


def _local_ip(remote_host: str) -> str:
    """The local address that routes to the receiver, for gloo to bind (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((remote_host, 9))
        return s.getsockname()[0]


def connect(endpoint: str, **opts) -> Link:
    return _DistLink(endpoint, **opts)


# ------------------------------ receiver side ------------------------------


class _StreamTally:
    """What one sender stream got accepted/rejected, reported in its commit ack."""

    def __init__(self):
        self.accepted = 0
        self.rejected = 0
        self.reasons: list[str] = []


def _listen(host: str, port: int) -> socket.socket:
    # TCPStore alone listens on every interface; a socket we bind keeps it on ``host``.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def _check_exposure(host: str, private_network: bool) -> None:
    if not private_network and not is_loopback(host):
        raise OpenBindError(
            f"refusing to serve torch_dist KV on {host}: its store, gloo and NCCL traffic is "
            "neither authenticated nor encrypted past the rendezvous. Bind 127.0.0.1, or set "
            "kv_private_network (--kv-private-network) if only the cluster can reach that network."
        )


class DistReceiverServer(ReceiverServer):
    def __init__(
        self,
        receiver,
        host: str,
        port: int,
        idle_timeout_s: float = 30.0,
        token: str | None = None,
        private_network: bool = False,
    ):
        _check_exposure(host, private_network)
        self._token = token
        sock = _listen(host, port)
        real_port = sock.getsockname()[1]
        self._store = dist.TCPStore(
            host,
            real_port,
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=sock.detach(),
            timeout=datetime.timedelta(seconds=idle_timeout_s),
        )
        self.endpoint = f"[{host}]:{real_port}" if ":" in host else f"{host}:{real_port}"
        self._receiver, self._host = receiver, host
        cache_device = receiver.kv_caches[0][0].device
        self._backend = backend_for(cache_device)
        self._device = cache_device if self._backend == "nccl" else torch.device("cpu")
        self._idle_timeout_s = idle_timeout_s
        self._store.set("backend", self._backend)
        self._store.set("idle_timeout_ms", str(int(idle_timeout_s * 1000)))
        self._store.add("pairs", 0)
        self._stopping = threading.Event()
        self._pair_threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept_pairs, name="kv-pairs", daemon=True)
        self._acceptor.start()

    def stop(self, join_s: float = 1.0) -> None:
        """Stop taking pairs. Pair threads end when their sender closes, sends anything, or
        stays silent past idle_timeout (a blocked gloo recv cannot be interrupted)."""
        self._stopping.set()
        self._acceptor.join()
        for t in self._pair_threads:
            t.join(join_s)

    def _accept_pairs(self) -> None:
        seen = 0
        while not self._stopping.wait(POLL_S):
            count = self._store.add("pairs", 0)
            for n in range(seen + 1, count + 1):
                t = threading.Thread(target=self._serve_pair, args=(n,), daemon=True)
                t.name = f"kv-pair-{n}"
                t.start()
                self._pair_threads.append(t)
            seen = count
            self._pair_threads = [t for t in self._pair_threads if t.is_alive()]

    def _serve_pair(self, n: int) -> None:
        try:
            store = dist.PrefixStore(f"pair/{n}", self._store)
            if not self._challenge(store, n):
                return
            group = make_pair_group(self._backend, store, 1, self._idle_timeout_s, self._host)
            pair = _Pair(group, peer=0, device=self._device)
            self._pair_loop(pair)
        # The sender died or broke the protocol: drop this pair, keep serving the others.
        except Exception as e:  # noqa: BLE001
            if not self._stopping.is_set():
                log.warning("torch_dist pair %d closed: %s", n, str(e)[:200])

    def _challenge(self, store, n: int) -> bool:
        """Ask pair n's sender for the token's proof; tell it the verdict. Without a token
        (loopback only) every pair is welcome."""
        nonce = secrets.token_hex(16).encode()
        store.set("nonce", nonce)
        proof = store.get("proof")  # blocks until the sender answers, up to the store timeout
        ok = self._token is None or hmac.compare_digest(proof, _proof(self._token, nonce))
        store.set("verdict", VERDICT_OK if ok else VERDICT_REFUSED)
        if not ok:
            log.warning("torch_dist pair %d refused: missing or bad cluster token", n)
        return ok

    def _pair_loop(self, pair: _Pair) -> None:
        streams: dict[int, _StreamTally] = {}
        while not self._stopping.is_set():
            op, tag, header_len, payload_len = pair.recv(4, torch.int64, TAG_DATA).tolist()
            if op == OP_CLOSE:
                return
            if op == OP_PING:
                continue
            if op == OP_ABORT:
                streams.pop(tag, None)
                continue
            if op not in (OP_FRAME, OP_COMMIT) or not (
                0 <= header_len <= MAX_HEADER_BYTES and 0 <= payload_len <= MAX_FRAME_BYTES
            ):
                raise ConnectionError(f"bad message op={op} header={header_len} p={payload_len}")
            header = pair.recv(header_len, torch.uint8, TAG_DATA) if header_len else None
            payload = pair.recv(payload_len, torch.uint8, TAG_DATA) if payload_len else b""
            header = header.numpy().tobytes() if header is not None else b""
            tally = streams.setdefault(tag, _StreamTally())
            self._accept(tally, header, payload)
            if op == OP_COMMIT:
                self._send_ack(pair, tag, streams.pop(tag))

    def _accept(self, tally: _StreamTally, header: bytes, payload) -> None:
        try:
            self._receiver.accept(header, payload)
            tally.accepted += 1
        except FrameError as e:
            tally.rejected += 1
            tally.reasons.append(e.reason)
        except Exception as e:  # a receiver bug must not kill the pair for other streams
            log.exception("kv frame crashed the receiver")
            tally.rejected += 1
            tally.reasons.append(f"internal error: {type(e).__name__}")

    def _send_ack(self, pair: _Pair, tag: int, tally: _StreamTally) -> None:
        reasons = "\n".join(tally.reasons).encode()[:MAX_REASON_BYTES]
        pair.send_ints([tag, tally.accepted, tally.rejected, len(reasons)], TAG_ACK)
        if reasons:
            pair.send(torch.frombuffer(bytearray(reasons), dtype=torch.uint8), TAG_ACK)


def serve(receiver, host: str, port: int, **opts) -> ReceiverServer:
    return DistReceiverServer(receiver, host, port, **opts)
