"""The nixl transport's control connection: a TCP connection whose ends proved the cluster
token to each other with the torch_dist pairing handshake (kv_transfer.torch_dist.handshake:
HMAC challenge both ways, the receiver proves itself first), then exchange messages:

    u32 body length | body: msgpack map | HMAC-SHA256(pair key, side | seq | body)

``side`` names the writer (no reflection), ``seq`` counts each side's messages (no replay or
reordering), bodies are capped at MAX_BODY. Anything else ends the connection with
ConnectionError. No pickle: bodies are msgpack maps of plain values.

The receiver speaks first (``hello``: its agent name, metadata and cache layout), the sender
answers with its agent name; after that the sender asks and the receiver answers:
``{"op": "lease", ...}`` (the addresses of one lease's blocks), ``{"op": "ack", ...}`` (the
verdict on a commit notification; it settles the lease for this connection whatever the
verdict) and ``{"op": "settle", ...}`` (a stream that ends without a commit writes no more).
"""

from __future__ import annotations

import hmac
import socket
import struct

import msgpack

from kv_transfer.torch_dist.handshake import MAC_LEN, mac, recv_exact

MAX_BODY = 64 * 1024 * 1024  # a lease of 8,192 blocks x 80 layers: 10 MiB of addresses
_LEN = struct.Struct(">I")
_SEQ = struct.Struct(">Q")
SIDES = (b"S", b"R")  # the sender (prefill) and the receiver (decode)
PROTOCOL = "pdserve-nixl/1"


class ControlConnection:
    """One end of an authenticated control connection; not thread-safe (one user at once)."""

    def __init__(self, sock: socket.socket, key: bytes, side: int):
        self.sock, self._key = sock, key
        # Request and answer, each one write: nothing gains from Nagle's wait for an ACK.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._mine, self._theirs = SIDES[side], SIDES[1 - side]
        self._sent = self._received = 0

    def send(self, message: dict) -> None:
        body = msgpack.packb(message, use_bin_type=True)
        if len(body) > MAX_BODY:
            raise ValueError(f"control message of {len(body)} bytes over {MAX_BODY}")
        tag = mac(self._key, self._mine, _SEQ.pack(self._sent), body)
        self._sent += 1
        self.sock.sendall(_LEN.pack(len(body)) + body + tag)

    def recv(self, timeout: float | None = None) -> dict:
        """The peer's next message; ConnectionError on a bad, forged or oversized one,
        socket.timeout (TimeoutError) past ``timeout`` (None: the socket's own)."""
        if timeout is not None:
            self.sock.settimeout(timeout)
        (size,) = _LEN.unpack(recv_exact(self.sock, _LEN.size))
        if size > MAX_BODY:
            raise ConnectionError(f"nixl control message of {size} bytes over {MAX_BODY}")
        body = recv_exact(self.sock, size)
        tag = recv_exact(self.sock, MAC_LEN)
        expected = mac(self._key, self._theirs, _SEQ.pack(self._received), body)
        if not hmac.compare_digest(tag, expected):
            raise ConnectionError("nixl control message failed its authentication")
        self._received += 1
        try:
            message = msgpack.unpackb(body, raw=False, strict_map_key=True)
        # msgpack raises many exception types on garbage; all of them end the connection.
        except Exception as e:  # noqa: BLE001
            raise ConnectionError(f"nixl control message is not msgpack: {type(e).__name__}")
        if not isinstance(message, dict):
            raise ConnectionError("nixl control message is not a map")
        return message

    def peer_closed(self) -> bool:
        """Whether the peer closed (or reset) the connection, without blocking: an idle
        control connection reads nothing until its peer goes away."""
        timeout = self.sock.gettimeout()
        try:
            self.sock.setblocking(False)
            data = self.sock.recv(1, socket.MSG_PEEK)
            return not data
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        finally:
            self.sock.settimeout(timeout)

    def close(self) -> None:
        self.sock.close()


def field(message: dict, name: str, kind: type):
    """``message[name]`` if it is a ``kind``; ConnectionError naming the field otherwise."""
    value = message.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ConnectionError(f"nixl control message field {name!r} missing or not {kind.__name__}")
    return value
