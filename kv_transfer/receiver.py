"""Decode side: validate KV frames against the lease table and write them into the cache."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import kv_fp8
from kernels.kv_blocks import scatter_kv_blocks
from kv_transfer.errors import FrameError
from kv_transfer.frame import FrameHeader, decode_frame
from kv_transfer.lease import Lease, LeaseTable

log = logging.getLogger("pdserve.kv")

# on_event(kind, lease_id, layer): "kv" after a layer's blocks are written, "commit" (layer -1)
# once the lease is complete. Runs on the transport's thread, so keep it short.
EventHook = Callable[[str, str, int], None]


@dataclass(frozen=True)
class RankCache:
    """One tensor-parallel rank's KV cache (per layer: K, V) and the model's KV heads
    [lo, hi) it holds (engine/tensor_parallel.py); a TP=1 worker has one, of every head."""

    heads: tuple[int, int]
    caches: list[tuple[torch.Tensor, torch.Tensor]]


def whole_cache(kv_caches) -> list[RankCache]:
    """A one-rank worker's cache: it holds every KV head (the cache's head dimension)."""
    return [RankCache((0, kv_caches[0][0].shape[2]), kv_caches)]


class KVReceiver:
    """Accepts frames from any transport; one instance per decode worker. ``ranks``: where
    its caches are when the worker is tensor-parallel (a frame's heads are written into each
    rank that holds them, so a sender of any degree fills a receiver of any degree);
    ``kv_caches``: rank 0's (the one-sided transports map that one only)."""

    def __init__(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        leases: LeaseTable,
        on_event: EventHook | None = None,
        pending_lease_wait_s: float = 2.0,
        ranks: list[RankCache] | None = None,
    ):
        self.kv_caches = kv_caches
        self.ranks = ranks or whole_cache(kv_caches)
        self.num_kv_heads = max(hi for _, hi in (r.heads for r in self.ranks))
        if leases.num_heads not in (1, self.num_kv_heads):
            raise ValueError(
                f"leases cover {leases.num_heads} heads; the cache holds {self.num_kv_heads}"
            )
        self.leases = leases
        self.on_event = on_event
        # How long a frame waits for a lease whose reservation is still in flight (the router
        # sends the prefill and the reservation together); a refused one fails it at once.
        self.pending_lease_wait_s = pending_lease_wait_s
        self.frames_accepted = 0
        self.frames_rejected = 0
        self.bytes_received = 0
        # One lock covers lease checks and cache writes; a worker that frees blocks (expiry,
        # release) holds it too, so no frame lands in a block after it was freed.
        self.lock = threading.Lock()

    @property
    def num_layers(self) -> int:
        return len(self.kv_caches)

    def accept(self, header, payload) -> None:
        """Apply one frame; raise FrameError (after logging and counting it) if it is bad."""
        try:
            h, kv = decode_frame(header, payload)  # checksum runs outside the lock
            self.leases.wait_for(h.lease_id, self.pending_lease_wait_s)  # outside it too
            with self.lock:
                lease = self._lease_for(h)
                if h.kind == "commit":
                    self._commit(h, lease)
                else:
                    self._write(h, lease, kv)
                self.frames_accepted += 1
        except FrameError as e:
            with self.lock:
                self.frames_rejected += 1
            log.warning("rejected kv frame: %s", e.reason)
            raise
        if self.on_event is not None:
            self.on_event(h.kind, h.lease_id, h.layer)

    def commit_written(self, commit, verify: Callable[[Lease], str | None] | None = None) -> None:
        """Commit KV that a transport wrote straight into the lease's blocks (nixl):
        ``commit`` (kv_transfer.nixl.commit.NixlCommit) names each write's layer and lease
        positions; they are checked against the lease and the cache and recorded as the
        frames a frame transport would have delivered, ``verify(lease)`` (under the lock, so
        no block is freed meanwhile) may refuse the bytes, then the commit's own checks run
        as for a commit frame. FrameError (counted and logged) when refused; a notification
        for a lease that is gone refuses nothing else."""
        h = commit.header
        try:  # no wait for a pending lease: the writer asked for its blocks, so it was open
            with self.lock:
                lease = self._lease_for(h)
                for layer, positions in commit.writes:
                    self._check_cells(h, lease, layer, positions)
                self._record_writes(lease, commit)
                problem = verify(lease) if verify is not None else None
                if problem is not None:
                    lease.commit_refused = problem
                    raise FrameError(f"{problem} for lease {h.lease_id}")
                self._commit(h, lease)
                self.frames_accepted += len(commit.writes) + 1
        except FrameError as e:
            with self.lock:
                self.frames_rejected += 1
            log.warning("rejected kv commit: %s", e.reason)
            raise
        if self.on_event is not None:
            for layer in sorted({layer for layer, _ in commit.writes}):
                self.on_event("kv", h.lease_id, layer)
            self.on_event("commit", h.lease_id, -1)

    def _check_cells(self, h: FrameHeader, lease: Lease, layer: int, positions) -> None:
        if not 0 <= layer < self.num_layers:
            raise FrameError(f"layer {layer} out of range [0, {self.num_layers})")
        _check_positions(h, lease, positions)

    def _record_writes(self, lease: Lease, commit) -> None:
        for layer, positions in commit.writes:
            lease.cover(layer, positions)
        lease.frames_received += len(commit.writes)
        lease.bytes_received += commit.nbytes
        self.bytes_received += commit.nbytes
        if lease.first_frame_at is None:
            lease.first_frame_at = time.monotonic()

    def pop_expired(self, now: float | None = None) -> list[Lease]:
        """LeaseTable.pop_expired, serialized with writes; workers should call this one."""
        with self.lock:
            return self.leases.pop_expired(now)

    def _lease_for(self, h: FrameHeader) -> Lease:
        lease = self.leases.get(h.lease_id)
        if lease.request_id != h.request_id:
            raise FrameError(f"lease {h.lease_id} belongs to another request")
        if lease.is_committed:
            raise FrameError(f"lease {h.lease_id} already committed")
        if lease.commit_refused is not None:
            raise FrameError(f"lease {h.lease_id} had its commit refused")
        return lease

    def _commit(self, h: FrameHeader, lease: Lease) -> None:
        """Every frame the sender counted arrived, and (where the lease promises it) every
        layer x block has its KV; otherwise the commit is refused, for good: the Decode
        waiting on the lease never runs on stale KV, and the lease keeps its blocks until it
        is released or expires (the sender's failed transfer ends its attempt)."""
        problem = None
        if h.num_frames != lease.frames_received:
            problem = f"expected {h.num_frames} frames, got {lease.frames_received}"
        elif (missing := lease.missing()) is not None:
            problem = f"incomplete commit: {missing}"
        if problem is not None:
            lease.commit_refused = problem
            raise FrameError(f"{problem} for lease {h.lease_id}")
        lease.mark_committed()

    def _write(self, h: FrameHeader, lease: Lease, kv: torch.Tensor) -> None:
        if not 0 <= h.layer < self.num_layers:
            raise FrameError(f"layer {h.layer} out of range [0, {self.num_layers})")
        _check_positions(h, lease, h.blocks)
        lo, hi = self._frame_heads(h)
        k0 = self.ranks[0].caches[h.layer][0]
        expected = (2, len(h.blocks), k0.shape[1], hi - lo, k0.shape[3])
        if tuple(h.shape) != expected:
            raise FrameError(f"shape {list(h.shape)} does not match cache {list(expected)}")
        if kv.dtype != k0.dtype:
            raise FrameError(f"dtype {h.dtype} does not match cache {k0.dtype}")
        block_ids = [lease.block_ids[b] for b in h.blocks]
        for rank in self.ranks:
            _write_heads(kv, (lo, hi), rank, h.layer, block_ids)
        lease.cover(h.layer, h.blocks, None if lease.num_heads == 1 else (lo, hi))
        nbytes = kv.numel() * kv.element_size()
        lease.frames_received += 1
        lease.bytes_received += nbytes
        if lease.first_frame_at is None:
            lease.first_frame_at = time.monotonic()
        self.bytes_received += nbytes

    def _frame_heads(self, h: FrameHeader) -> tuple[int, int]:
        if h.heads is None:
            return 0, self.num_kv_heads
        if h.heads[1] > self.num_kv_heads or (
            self.leases.num_heads == 1 and h.heads != (0, self.num_kv_heads)
        ):
            raise FrameError(f"heads {list(h.heads)} outside the cache's {self.num_kv_heads}")
        return h.heads


def _write_heads(kv: torch.Tensor, heads: tuple[int, int], rank: RankCache, layer, block_ids):
    """Write the part of ``kv`` (the model's KV heads ``heads``) that ``rank`` holds."""
    lo, hi = max(heads[0], rank.heads[0]), min(heads[1], rank.heads[1])
    if lo >= hi:
        return
    k_cache, v_cache = rank.caches[layer]
    if (lo, hi) == heads == rank.heads:  # the frame is this rank's whole slice
        scatter_kv_blocks(kv, k_cache, v_cache, block_ids)
        return
    src = kv_fp8.as_bytes(kv[:, :, :, lo - heads[0] : hi - heads[0]].to(k_cache.device))
    idx = torch.tensor(block_ids, dtype=torch.int64, device=k_cache.device)
    dst = slice(lo - rank.heads[0], hi - rank.heads[0])  # fp8 as bytes: no float8 index_put
    kv_fp8.as_bytes(k_cache)[idx, :, dst] = src[0]
    kv_fp8.as_bytes(v_cache)[idx, :, dst] = src[1]


def _check_positions(h: FrameHeader, lease: Lease, positions) -> None:
    """Frames may fill only the lease's own blocks, and not those holding cached KV."""
    n, first = len(lease.block_ids), lease.first_block
    outside = [b for b in positions if not 0 <= b < n]
    if outside:
        raise FrameError(f"blocks {outside[:8]} outside lease {h.lease_id} of {n} blocks")
    cached = [b for b in positions if b < first]
    if cached:
        raise FrameError(
            f"blocks {cached[:8]} of lease {h.lease_id} hold cached KV (its first {first})"
        )
