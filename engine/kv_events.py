"""What a worker's prefix cache gained and lost, for the router's KV index (router/kv_index.py).

The block manager reports each block hash it publishes (its KV is computed and may be matched)
and each it forgets (the block was handed out for new content); the router follows with deltas
on its status polls: "what changed since event N of epoch E". A router that fell behind the
log, or a worker that restarted or reset its cache (a new epoch), gets the whole set instead.
Torch-free; the block manager calls it under the engine's lock, Status reads it under the same.

Stale knowledge on the router's side costs a smaller cache hit, never a wrong output: a hash
names the whole token prefix up to its block, and the worker matches prompts against its own
cache, not against the router's picture of it.
"""

from __future__ import annotations

import secrets
from collections import deque
from dataclasses import dataclass, field

# Events kept for deltas: a router polling every 0.1 s sees a few dozen per poll; one that
# misses more than this resynchronises from the whole set.
MAX_EVENTS = 65536


@dataclass
class KvEventDelta:
    """What changed since the asker's (epoch, seq): hashes now held and hashes now gone (net of
    the events between), or with ``full`` every hash held now (stored) and nothing else."""

    epoch: int
    seq: int
    full: bool
    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)


class KvEventLog:
    def __init__(self, max_events: int = MAX_EVENTS):
        self.epoch = secrets.randbits(63) or 1  # 0 is the router's "nothing yet"
        self.seq = 0  # events so far in this epoch
        self._events: deque[tuple[int, bool, bytes]] = deque(maxlen=max_events)

    def stored(self, block_hash: bytes) -> None:
        self._add(True, block_hash)

    def removed(self, block_hash: bytes) -> None:
        self._add(False, block_hash)

    def reset(self) -> None:
        """Everything forgotten at once (after warm-up): a new epoch, so readers resync."""
        self.epoch = secrets.randbits(63) or 1
        self.seq = 0
        self._events.clear()

    def _add(self, stored: bool, block_hash: bytes) -> None:
        self.seq += 1
        self._events.append((self.seq, stored, block_hash))

    def since(self, epoch: int, seq: int, held) -> KvEventDelta:
        """The delta after event ``seq`` of ``epoch``; the whole set ``held`` (an iterable of
        the hashes held now) when that point is not in the log any more."""
        oldest = self._events[0][0] if self._events else self.seq + 1
        if epoch != self.epoch or seq > self.seq or seq + 1 < oldest:
            return KvEventDelta(self.epoch, self.seq, True, list(held))
        net: dict[bytes, bool] = {}
        for event_seq, stored, block_hash in reversed(self._events):
            if event_seq <= seq:
                break
            net.setdefault(block_hash, stored)  # the last event of a hash decides
        stored_now = [h for h, s in net.items() if s]
        removed_now = [h for h, s in net.items() if not s]
        return KvEventDelta(self.epoch, self.seq, False, stored_now, removed_now)
