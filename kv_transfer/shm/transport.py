"""shm transport, prefill side: a link is one authenticated control connection to a decode
worker on this node plus a read-write mapping of that worker's KV cache file, opened only once
the receiver proved the cluster token (the handshake makes it prove itself first); a channel
copies each layer's blocks from the sender's cache straight into the lease's blocks (no
socket carries KV bytes) and commits over the control connection with the cells it wrote and
a digest of the bytes it copied (kv_transfer.nixl.commit), which the receiver checks against
its leased blocks.

A copy never goes to a block the receiver did not name for the lease: the channel asks for
the lease's block ids (only those) before its first copy and refuses positions outside them,
and copies nothing within a margin of the lease's deadline as the receiver gave it, so a lease
that expired is not written into after its blocks went back to the pool.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import torch

from engine.shared_kv_cache import map_shared
from kv_transfer.interfaces import Channel, Link, ReceiverServer
from kv_transfer.nixl.commit import SentHashes, encode_notification
from kv_transfer.nixl.control import field
from kv_transfer.one_sided import ControlLink
from kv_transfer.shm.server import PROTOCOL, ShmReceiverServer

log = logging.getLogger("pdserve.kv")

DEADLINE_MARGIN_S = 1.0  # no copy started this close to the lease's deadline
DTYPES = ("float32", "float16", "bfloat16", "int8", "float8_e4m3fn")


def _runs(src: list[int], dst: list[int]):
    """(src start, dst start, count) per stretch consecutive on both sides: one slice copy."""
    out: list[list[int]] = []
    for s, d in zip(src, dst):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += 1
        else:
            out.append([s, d, 1])
    return out


class ShmChannel(Channel):
    writes_blocks = True

    def __init__(self, link: ShmLink, request_id: str, lease_id: str):
        self._link, self.request_id, self.lease_id = link, request_id, lease_id
        self._blocks: list[int] | None = None  # the lease's block ids in the receiver's cache
        self._first = 0
        self._deadline = 0.0
        self._hashes = SentHashes()  # each write hashed from its source
        self._writes: list[tuple[int, list[int]]] = []
        self._bytes = 0
        self._errors: list[str] | None = None
        self._settled = False  # told the receiver it writes no more (commit, or settle)
        self._lock = threading.Lock()

    def _fetch_blocks(self) -> None:
        reply = self._link.lease(self.request_id, self.lease_id)
        blocks, total = field(reply, "blocks", list), self._link.layout["num_blocks"]
        if not all(isinstance(b, int) and 0 <= b < total for b in blocks):
            raise ConnectionError("shm receiver named blocks outside its cache")
        self._blocks, self._first = blocks, int(reply.get("first_block", 0))
        left = float(field(reply, "seconds_left", float))
        self._deadline = time.monotonic() + left - DEADLINE_MARGIN_S

    def write_layer(self, layer, src, dst, k_cache, v_cache, damage: bool = False) -> int:
        with self._lock:
            return self._write_layer(layer, list(src), list(dst), k_cache, v_cache, damage)

    def _write_layer(self, layer, src, dst, k_cache, v_cache, damage: bool) -> int:
        link = self._link
        if link.closed:  # its receiver frees the blocks it handed once the link is gone
            raise ConnectionError("shm link was closed here: not writing through it")
        block_bytes = link.check_cache(k_cache, v_cache)
        if self._blocks is None:
            self._fetch_blocks()
        n, layers = len(self._blocks), len(link.caches)
        if not 0 <= layer < layers:
            raise ValueError(f"layer {layer} out of range [0, {layers})")
        outside = [p for p in dst if not self._first <= p < n]
        if outside:
            raise ValueError(
                f"lease positions {outside[:8]} outside lease {self.lease_id}'s writable "
                f"[{self._first}, {n})"
            )
        if time.monotonic() > self._deadline:
            raise TimeoutError(f"lease {self.lease_id} is at its deadline: not writing into it")
        if k_cache.device.type != "cpu":  # hashed and copied from host memory
            index = torch.tensor(src, device=k_cache.device)
            k_cache, v_cache, src = k_cache[index].cpu(), v_cache[index].cpu(), range(len(src))
        k_dst, v_dst = link.caches[layer]
        for s, d, count in _runs(src, [self._blocks[p] for p in dst]):
            k_dst[d : d + count].copy_(k_cache[s : s + count])
            v_dst[d : d + count].copy_(v_cache[s : s + count])
        self._hashes.add(layer, src, dst, k_cache, v_cache, damage)
        self._writes.append((layer, dst))
        self._bytes += 2 * len(dst) * block_bytes
        return 2 * len(dst) * block_bytes

    def push(self, header, payload) -> None:
        raise NotImplementedError("the shm transport copies blocks (write_layer), not frames")

    def push_commit(self, header, payload) -> None:
        with self._lock:
            message = encode_notification(
                header, self.lease_id, self._writes, self._bytes, self._hashes.digest()
            )
            self._settled = True  # the receiver settles the lease on the commit
            reply = self._link.request(
                {"op": "commit", "notification": message, "lease": self.lease_id}
            )
        errors = reply.get("errors")
        if not isinstance(errors, list) or not all(isinstance(e, str) for e in errors):
            raise ConnectionError("shm receiver answered the commit with no verdict")
        self._errors = errors

    def wait_ack(self, timeout: float) -> list[str]:
        return list(self._errors or [])  # push_commit waited for the verdict

    def cancel(self) -> None:
        """End the stream without a commit (the lease expires): tell the receiver this stream
        copies no more, so its blocks can be reused once it is released. A copy is synchronous:
        none is in flight once the sender thread left this channel."""
        if not self._lock.acquire(blocking=False):
            return  # the sender thread is inside (a commit that timed out): it ends itself
        try:
            if self._blocks is not None and not self._settled and not self._link.broken:
                self._settled = True
                try:
                    self._link.request({"op": "settle", "lease": self.lease_id})
                # The link failed: its receiver settles the lease when the connection ends.
                except Exception as e:  # noqa: BLE001
                    log.info("shm settle of lease %s: %s: %s", self.lease_id, type(e).__name__, e)
        finally:
            self._lock.release()


def _check_layout(layout: dict) -> dict:
    """The receiver's layout, its fields checked (it sizes the mapping)."""
    counts = [layout.get(k) for k in ("num_layers", "num_blocks", "block_bytes")]
    shape, dtype = layout.get("block_shape"), layout.get("dtype")
    ok = all(isinstance(c, int) and c > 0 for c in counts)
    ok = ok and isinstance(shape, list) and all(isinstance(d, int) and d > 0 for d in shape)
    if not ok or dtype not in DTYPES:
        raise ConnectionError("shm receiver sent a malformed cache layout")
    if math.prod(shape) * getattr(torch, dtype).itemsize != layout["block_bytes"]:
        raise ConnectionError("shm receiver's block bytes do not fit its block shape")
    return layout


class ShmLink(ControlLink):
    kind, protocol = "shm", PROTOCOL

    def _greeted(self, hello: dict) -> None:
        """Map the receiver's cache (the receiver proved the token already)."""
        self.layout = _check_layout(field(hello, "layout", dict))
        self.caches = map_shared(field(hello, "path", str), self.layout)

    def check_cache(self, k_cache, v_cache) -> int:
        """Check the sender's cache tensors match the receiver's layout; one block's bytes."""
        lay = self.layout
        shape, dtype = list(k_cache.shape[1:]), str(k_cache.dtype).removeprefix("torch.")
        if shape != lay["block_shape"] or dtype != lay["dtype"] or v_cache.shape != k_cache.shape:
            raise ValueError(
                f"cache blocks {shape} {dtype} do not match the receiver's "
                f"{lay['block_shape']} {lay['dtype']}"
            )
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("shm copies from contiguous [num_blocks, ...] caches")
        return int(lay["block_bytes"])

    def _new_channel(self, request_id: str, lease_id: str) -> Channel:
        return ShmChannel(self, request_id, lease_id)


def connect(endpoint: str, **opts) -> Link:
    return ShmLink(endpoint, **opts)


def serve(receiver, host: str, port: int, **opts) -> ReceiverServer:
    return ShmReceiverServer(receiver, host, port, **opts)
