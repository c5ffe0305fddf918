"""torch_dist transport, receiver side: a TCPStore rendezvous bound to the configured host,
one thread per sender pair (the protocol and its security are in kv_transfer.torch_dist.pair)."""

from __future__ import annotations

import datetime
import hmac
import logging
import secrets
import socket
import threading

import torch
import torch.distributed as dist

from grpc_plumbing.auth import OpenBindError, is_loopback
from kv_transfer.errors import FrameError
from kv_transfer.frame import MAX_FRAME_BYTES, MAX_HEADER_BYTES
from kv_transfer.interfaces import ReceiverServer
from kv_transfer.torch_dist.pair import (
    OP_ABORT,
    OP_CLOSE,
    OP_COMMIT,
    OP_FRAME,
    OP_PING,
    TAG_ACK,
    TAG_DATA,
    VERDICT_OK,
    VERDICT_REFUSED,
    Pair,
    as_tensor,
    backend_for,
    make_pair_group,
    token_proof,
)

log = logging.getLogger("pdserve.kv")

MAX_REASON_BYTES = 16 * 1024  # of the rejection reasons a commit ack carries
POLL_S = 0.05  # how often the receiver looks for new pairs


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
            pair = Pair(group, peer=0, device=self._device)
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
        ok = self._token is None or hmac.compare_digest(proof, token_proof(self._token, nonce))
        store.set("verdict", VERDICT_OK if ok else VERDICT_REFUSED)
        if not ok:
            log.warning("torch_dist pair %d refused: missing or bad cluster token", n)
        return ok

    def _pair_loop(self, pair: Pair) -> None:
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

    def _send_ack(self, pair: Pair, tag: int, tally: _StreamTally) -> None:
        reasons = "\n".join(tally.reasons).encode()[:MAX_REASON_BYTES]
        pair.send_ints([tag, tally.accepted, tally.rejected, len(reasons)], TAG_ACK)
        if reasons:
            pair.send(as_tensor(reasons, pair.device), TAG_ACK)
