"""The router's picture of what each worker's prefix cache holds, for KV-aware routing.

Each worker keeps a log of the block hashes its cache gained and lost (engine/kv_events.py);
the router's status poll asks for what changed since the last one and applies it here. A hash
(engine/block_manager.block_hash) names a whole token prefix up to its block, so the cached
prefix of a prompt on a worker is the run of the prompt's hashes, from the first, it holds.

The picture lags the worker by one poll and may be wrong (a block evicted since): routing on it
costs at most a smaller hit, because the worker matches the prompt against its own cache.
"""

from __future__ import annotations

from collections.abc import Sequence

from protos import pdserve_pb2 as pb

# Hashes kept per worker at most: a bound on the router's memory whatever a worker reports
# (16 bytes each; a worker's cache holds far fewer blocks).
MAX_HASHES_PER_WORKER = 1 << 20


class HeldBlocks:
    """One worker's cached block hashes, as of its last status poll."""

    def __init__(self):
        self.epoch = 0  # 0: nothing known yet (the first poll asks for the whole set)
        self.seq = 0
        self.hashes: set[bytes] = set()

    def request_fields(self) -> dict:
        """StatusRequest fields asking for what changed since the last poll."""
        return {"kv_events": True, "kv_events_epoch": self.epoch, "kv_events_seq": self.seq}

    def apply(self, events: pb.KvCacheEvents) -> None:
        if events.epoch == 0:  # a worker that keeps no log
            return
        if events.full:
            self.hashes = set(events.stored)
        else:
            self.hashes.difference_update(events.removed)
            self.hashes.update(events.stored)
        if len(self.hashes) > MAX_HASHES_PER_WORKER:
            self.hashes.clear()  # a worker that reports nonsense gets no affinity
        self.epoch, self.seq = events.epoch, events.seq

    def forget(self) -> None:
        """The worker was lost or restarted: it holds nothing the router knows of."""
        self.epoch, self.seq = 0, 0
        self.hashes.clear()

    def cached_blocks(self, hashes: Sequence[bytes]) -> int:
        """How many of a prompt's leading full blocks (``hashes``, chained) this worker holds."""
        n = 0
        for h in hashes:
            if h not in self.hashes:
                break
            n += 1
        return n
