"""torch_dist transport, receiver side: a pairing port bound to the configured host (one
thread runs every handshake, kv_transfer.torch_dist.acceptor), one thread per authenticated
sender pair, capped (the protocol and its security are in kv_transfer.torch_dist.pair)."""

from __future__ import annotations

import logging
import socket
import threading

import torch

from grpc_plumbing.auth import OpenBindError, is_loopback
from kv_transfer.errors import FrameError
from kv_transfer.frame import MAX_FRAME_BYTES, MAX_HEADER_BYTES
from kv_transfer.interfaces import ReceiverServer
from kv_transfer.torch_dist.acceptor import PairAcceptor
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
    backend_for,
    make_pair_group,
)
from kv_transfer.torch_dist.pairstore import PairStore

log = logging.getLogger("pdserve.kv")

MAX_REASON_BYTES = 16 * 1024  # of the rejection reasons a commit ack carries
# Pairs: one per prefill worker (rank) sending here, plus a reconnect's old pair until its
# idle timeout drops it. Pending handshakes: a real one takes milliseconds.
DEFAULT_MAX_PAIRS = 64
DEFAULT_MAX_PENDING = 64
DEFAULT_HANDSHAKE_TIMEOUT_S = 3.0


class _StreamTally:
    """What one sender stream got accepted/rejected, reported in its commit ack."""

    def __init__(self):
        self.accepted = 0
        self.rejected = 0
        self.reasons: list[str] = []


def _listen(host: str, port: int) -> socket.socket:
    # The pairing port, on ``host`` only (gloo then binds its own sockets there too).
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def _check_exposure(host: str, private_network: bool) -> None:
    if not private_network and not is_loopback(host):
        raise OpenBindError(
            f"refusing to serve torch_dist KV on {host}: its gloo and NCCL traffic is "
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
        max_pairs: int = DEFAULT_MAX_PAIRS,
        max_pending: int = DEFAULT_MAX_PENDING,
        handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
    ):
        _check_exposure(host, private_network)
        self._token = token
        sock = _listen(host, port)
        real_port = sock.getsockname()[1]
        self.endpoint = f"[{host}]:{real_port}" if ":" in host else f"{host}:{real_port}"
        self._receiver, self._host = receiver, host
        cache_device = receiver.kv_caches[0][0].device
        self._backend = backend_for(cache_device)
        self._device = cache_device if self._backend == "nccl" else torch.device("cpu")
        self._idle_timeout_s = idle_timeout_s
        self._stopping = threading.Event()
        self._pair_threads: list[threading.Thread] = []
        self._threads_lock = threading.Lock()
        self._acceptor = PairAcceptor(
            sock, token, self._start_pair, max_pairs, max_pending, handshake_timeout_s
        )
        self._acceptor.start()

    def problem(self) -> str | None:
        """Why this server takes no new pairs (None: it does)."""
        return self._acceptor.problem()

    @property
    def active_pairs(self) -> int:
        return self._acceptor.active_pairs

    def stop(self, join_s: float = 1.0) -> None:
        """Stop taking pairs. Pair threads end when their sender closes, sends anything, or
        stays silent past idle_timeout (a blocked gloo recv cannot be interrupted)."""
        self._stopping.set()
        self._acceptor.stop()
        with self._threads_lock:
            threads = list(self._pair_threads)
        for t in threads:
            t.join(join_s)

    def _start_pair(self, sock: socket.socket, key: bytes, n: int) -> None:
        """The acceptor's hand-over: an authenticated sender, with a pair slot taken."""
        t = threading.Thread(target=self._serve_pair, args=(sock, key, n), daemon=True)
        t.name = f"kv-pair-{n}"
        with self._threads_lock:
            self._pair_threads = [p for p in self._pair_threads if p.is_alive()]
            self._pair_threads.append(t)
        t.start()

    def _serve_pair(self, sock: socket.socket, key: bytes, n: int) -> None:
        try:
            store = PairStore(sock, key, rank=1, timeout_s=self._idle_timeout_s)
            store.send_params(
                {"backend": self._backend, "idle_timeout_ms": int(self._idle_timeout_s * 1000)}
            )
            group = make_pair_group(self._backend, store, 1, self._idle_timeout_s, self._host)
            self._pair_loop(Pair(group, peer=0, device=self._device))
        # The sender died or broke the protocol: drop this pair, keep serving the others.
        except Exception as e:  # noqa: BLE001
            if not self._stopping.is_set():
                log.warning("torch_dist pair %d closed: %s", n, str(e)[:200])
        finally:
            sock.close()  # the sender's watch on this connection sees the pair end
            self._acceptor.release()

    def _pair_loop(self, pair: Pair) -> None:
        streams: dict[int, _StreamTally] = {}
        while True:
            op, tag, header_len, payload_len = pair.recv(4, torch.int64, TAG_DATA).tolist()
            # A stopped server ends the pair on its next message (also one paired just before
            # the stop): the sender's stream fails then, not its open at the closed connection.
            if op == OP_CLOSE or self._stopping.is_set():
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

    def _send_ack(self, pair: Pair, tag: int, tally: _StreamTally) -> None:
        reasons = "\n".join(tally.reasons).encode()[:MAX_REASON_BYTES]
        pair.send_ints([tag, tally.accepted, tally.rejected, len(reasons)], TAG_ACK)
        if reasons:
            pair.send(as_tensor(reasons, pair.device), TAG_ACK)
