"""Prefill side: stream a request's KV blocks to a decode worker while later layers compute.

Threading: one background thread per KVSender (per destination endpoint). ``send_layer`` only
enqueues; the thread gathers blocks, splits them into frames under MAX_FRAME_BYTES, encodes and
pushes them, in FIFO order across all streams of the sender. One thread per destination keeps
frames of one link in order (torch_dist needs that) and bounds threads by the number of decode
workers rather than by in-flight requests; gathering and CRC-32C are far faster than any link.

Transports plug in as a ``Link`` (a sender's connection, shared by its streams) that opens one
``Channel`` per stream (kv_transfer/interfaces.py). They are chosen by name: see
``make_sender``/``start_receiver_server``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kernels.kv_blocks import gather_kv_blocks
from kv_transfer.errors import is_receiver_fault
from kv_transfer.frame import MAX_FRAME_BYTES, dtype_name, encode_commit_frame, encode_kv_frame
from kv_transfer.interfaces import Channel, Link, ReceiverServer
from kv_transfer.transports import transport_module

log = logging.getLogger("pdserve.kv")


class TransferError(Exception):
    """A stream failed: frames were rejected by the receiver or the link broke."""

    def __init__(self, reasons: list[str], receiver_fault: bool = False):
        super().__init__("; ".join(reasons) or "transfer failed")
        self.reasons = list(reasons)
        # The receiving side failed it (kv_transfer.errors.ReceiverFault): its endpoint refused
        # or reset the link, or did not acknowledge the commit. Rejected frames are not: a
        # receiver that checks a frame and refuses it is working (a damaged or lost frame).
        self.receiver_fault = receiver_fault


@dataclass(frozen=True)
class TransferStats:
    bytes: int  # kv payload bytes pushed
    frames: int  # kv frames pushed (the commit frame not counted)
    seconds: float  # from open_stream to the receiver's acknowledgement of the commit


@dataclass
class _LayerJob:
    layer: int
    src: list[int]  # block ids in the sender's cache
    dst: list[int]  # positions in the destination lease
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    ready: object | None  # a CUDA event recorded after the layer's compute, or None
    heads: tuple[int, int] | None = None  # the model's KV heads these caches hold (None: all)


def _blocks_per_frame(k_cache: torch.Tensor) -> int:
    block_bytes = 2 * k_cache[0].numel() * k_cache.element_size()  # K and V of one block
    if block_bytes > MAX_FRAME_BYTES:
        raise ValueError(f"one block needs {block_bytes} bytes, over MAX_FRAME_BYTES")
    return MAX_FRAME_BYTES // block_bytes


class KVStream:
    """One request's transfer to one lease. Methods may be called from any one thread."""

    def __init__(self, sender: KVSender, request_id: str, lease_id: str, channel: Channel):
        self.request_id = request_id
        self.lease_id = lease_id
        self._sender = sender
        self._channel = channel
        self._opened_at = time.monotonic()
        self._frames = 0
        self._bytes = 0
        self._errors: list[str] = []  # set by the sender thread when the link fails
        self._receiver_fault = False  # one of them was the receiver's (is_receiver_fault)
        self._aborted = False
        self._closed = False
        self._committed = False  # commit() returned or raised

    @property
    def finished(self) -> bool:
        """Committed (or its commit failed) or aborted: it will use its sender no more."""
        return self._committed or self._aborted

    def send_layer(self, layer, src_block_ids, lease_blocks, k_cache, v_cache, heads=None) -> None:
        """Queue one layer's blocks ``src_block_ids`` of the local cache, to land in the
        lease's blocks at positions ``lease_blocks``; returns at once. Blocks must not change
        afterwards. ``heads``: the model's KV heads [lo, hi) the caches hold (one
        tensor-parallel rank's; each rank's slice is sent as its own frames), None: all."""
        if self._closed:
            raise RuntimeError(f"stream for lease {self.lease_id} is closed")
        src, dst = [int(b) for b in src_block_ids], [int(b) for b in lease_blocks]
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source blocks but {len(dst)} lease positions")
        if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
            raise ValueError("k_cache and v_cache differ in shape or dtype")
        dtype_name(k_cache.dtype)
        _blocks_per_frame(k_cache)
        ready = None
        if heads is not None and self._channel.writes_blocks:
            raise ValueError("one-sided transports take a whole cache, not a rank's heads")
        if k_cache.is_cuda:  # the sender thread must not read the layer before it is computed
            ready = torch.cuda.Event()
            ready.record()
        self._sender._submit(self, _LayerJob(layer, src, dst, k_cache, v_cache, ready, heads))

    def commit(self, timeout: float = 60.0) -> TransferStats:
        """Wait until all frames are pushed, commit the lease, and wait for the receiver's ack."""
        if self._closed:
            raise RuntimeError(f"stream for lease {self.lease_id} is closed")
        self._closed = True
        deadline = time.monotonic() + timeout
        pushed: Future = Future()
        self._sender._submit(self, pushed)
        try:
            pushed.result(timeout)
            errors = self._channel.wait_ack(max(0.0, deadline - time.monotonic()))
        except TransferError:
            raise
        except Exception as e:
            _cancel_quietly(self._channel)
            reason = f"commit failed: {type(e).__name__}: {e}"
            raise TransferError([reason], receiver_fault=is_receiver_fault(e)) from e
        finally:
            self._committed = True
        if errors:
            raise TransferError(errors)
        return TransferStats(self._bytes, self._frames, time.monotonic() - self._opened_at)

    def abort(self) -> None:
        """Drop queued frames and end the stream without a commit; the lease will expire."""
        if self._aborted:
            return
        self._aborted = self._closed = True
        self._sender._submit(self, None)

    # --- sender thread ---

    def _run_layer(self, job: _LayerJob) -> None:
        if job.ready is not None:
            job.ready.synchronize()
        if self._channel.writes_blocks:  # one-sided: straight from the cache, no frames
            nbytes = self._channel.write_layer(
                job.layer, job.src, job.dst, job.k_cache, job.v_cache
            )
            self._frames += 1
            self._bytes += nbytes
            return
        step = _blocks_per_frame(job.k_cache)
        for start in range(0, len(job.src), step):
            if self._aborted or self._errors:
                return
            kv, crc = gather_kv_blocks(job.k_cache, job.v_cache, job.src[start : start + step])
            dst = job.dst[start : start + step]
            header, payload = encode_kv_frame(
                self.request_id, self.lease_id, job.layer, dst, kv, crc, job.heads
            )
            self._channel.push(header, payload)
            self._frames += 1
            self._bytes += payload.nbytes

    def _run_commit(self, pushed: Future) -> None:
        if self._errors:
            pushed.set_exception(TransferError(self._errors, self._receiver_fault))
            self._channel.cancel()
            return
        header, payload = encode_commit_frame(self.request_id, self.lease_id, self._frames)
        self._channel.push_commit(header, payload)
        pushed.set_result(None)

    def _run(self, job) -> None:
        try:
            if job is None:
                self._channel.cancel()
            elif isinstance(job, Future):
                self._run_commit(job)
            elif not self._aborted and not self._errors:
                self._run_layer(job)
        # A broken link fails this stream, never the sender thread that other streams share.
        except Exception as e:  # noqa: BLE001
            log.warning("kv stream %s failed: %s: %s", self.lease_id, type(e).__name__, e)
            self._errors.append(f"{type(e).__name__}: {e}")
            self._receiver_fault = self._receiver_fault or is_receiver_fault(e)
            if isinstance(job, Future) and not job.done():
                job.set_exception(TransferError(self._errors, self._receiver_fault))


class KVSender:
    """Streams to one destination endpoint; reuse it across requests."""

    def __init__(self, link: Link, endpoint: str, connect: Callable[[], Link] | None = None):
        self.endpoint = endpoint
        self._link = link
        self._connect = connect  # makes a new link to the endpoint once this one broke
        self._link_lock = threading.Lock()
        self.reconnects = 0  # broken links replaced
        # Streams not yet finished (weak: a stream its caller dropped uncommitted is not
        # "in use"), and when it was last asked for anything: SenderPool closes idle senders.
        self._streams: weakref.WeakSet[KVStream] = weakref.WeakSet()
        self._streams_lock = threading.Lock()
        self._last_used = time.monotonic()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"kv-send {endpoint}", daemon=True)
        self._thread.start()
        self._closed = False

    def open_stream(self, request_id: str, lease_id: str) -> KVStream:
        if self._closed:
            raise RuntimeError(f"sender to {self.endpoint} is closed")
        self.touch()
        link = self._usable_link()
        stream = KVStream(self, request_id, lease_id, link.open_channel(request_id, lease_id))
        with self._streams_lock:
            self._streams.add(stream)
        return stream

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def link_broken(self) -> bool:
        return self._link.broken

    def touch(self) -> None:
        """Mark the sender used now (a pool handing it out does, before its open_stream)."""
        self._last_used = time.monotonic()

    def idle_s(self, now: float | None = None) -> float:
        """Seconds since it was last used, 0 while a stream is unfinished or work queued."""
        with self._streams_lock:
            in_use = any(not s.finished for s in list(self._streams))
        if in_use or not self._jobs.empty():
            return 0.0
        return max(0.0, (time.monotonic() if now is None else now) - self._last_used)

    def _usable_link(self) -> Link:
        """The link, replaced first when it broke (its peer died or restarted): a broken link
        is evicted on the next use instead of failing every later stream. While the peer is
        still gone the connect raises (ConnectionError, OSError, RuntimeError), and the next
        stream tries again."""
        with self._link_lock:
            if self._link.broken and self._connect is not None:
                log.warning("kv link to %s is broken; reconnecting", self.endpoint)
                fresh = self._connect()
                old, self._link = self._link, fresh
                self.reconnects += 1
                _close_quietly(old)
            return self._link

    def close(self) -> None:
        """Finish queued work, stop the sender thread and close the link."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._thread.join()
        with self._link_lock:
            self._link.close()

    def _submit(self, stream: KVStream, job) -> None:
        self._last_used = time.monotonic()
        self._jobs.put((stream, job))

    def _run(self) -> None:
        while True:
            try:
                item = self._jobs.get(timeout=self._link.idle_interval_s)
            except queue.Empty:
                self._ping()
                continue
            if item is None:
                return
            stream, job = item
            stream._run(job)

    def _ping(self) -> None:
        link = self._link
        if link.broken:
            return  # nothing to keep alive; the next stream reconnects
        try:
            link.on_idle()
        # The next stream on this link fails and reports it; nobody waits on a ping.
        except Exception as e:  # noqa: BLE001
            log.warning("kv link to %s failed while idle: %s", self.endpoint, e)


def _cancel_quietly(channel: Channel) -> None:
    try:
        channel.cancel()
    # The commit already failed; a link too broken to carry the abort changes nothing for the
    # caller, who gets that failure as a TransferError, not this.
    except Exception as e:  # noqa: BLE001
        log.info("cancelling a failed kv stream: %s: %s", type(e).__name__, e)


def _close_quietly(link: Link) -> None:
    try:
        link.close()
    # A broken link's peer may be gone: there is nobody to say goodbye to.
    except Exception as e:  # noqa: BLE001
        log.info("closing a broken kv link: %s: %s", type(e).__name__, e)


def make_sender(transport: str, endpoint: str, **opts) -> KVSender:
    """Connect to a receiver server's ``endpoint`` over the named transport; the sender
    reconnects the same way when the link breaks."""
    module = transport_module(transport)

    def connect() -> Link:
        return module.connect(endpoint, **opts)

    return KVSender(connect(), endpoint, connect)


def start_receiver_server(
    transport: str, receiver, host: str = "127.0.0.1", port: int = 0, **opts
) -> ReceiverServer:
    """Serve ``receiver`` on host:port (port 0 picks a free one); see ``.endpoint``."""
    return transport_module(transport).serve(receiver, host, port, **opts)
