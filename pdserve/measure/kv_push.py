"""One prompt's KV pushed over a named transport into a ``KVReceiver``'s cache, timed: what
``pdserve profile`` prices a transfer with, and what ``pdserve bench transfer`` reports against
the loopback limit. All in one process on 127.0.0.1."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

from engine.config import CacheConfig
from kernels.kv_int8 import row_width


@dataclass(frozen=True)
class KVShape:
    """A KV cache shaped like the embedded SmolLM2-135M by default. ``kv_dtype`` is the
    cache's format as the engine stores it: fp32, or int8 rows of head_dim codes plus a 4-byte
    scale (kernels/kv_int8.py), which is what the transports carry."""

    num_layers: int = 30
    block_size: int = CacheConfig.block_size
    num_kv_heads: int = 3
    head_dim: int = 64
    tokens: int = 1024  # the prompt whose KV is pushed
    kv_dtype: str = "fp32"
    # The sender's blocks: "shuffled" (a fragmented cache: no two neighbours in order) or
    # "in-order" (as a fresh prefill's from a free list, so runs can go as one write).
    src_blocks: str = "shuffled"
    # Blocks per layer in each side's cache, the prompt's first (in the source, shuffled or in
    # order); 0 or fewer than the prompt's: the prompt's only. bench transfer gives a worker's
    # default (CacheConfig.num_blocks): a cache only the prompt's size (768 KiB a layer for
    # the embedded model) is smaller than any worker's and, under 2 MiB, one torch does not
    # back with huge pages (engine/hugepages.py), which one-sided WRITEs copy 1.7x slower into.
    cache_blocks: int = 0

    def source_ids(self) -> list[int]:
        """The sender's block of each lease position (random order when shuffled)."""
        if self.src_blocks == "in-order":
            return list(range(self.num_blocks))
        if self.src_blocks != "shuffled":
            raise ValueError(f"src_blocks {self.src_blocks!r}: 'shuffled' or 'in-order'")
        return torch.randperm(self.num_blocks).tolist()

    @property
    def dtype(self) -> torch.dtype:
        return {"int8": torch.int8, "fp8": torch.float8_e4m3fn}.get(self.kv_dtype, torch.float32)

    @property
    def row_width(self) -> int:
        """Elements per token and head in the cache (int8 and fp8 rows end in a 4-byte scale)."""
        return self.head_dim if self.kv_dtype == "fp32" else row_width(self.head_dim)

    @property
    def num_blocks(self) -> int:
        return math.ceil(self.tokens / self.block_size)

    @property
    def bytes_per_push(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_block = self.block_size * self.num_kv_heads * self.row_width * elem
        return 2 * self.num_layers * self.num_blocks * per_block

    def make_cache(self, zero: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, K and V of ``max(cache_blocks, num_blocks)`` blocks; the first
        ``num_blocks`` random unless ``zero``."""
        blocks = max(self.cache_blocks, self.num_blocks)
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.row_width)

        def new():
            cache = torch.zeros((blocks, *shape[1:]), dtype=self.dtype)
            if zero:
                return cache
            if self.kv_dtype != "fp32":  # any bytes: the transports do not interpret them
                cache[: self.num_blocks] = torch.randint(0, 256, shape, dtype=torch.uint8).view(
                    self.dtype
                )
            else:
                cache[: self.num_blocks] = torch.randn(shape)
            return cache

        return [(new(), new()) for _ in range(self.num_layers)]


@dataclass
class TransportResult:
    transport: str
    kv_dtype: str
    bytes_per_push: int
    seconds: list[float]  # one per timed push
    best_mb_s: float  # MB = 1e6 bytes
    median_mb_s: float
    ratio_to_loopback: float  # best_mb_s / loopback best_mb_s
    frames_per_push: int
    bytes_ok: bool  # every push delivered bytes_per_push, and the last one's blocks are equal


def push_once(sender, leases, shape: KVShape, src, src_ids, tag: str):
    """One prompt's KV, all layers, committed; returns (seconds, TransferStats, lease)."""
    dst_ids = list(range(shape.num_blocks))
    lease = leases.open(tag, dst_ids)
    start = time.perf_counter()
    stream = sender.open_stream(tag, lease.lease_id)
    for layer, (k_cache, v_cache) in enumerate(src):
        stream.send_layer(layer, src_ids, range(len(dst_ids)), k_cache, v_cache)
    stats = stream.commit(timeout=120)
    seconds = time.perf_counter() - start
    leases.close(lease.lease_id)
    return seconds, stats, lease


def _blocks_equal(src, dst, src_ids) -> bool:
    """Byte for byte (float8 has no torch.equal on CPU, and random bytes hold NaNs)."""

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if t.element_size() == 1 else t

    n = len(src_ids)  # the lease's blocks are the destination cache's first
    return all(
        torch.equal(raw(kd[:n]), raw(ks[src_ids])) and torch.equal(raw(vd[:n]), raw(vs[src_ids]))
        for (ks, vs), (kd, vd) in zip(src, dst)
    )


def measure_transport(
    name: str, shape: KVShape, repeats: int, loopback_best: float, seed: int = 0
) -> TransportResult:
    from kv_transfer.lease import LeaseTable
    from kv_transfer.receiver import KVReceiver
    from kv_transfer.sender import make_sender, start_receiver_server

    torch.manual_seed(seed)
    src, dst = shape.make_cache(), shape.make_cache(zero=True)
    leases = LeaseTable(default_ttl_s=300.0)
    server = start_receiver_server(name, KVReceiver(dst, leases), host="127.0.0.1")
    sender = make_sender(name, server.endpoint)
    src_ids = shape.source_ids()
    seconds, ok, frames = [], True, 0
    try:
        push_once(sender, leases, shape, src, src_ids, "warmup")  # connects, allocates
        for i in range(repeats):
            sec, stats, lease = push_once(sender, leases, shape, src, src_ids, f"push-{i}")
            seconds.append(sec)
            frames = stats.frames
            ok &= stats.bytes == lease.bytes_received == shape.bytes_per_push
    finally:
        sender.close()  # first: torch_dist pair threads exit on the close
        server.stop()
    ok &= _blocks_equal(src, dst, src_ids)
    rates = [shape.bytes_per_push / s / 1e6 for s in seconds]
    best = max(rates)
    return TransportResult(
        name,
        shape.kv_dtype,
        shape.bytes_per_push,
        seconds,
        best,
        statistics.median(rates),
        best / loopback_best,
        frames,
        ok,
    )
