"""A two-party torch.distributed Store over a pair's authenticated pairing connection.

gloo (and NCCL) rendezvous through a Store: each rank sets its address (NCCL: rank 0 its
unique id) and reads the other's. A TCPStore would let anyone who reaches its port read or
overwrite those keys; this store has no port. A ``set`` sends the key and value to the peer as
one frame, a ``get`` reads the peer's frames until the key is there. Frames:

    u32 body length | body: msgpack [seq, key, value] | HMAC-SHA256(pair key, side | body)

``side`` names the writer (no reflection), ``seq`` counts each side's frames from 0 (no
replay, no reordering), the pair key comes from the handshake (kv_transfer.torch_dist.handshake)
and bodies are capped at MAX_BODY. Anything else ends the pair with ConnectionError. The
pair's parameters (backend, idle timeout) are the receiver's first frame.
"""

from __future__ import annotations

import datetime
import hmac
import json
import socket
import struct
import threading
import time

import msgpack
import torch.distributed as dist

from kv_transfer.torch_dist.handshake import MAC_LEN, mac, recv_exact

MAX_BODY = 64 * 1024  # gloo addresses and NCCL ids are a few hundred bytes
PARAMS_KEY = "pdserve/params"
_LEN = struct.Struct(">I")
SIDES = (b"S", b"R")  # rank 0 (sender), rank 1 (receiver)


def _seconds(timeout, default: float) -> float:
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    return default if timeout is None or timeout <= 0 else float(timeout)


class PairStore(dist.Store):
    """Rank ``rank``'s view of the pair's keys; ``timeout_s`` bounds every wait."""

    def __init__(self, sock: socket.socket, key: bytes, rank: int, timeout_s: float):
        super().__init__()
        self.sock, self._key, self.timeout_s = sock, key, timeout_s
        self._mine, self._theirs = SIDES[rank], SIDES[1 - rank]
        self._sent = self._received = 0
        self._values: dict[str, bytes] = {}
        self._lock = threading.RLock()

    # -- the Store methods gloo and NCCL call (bytes values, str keys)
    def set(self, key, value) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        with self._lock:
            self._values[key] = value
            self._send(key, value)

    def get(self, key):
        self.wait([key])
        return self._values[key]

    def wait(self, keys, timeout=None) -> None:
        deadline = time.monotonic() + _seconds(timeout, self.timeout_s)
        with self._lock:
            while not all(k in self._values for k in keys):
                self._read_one(deadline)

    def check(self, keys) -> bool:
        return all(k in self._values for k in keys)

    def add(self, key, amount) -> int:
        """A counter local to this side, sent to the peer as its new value (neither gloo nor
        NCCL's two-rank setup counts on both sides at once)."""
        with self._lock:
            value = int(self._values.get(key, b"0")) + int(amount)
            self.set(key, str(value).encode())
            return value

    def delete_key(self, key) -> bool:
        with self._lock:
            return self._values.pop(key, None) is not None

    def num_keys(self) -> int:
        return len(self._values)

    def set_timeout(self, timeout) -> None:
        self.timeout_s = _seconds(timeout, self.timeout_s)

    # -- the pair's parameters, the receiver's first frame
    def send_params(self, params: dict) -> None:
        self.set(PARAMS_KEY, json.dumps(params).encode())

    def read_params(self) -> dict:
        params = json.loads(self.get(PARAMS_KEY))
        if not isinstance(params, dict):
            raise ConnectionError("torch_dist pair parameters are not a map")
        return params

    def peer_closed(self) -> bool:
        """Whether the peer closed the connection (or reset it), without blocking or reading."""
        if not self._lock.acquire(blocking=False):
            return False  # a rendezvous read is under way: the peer is not known gone
        try:
            self.sock.settimeout(0)  # a timeout would make Python wait before the peek
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True
        finally:
            self._lock.release()

    # -- frames
    def _send(self, key: str, value: bytes) -> None:
        body = msgpack.packb([self._sent, key, value], use_bin_type=True)
        if len(body) > MAX_BODY:
            raise ValueError(f"store value for {key!r} is over {MAX_BODY} bytes")
        self.sock.settimeout(self.timeout_s)
        self.sock.sendall(_LEN.pack(len(body)) + body + mac(self._key, self._mine, body))
        self._sent += 1

    def _read_one(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("torch_dist pair rendezvous timed out")
        self.sock.settimeout(left)
        (length,) = _LEN.unpack(recv_exact(self.sock, _LEN.size))
        if length > MAX_BODY:
            raise ConnectionError(f"torch_dist pair frame of {length} bytes (max {MAX_BODY})")
        data = recv_exact(self.sock, length + MAC_LEN)
        body, tag = data[:length], data[length:]
        if not hmac.compare_digest(tag, mac(self._key, self._theirs, body)):
            raise ConnectionError("torch_dist pair frame failed its authentication")
        self._store(body)

    def _store(self, body: bytes) -> None:
        try:
            seq, key, value = msgpack.unpackb(body, raw=False)
        except Exception as e:  # noqa: BLE001 -- an authenticated peer sent junk: end the pair
            raise ConnectionError(f"torch_dist pair frame unreadable: {e}") from None
        if seq != self._received or not isinstance(key, str) or not isinstance(value, bytes):
            raise ConnectionError("torch_dist pair frame out of sequence or malformed")
        self._received += 1
        self._values[key] = value
