"""Routing policies, chosen by name. Each picks candidates in order of preference."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

from router.pool import WorkerHandle

PrefillPolicy = Callable[[Sequence[WorkerHandle], Sequence[int]], list[WorkerHandle]]
DecodePolicy = Callable[[Sequence[WorkerHandle], int], list[WorkerHandle]]

# Tokens hashed for prefix affinity: long enough to cover a typical system prompt's first blocks.
AFFINITY_PREFIX_TOKENS = 64
# Affinity yields to load when the preferred worker has this many more queued tokens than the
# least loaded one (a cache hit is worth less than waiting behind a long queue).
AFFINITY_MAX_EXTRA_TOKENS = 2048


def least_queued_tokens(
    workers: Sequence[WorkerHandle], prompt: Sequence[int]
) -> list[WorkerHandle]:
    return sorted(workers, key=lambda w: (w.inflight_tokens, w.inflight_requests))


def prefix_affinity(workers: Sequence[WorkerHandle], prompt: Sequence[int]) -> list[WorkerHandle]:
    """Rendezvous hashing on the prompt's head: one system prompt keeps landing on one worker
    (whose prefix cache holds it), and adding or removing a worker moves few prefixes."""
    if not workers:
        return []
    head = ",".join(map(str, prompt[:AFFINITY_PREFIX_TOKENS])).encode()

    def score(w: WorkerHandle) -> bytes:
        return hashlib.blake2b(head + w.address.encode(), digest_size=8).digest()

    preferred = max(workers, key=score)
    by_load = least_queued_tokens(workers, prompt)
    if preferred.inflight_tokens - by_load[0].inflight_tokens > AFFINITY_MAX_EXTRA_TOKENS:
        return by_load
    return [preferred] + [w for w in by_load if w is not preferred]


def most_free_blocks(workers: Sequence[WorkerHandle], num_blocks: int) -> list[WorkerHandle]:
    fits = [w for w in workers if w.free_blocks >= num_blocks]
    rest = [w for w in workers if w.free_blocks < num_blocks]
    # Workers that seem full are still tried last: the poll may be stale.
    return sorted(fits, key=lambda w: -w.free_blocks) + sorted(rest, key=lambda w: -w.free_blocks)


def round_robin_prefill(
    workers: Sequence[WorkerHandle], prompt: Sequence[int]
) -> list[WorkerHandle]:
    return sorted(workers, key=lambda w: w.served_requests)


def round_robin_decode(workers: Sequence[WorkerHandle], num_blocks: int) -> list[WorkerHandle]:
    return sorted(workers, key=lambda w: w.served_requests)


PREFILL_POLICIES: dict[str, PrefillPolicy] = {
    "least_queued": least_queued_tokens,
    "prefix_affinity": prefix_affinity,
    "round_robin": round_robin_prefill,
}
DECODE_POLICIES: dict[str, DecodePolicy] = {
    "most_free_blocks": most_free_blocks,
    "round_robin": round_robin_decode,
}


def get_policy(kind: str, name: str):
    table = PREFILL_POLICIES if kind == "prefill" else DECODE_POLICIES
    if name not in table:
        raise ValueError(f"unknown {kind} routing policy {name!r}; known: {sorted(table)}")
    return table[name]
