"""nixl transport, prefill side: a link is one authenticated control connection to a decode
worker's nixl server plus that worker's NIXL agent metadata, loaded into this process's
sender agent once the receiver proved the cluster token (the handshake makes the receiver
prove itself first) and dropped when the link closes; a channel WRITEs each layer's blocks
from the sender's own cache (registered on first use) straight into the lease's blocks, and
commits with a NIXL notification (kv_transfer.nixl.commit) whose verdict it asks for over
the control connection.

A write never goes to a block the receiver did not name for the lease: the channel asks for
the lease's addresses (only those) before its first write and refuses positions past them,
and posts no write past the lease's deadline as the receiver gave it (less a margin), so a
lease that expired is not written into after its blocks went back to the pool.
"""

from __future__ import annotations

import logging
import select
import threading
import time

import numpy as np

from kv_transfer.errors import ReceiverFault
from kv_transfer.interfaces import Channel, Link, ReceiverServer
from kv_transfer.nixl.agent import NixlAgent, mem_type
from kv_transfer.nixl.commit import (
    NO_DIGEST,
    SentHashes,
    encode_notification,
    encode_written,
    notification_key,
)
from kv_transfer.nixl.control import PROTOCOL, field
from kv_transfer.nixl.server import NixlReceiverServer
from kv_transfer.one_sided import ControlLink

log = logging.getLogger("pdserve.kv")

DEADLINE_MARGIN_S = 1.0  # no write posted this close to the lease's deadline
# A WRITE's completion is polled with a backoff between these: the last layer's completion is
# on the commit's path, and a coarser step (2 ms) left it waiting ~1 ms on average.
_POLL_S = (0.00002, 0.0005)

_agent: NixlAgent | None = None
_remotes: dict[str, int] = {}  # remote agent name -> links using its loaded metadata
_agent_lock = threading.Lock()


def _sender_agent() -> NixlAgent:
    global _agent
    with _agent_lock:
        if _agent is None:
            _agent = NixlAgent("prefill")
        return _agent


def _load_remote(agent: NixlAgent, name: str, metadata: bytes) -> str:
    """Load agent ``name``'s metadata once for all the links to it."""
    with _agent_lock:
        if name not in _remotes:
            loaded = agent.add_remote(metadata)
            if loaded != name:
                agent.remove_remote(loaded)
                raise ConnectionError(f"nixl receiver named itself {name!r} but is {loaded!r}")
        _remotes[name] = _remotes.get(name, 0) + 1
        return name


def _drop_remote(agent: NixlAgent, name: str) -> None:
    with _agent_lock:
        _remotes[name] -= 1
        if _remotes[name]:
            return
        del _remotes[name]
        agent.remove_remote(name)


class NixlChannel(Channel):
    writes_blocks = True

    def __init__(self, link: NixlLink, request_id: str, lease_id: str):
        self._link, self.request_id, self.lease_id = link, request_id, lease_id
        self._k = self._v = None  # [layers, lease blocks] addresses of the lease's blocks
        self._deadline = 0.0
        self._pending: dict[int, object] = {}  # layer -> its WRITE in flight
        self._writes: list[tuple[int, list[int]]] = []
        self._hashes = SentHashes()  # each write hashed from its source (host caches)
        self._bytes = 0
        self._host = True  # the sender's cache is in host memory (digest affordable)
        self._errors: list[str] | None = None
        self._last = None  # the last write's first descriptor (local, remote, kinds)
        self._settled = False  # told the receiver it writes no more (commit, or settle)
        self._lock = threading.Lock()

    def _fetch_addresses(self) -> None:
        reply = self._link.lease(self.request_id, self.lease_id)
        n, layers = field(reply, "blocks", int), self._link.layout["num_layers"]
        k, v = (np.frombuffer(field(reply, name, bytes), dtype="<u8") for name in ("k", "v"))
        if k.size != layers * n or v.size != layers * n:
            raise ConnectionError("nixl receiver sent addresses that do not fit its layout")
        self._k, self._v = k.reshape(layers, n), v.reshape(layers, n)
        self._first = int(reply.get("first_block", 0))  # before it: cached, never written
        left = float(field(reply, "seconds_left", float))
        self._deadline = time.monotonic() + left - DEADLINE_MARGIN_S

    def write_layer(self, layer, src, dst, k_cache, v_cache, damage: bool = False) -> int:
        with self._lock:
            return self._write_layer(layer, src, dst, k_cache, v_cache, damage)

    def _write_layer(self, layer, src, dst, k_cache, v_cache, damage: bool) -> int:
        link = self._link
        if link.closed:  # its receiver frees the blocks it handed once the link is gone
            raise ConnectionError("nixl link was closed here: not writing through it")
        block_bytes = link.check_cache(k_cache, v_cache)
        if self._k is None:
            self._fetch_addresses()
        n = self._k.shape[1]
        if not 0 <= layer < self._k.shape[0]:
            raise ValueError(f"layer {layer} out of range [0, {self._k.shape[0]})")
        outside = [p for p in dst if not self._first <= p < n]
        if outside:
            raise ValueError(
                f"lease positions {outside[:8]} outside lease {self.lease_id}'s writable "
                f"[{self._first}, {n})"
            )
        if time.monotonic() > self._deadline:
            raise TimeoutError(f"lease {self.lease_id} is at its deadline: not writing into it")
        self._reap()
        self._finish(layer)  # a block written twice (a chunk's partial last block): in order
        local_kind, local_dev = mem_type(k_cache)
        offsets = np.array(src, dtype=np.uint64) * np.uint64(block_bytes)
        dst_ids = np.asarray(dst, dtype=np.int64)
        k_runs = _coalesce(k_cache.data_ptr() + offsets, self._k[layer][dst_ids], block_bytes)
        v_runs = _coalesce(v_cache.data_ptr() + offsets, self._v[layer][dst_ids], block_bytes)
        local, remote, sizes = (np.concatenate([k, v]) for k, v in zip(k_runs, v_runs))
        descs = (
            _descs(local, sizes, local_dev),
            _descs(remote, sizes, link.layout["device"]),
            (local_kind, link.layout["mem_type"]),
        )
        written = encode_written(self.lease_id, len(self._writes), layer, dst)
        self._pending[layer] = link.agent.write(*descs, link.peer, written)
        # The commit rewrites the first block written (one block, whatever its run's length).
        self._last = tuple(_descs(d[:1, 0], block_bytes, d[0, 2]) for d in descs[:2]) + descs[2:]
        self._host = self._host and local_kind == "DRAM"
        if self._host:  # hashed while nothing else runs here: the WRITE was posted first
            self._hashes.add(layer, src, dst, k_cache, v_cache, damage)
        self._writes.append((layer, list(dst)))
        self._bytes += 2 * len(src) * block_bytes
        return 2 * len(src) * block_bytes

    def _reap(self) -> None:
        """Release the WRITEs in flight that are done, without waiting: the commit then waits
        for the last few only (one poll of each, not a sleep per layer)."""
        for layer, handle in list(self._pending.items()):
            if self._link.agent.state(handle) != "PROC":
                self._finish(layer)

    def _finish(self, layer: int) -> None:
        """Wait for ``layer``'s WRITE in flight, if any, and release it."""
        handle = self._pending.pop(layer, None)
        if handle is not None:
            self._link.wait_done(handle)

    def push(self, header, payload) -> None:
        raise NotImplementedError("the nixl transport writes blocks (write_layer), not frames")

    def push_commit(self, header, payload) -> None:
        with self._lock:
            for layer in list(self._pending):
                self._finish(layer)
            dig = self._hashes.digest() if self._host else NO_DIGEST
            message = encode_notification(header, self.lease_id, self._writes, self._bytes, dig)
            handle = self._send_notification(message)
            self._settled = True  # the receiver settles the lease on the notification
            ack = {"op": "ack", "notification": notification_key(message), "lease": self.lease_id}
            # Asked at once: the receiver waits for the notification, and progressing this
            # agent meanwhile moves it out (no round of polling its WRITE first).
            self._link.moving = handle
            try:
                reply = self._link.request(ack, progress=True)
            except BaseException:
                self._release(handle, commit_failed=True)
                raise
            finally:
                self._link.moving = None
            self._release(handle)
        errors = reply.get("errors")
        if not isinstance(errors, list) or not all(isinstance(e, str) for e in errors):
            raise ConnectionError("nixl receiver answered the commit with no verdict")
        self._errors = errors

    def _send_notification(self, message: bytes) -> None:
        """The commit rides on a WRITE of the last block written (the same bytes into the same
        block again): NIXL delivers a transfer's notification once its data is in place, and
        polling the transfer moves both along (a bare notification may wait in the agent's
        queue until something progresses it). A stream that wrote nothing sends it bare.
        Returns the WRITE's handle (None: bare), to be released once the verdict came."""
        link = self._link
        if self._last is None:
            link.agent.notify(link.peer, message)
            return None
        local, remote, kinds = self._last
        return link.agent.write(local, remote, kinds, link.peer, message)

    def _release(self, handle, commit_failed: bool = False) -> None:
        """Wait for the commit's WRITE (None: it went bare) and release it; when the commit
        failed already, a failure of its WRITE adds nothing (logged)."""
        if handle is None:
            return
        if not commit_failed:
            self._link.wait_done(handle)
            return
        try:
            self._link.wait_done(handle)
        except Exception as e:  # noqa: BLE001
            log.info("nixl commit WRITE of a failed commit: %s: %s", type(e).__name__, e)

    def wait_ack(self, timeout: float) -> list[str]:
        return list(self._errors or [])  # push_commit waited for the verdict

    def cancel(self) -> None:
        """End the stream without a commit (the lease expires). WRITEs in flight are waited
        for and released, unless the sender thread is inside this channel right now (a
        commit that timed out cancels from the caller's thread): then it finishes them."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            for layer in list(self._pending):
                try:
                    self._finish(layer)
                # The stream failed already; a write that fails too adds nothing.
                except Exception as e:  # noqa: BLE001
                    log.info("nixl write of a cancelled stream: %s: %s", type(e).__name__, e)
            if self._k is not None and not self._settled and not self._link.broken:
                self._settled = True
                self._settle_quietly()
        finally:
            self._lock.release()

    def _settle_quietly(self) -> None:
        """Tell the receiver this stream writes no more, so the lease's blocks can be reused
        as soon as it is released (a link that is gone tells it by closing)."""
        try:
            self._link.request({"op": "settle", "lease": self.lease_id})
        # The link failed: its receiver settles the lease when the connection ends.
        except Exception as e:  # noqa: BLE001
            log.info("nixl settle of lease %s: %s: %s", self.lease_id, type(e).__name__, e)


def _descs(addresses: np.ndarray, sizes, device: int) -> np.ndarray:
    out = np.empty((len(addresses), 3), dtype=np.uint64)
    out[:, 0], out[:, 1], out[:, 2] = addresses, sizes, device
    return out


def _coalesce(local: np.ndarray, remote: np.ndarray, block_bytes: int):
    """One descriptor per run of blocks consecutive on both sides: (local starts, remote
    starts, bytes). Block i+1 follows block i in memory because both caches are contiguous
    [num_blocks, ...] tensors (NixlAgent.register refuses any other, and the receiver's
    addresses are its base + id x block bytes), so a run stays inside one registered tensor.
    UCX here copies one descriptor per kernel call: 3,840 per 1,024-token push unmerged."""
    step = np.uint64(block_bytes)
    # uint64 differences wrap for a step down, and never equal block_bytes then.
    cut = np.flatnonzero((np.diff(local) != step) | (np.diff(remote) != step)) + 1
    starts = np.concatenate([np.zeros(1, dtype=np.int64), cut])
    counts = np.diff(np.append(starts, len(local))).astype(np.uint64)
    return local[starts], remote[starts], counts * step


class NixlLink(ControlLink):
    kind, protocol = "nixl", PROTOCOL

    def _greeted(self, hello: dict) -> None:
        """Load the receiver's agent metadata (the receiver proved the token already)."""
        self.layout = field(hello, "layout", dict)
        self.agent = _sender_agent()
        self.moving = None  # the commit's WRITE while its verdict is asked for
        self._conn.send({"agent": self.agent.name})
        name, metadata = field(hello, "agent", str), field(hello, "metadata", bytes)
        self.peer = _load_remote(self.agent, name, metadata)

    def check_cache(self, k_cache, v_cache) -> int:
        """Register the sender's cache tensors (once) and check they match the receiver's
        layout; the bytes of one block."""
        lay = self.layout
        shape, dtype = list(k_cache.shape[1:]), str(k_cache.dtype).removeprefix("torch.")
        if shape != lay["block_shape"] or dtype != lay["dtype"] or v_cache.shape != k_cache.shape:
            raise ValueError(
                f"cache blocks {shape} {dtype} do not match the receiver's "
                f"{lay['block_shape']} {lay['dtype']}"
            )
        self.agent.register(k_cache)
        self.agent.register(v_cache)
        return int(lay["block_bytes"])

    def wait_done(self, handle) -> None:
        deadline, pause = time.monotonic() + self._timeout_s, _POLL_S[0]
        try:
            while (state := self.agent.state(handle)) == "PROC":
                if time.monotonic() > deadline:
                    self.broken = True
                    raise TimeoutError(f"nixl WRITE not done after {self._timeout_s:g} s")
                time.sleep(pause)
                pause = min(2 * pause, _POLL_S[1])
            if state != "DONE":
                self.broken = True
                raise ReceiverFault("nixl WRITE failed: the receiver's agent is gone or broken")
        finally:
            self.agent.release(handle)

    def _while_waiting(self) -> None:
        """Drive this process's agent: a notification sent just before goes out only as the
        agent progresses, and one riding on a WRITE (``moving``) only as that WRITE is
        polled (NIXL sends it once it sees the WRITE's data done)."""
        deadline, pause = time.monotonic() + self._timeout_s, _POLL_S[0]
        while not select.select([self._conn.sock], [], [], pause)[0]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nixl receiver did not answer within {self._timeout_s:g} s")
            state = self.agent.state(self.moving) if self.moving is not None else "DONE"
            if state == "ERR":  # its answer would be left unread: the link is done
                self.broken = True
                raise ReceiverFault("nixl WRITE failed: the receiver's agent is gone or broken")
            if state == "DONE":
                self.agent.progress()
            pause = min(2 * pause, _POLL_S[1])

    def _new_channel(self, request_id: str, lease_id: str) -> Channel:
        return NixlChannel(self, request_id, lease_id)

    def _forget(self) -> None:
        """Forget the receiver's agent."""
        _drop_remote(self.agent, self.peer)


def connect(endpoint: str, **opts) -> Link:
    return NixlLink(endpoint, **opts)


def serve(receiver, host: str, port: int, **opts) -> ReceiverServer:
    return NixlReceiverServer(receiver, host, port, **opts)
