"""Routing policies, chosen by name. Each picks candidates in order of preference.

A policy marked ``kv_aware`` also takes ``hashes``, the chained block hashes of the tokens to
prefill (engine/block_manager.prefix_block_hashes), and ``block_size``, and reads each worker's cached blocks from
the router's KV index (router/kv_index.py, ``WorkerHandle.kv``).
"""

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


# What a block the decode worker lacks costs against a block its running sequences hold: the
# missing one is prefilled (compute, the first token's wait) and shipped, where a held one only
# adds to each step's KV read, which for most models is small beside the weights.
KV_MISSING_BLOCK_WEIGHT = 4


def _cached_blocks(w: WorkerHandle, hashes: Sequence[bytes]) -> int:
    held = w.kv  # None for the planner's simulated workers: they keep no index
    return held.cached_blocks(hashes) if held is not None and hashes else 0


def kv_aware_prefill(
    workers: Sequence[WorkerHandle],
    prompt: Sequence[int],
    hashes: Sequence[bytes] = (),
    block_size: int = 0,
) -> list[WorkerHandle]:
    """The fewest tokens to compute before this prompt's first token: the prompt tokens the
    router has queued there, plus this prompt's tokens its prefix cache lacks."""

    def cost(w: WorkerHandle) -> tuple[int, int]:
        held = _cached_blocks(w, hashes) * block_size
        return (w.inflight_tokens + len(prompt) - min(held, len(prompt)), w.inflight_requests)

    return sorted(workers, key=cost)


def kv_aware_decode(
    workers: Sequence[WorkerHandle],
    num_blocks: int,
    hashes: Sequence[bytes] = (),
    block_size: int = 0,
) -> list[WorkerHandle]:
    """Dynamo's KV router cost, for the decode pool: the blocks the request would bring in (its
    blocks less those the worker's cache holds: each one shipped or prefilled), weighted, plus
    the blocks running sequences use there (its load). Workers without the room or a free
    stream go last."""

    def cost(w: WorkerHandle) -> tuple[bool, int]:
        new = num_blocks - _cached_blocks(w, hashes)
        room = w.free_blocks >= new and w.has_stream_room()
        return (not room, KV_MISSING_BLOCK_WEIGHT * new + w.total_blocks - w.free_blocks)

    return sorted(workers, key=cost)


kv_aware_prefill.kv_aware = True
kv_aware_decode.kv_aware = True

PREFILL_POLICIES: dict[str, PrefillPolicy] = {
    "least_queued": least_queued_tokens,
    "prefix_affinity": prefix_affinity,
    "round_robin": round_robin_prefill,
    "kv_aware": kv_aware_prefill,
}
DECODE_POLICIES: dict[str, DecodePolicy] = {
    "most_free_blocks": most_free_blocks,
    "round_robin": round_robin_decode,
    "kv_aware": kv_aware_decode,
}


def get_policy(kind: str, name: str):
    table = PREFILL_POLICIES if kind == "prefill" else DECODE_POLICIES
    if name not in table:
        raise ValueError(f"unknown {kind} routing policy {name!r}; known: {sorted(table)}")
    return table[name]


def is_kv_aware(policy) -> bool:
    return getattr(policy, "kv_aware", False)
