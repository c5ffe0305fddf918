"""Paged KV block allocator: pure Python, no torch.

Blocks are reference counted. A block whose count drops to zero goes to the back of an LRU
free queue but keeps its content hash, so a later prompt with the same prefix can take it back
(prefix caching); it is only forgotten when the allocator hands it out for new content.
The free queue is an ``OrderedDict`` so popping the oldest and pulling a cached block out of the
middle are both O(1).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from engine.kv_events import KvEventLog


def blocks_for(num_tokens: int, block_size: int) -> int:
    """The blocks that hold ``num_tokens`` tokens (a partly filled last one counts). Torch-free:
    the router sizes its reservations with it too."""
    return -(-num_tokens // block_size)


def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Hash of a full block chained to its prefix: equal hashes mean equal prefixes."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of every full block of ``token_ids``."""
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


class NoFreeBlocksError(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.num_total = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of_block: dict[int, bytes] = {}
        self._block_of_hash: dict[bytes, int] = {}
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        # What the prefix cache gained and lost, for the router's KV-aware routing.
        self.events = KvEventLog()

    # ---- accounting -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_total

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    # ---- allocation -------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` fresh blocks (ref count 1), evicting cached content if needed."""
        if num_blocks > self.num_free:
            raise NoFreeBlocksError(f"need {num_blocks} blocks, {self.num_free} free")
        blocks = []
        for _ in range(num_blocks):
            block, _ = self._free.popitem(last=False)
            self._forget_hash(block)
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def allocate_for_tokens(
        self, token_ids: Sequence[int], num_tokens: int
    ) -> tuple[list[int], int]:
        """Blocks for the first ``num_tokens`` of a sequence, reusing cached full prefix blocks.

        Returns (block table, number of tokens whose KV is already cached). The block holding
        the last token is never taken from the cache, so at least one token is computed and
        produces logits.
        """
        cached = self.match_prefix(token_ids, max_blocks=(num_tokens - 1) // self.block_size)
        fresh_needed = self.blocks_needed(num_tokens) - len(cached)
        reclaimable = sum(1 for b in cached if self._ref_counts[b] == 0)
        if fresh_needed + reclaimable > self.num_free:
            raise NoFreeBlocksError(
                f"need {fresh_needed + reclaimable} blocks, {self.num_free} free"
            )
        for block in cached:
            self._take_ref(block)
        self.prefix_query_tokens += num_tokens
        self.prefix_hit_tokens += len(cached) * self.block_size
        return cached + self.allocate(fresh_needed), len(cached) * self.block_size

    def match_prefix(self, token_ids: Sequence[int], max_blocks: int) -> list[int]:
        """Cached blocks that hold the longest full-block prefix of ``token_ids``."""
        if not self.enable_prefix_caching or max_blocks <= 0:
            return []
        found = []
        for h in prefix_block_hashes(token_ids[: max_blocks * self.block_size], self.block_size):
            block = self._block_of_hash.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def match_hashes(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks holding the run of ``hashes`` (chained, from the first) held."""
        found = []
        for h in hashes if self.enable_prefix_caching else ():
            block = self._block_of_hash.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def take_cached(self, hashes: Sequence[bytes], num_fresh: int) -> tuple[list[int], int]:
        """The cached blocks holding the run of ``hashes`` (chained block hashes, from the
        first) this cache has, one reference each, then ``num_fresh`` fresh blocks: (the
        blocks, how many were cached). NoFreeBlocksError, taking nothing, if they do not fit."""
        cached = self.match_hashes(hashes)
        reclaimable = sum(1 for b in cached if self._ref_counts[b] == 0)
        if num_fresh + reclaimable > self.num_free:
            raise NoFreeBlocksError(f"need {num_fresh + reclaimable} blocks, {self.num_free} free")
        for block in cached:
            self._take_ref(block)
        self.prefix_query_tokens += len(hashes) * self.block_size
        self.prefix_hit_tokens += len(cached) * self.block_size
        return cached + self.allocate(num_fresh), len(cached)

    def append_slots(self, block_table: list[int], num_tokens: int) -> None:
        """Grow ``block_table`` in place so it can hold ``num_tokens`` tokens."""
        extra = self.blocks_needed(num_tokens) - len(block_table)
        if extra > 0:
            block_table.extend(self.allocate(extra))

    def slots_needed(self, block_table: Sequence[int], num_tokens: int) -> int:
        return max(0, self.blocks_needed(num_tokens) - len(block_table))

    def cache_full_blocks(
        self,
        block_table: Sequence[int],
        block_hashes: list[bytes],
        token_ids: Sequence[int],
        num_computed: int,
    ) -> None:
        """Publish the hashes of blocks that became full of computed KV.

        ``block_hashes`` is the sequence's own list of hashes so far; it is extended in place,
        so each block is hashed once over a request's life.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(block_hashes), num_computed // bs):
            h = block_hash(
                block_hashes[-1] if block_hashes else None, token_ids[i * bs : (i + 1) * bs]
            )
            block_hashes.append(h)
            block = block_table[i]
            # The same content computed twice (two requests in flight): keep the first copy.
            if block not in self._hash_of_block and h not in self._block_of_hash:
                self._hash_of_block[block] = h
                self._block_of_hash[h] = block
                self.events.stored(h)

    def free(self, block_table: Sequence[int]) -> None:
        """Drop one reference to each block; freed blocks keep their hash until reused.

        Freed in reverse so the tail of a sequence is evicted before its shared prefix.
        """
        for block in reversed(block_table):
            count = self._ref_counts[block]
            if count <= 0:
                raise RuntimeError(f"block {block} freed twice")
            self._ref_counts[block] = count - 1
            if count == 1:
                self._free[block] = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash and the hit counters (after a worker's warm-up, whose
        synthetic prompts must neither be matched nor counted)."""
        self._hash_of_block.clear()
        self._block_of_hash.clear()
        self.events.reset()
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    def fork(self, block_table: Sequence[int], num_tokens: int) -> tuple[list[int], int | None]:
        """A second sequence over the first ``num_tokens`` tokens of ``block_table``: its full
        blocks are shared (one more reference each); the partial last block, which both will
        write, gets a fresh block. Returns (the fork's table, that fresh block or None); the
        caller copies the partial block's KV into it."""
        full, partial = divmod(num_tokens, self.block_size)
        if partial and not self.can_allocate(1):
            raise NoFreeBlocksError("no free block for the fork's last partial block")
        shared = list(block_table[:full])
        for block in shared:
            self._take_ref(block)
        if not partial:
            return shared, None
        [fresh] = self.allocate(1)
        return [*shared, fresh], fresh

    def kv_events_since(self, epoch: int, seq: int):
        """engine.kv_events.KvEventDelta since the reader's (epoch, seq) (call under the
        engine's lock)."""
        return self.events.since(epoch, seq, self._block_of_hash.keys())

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    # ---- internals --------------------------------------------------------------------
    def _take_ref(self, block: int) -> None:
        if self._ref_counts[block] == 0:
            del self._free[block]
        self._ref_counts[block] += 1

    def _forget_hash(self, block: int) -> None:
        h = self._hash_of_block.pop(block, None)
        if h is not None:
            del self._block_of_hash[h]
            self.events.removed(h)
