"""KV-aware routing's part of a request's flow (policy ``kv_aware``, router/policies.py): what
the policies are given, the decode worker that holds all but a short tail of a prompt (it
prefills the tail itself), and the leading blocks a reservation expects that worker to hold
(no KV is shipped for them: ReserveRequest.block_hashes, KvDestination.first_block).

The router's picture of each worker's cache (router/kv_index.py) may be stale; the decode
worker matches against its own cache, so a stale picture costs a smaller hit or a refused
concurrent reservation (reserved again the safe way), never wrong KV.
"""

from __future__ import annotations

from engine.block_manager import blocks_for
from router.flow.request import FlowRequest
from router.flow.types import FlowConfig
from router.policies import is_kv_aware


def kv_args(cfg: FlowConfig, policy, request: FlowRequest) -> dict:
    """What a kv_aware policy takes beside the workers: the blocks to prefill, hashed."""
    if not is_kv_aware(policy):
        return {}
    return {"hashes": request.block_hashes(cfg.block_size), "block_size": cfg.block_size}


def decode_candidates(cfg: FlowConfig, workers, request: FlowRequest) -> list:
    """The decode pool's candidates for ``request``, in the policy's order."""
    num_blocks = blocks_for(request.num_tokens, cfg.block_size)
    policy = cfg.decode_policy
    return policy(workers, num_blocks, **kv_args(cfg, policy, request))


def holds_all_but_tail(cfg: FlowConfig, workers, request: FlowRequest, prefill_workers=()) -> bool:
    """The decode worker the policy picks holds all of the prompt (as last polled) but a tail
    of at most kv_local_tail_tokens, which it prefills itself: no prefill, no KV shipped.

    Only where it holds more than any prefill worker does (a conversation's history, which it
    decoded): a prefix every worker holds (a system prompt) is no reason to prefill on the
    decode side, whose steps every running stream waits for; that prompt goes to a prefill
    worker, and the blocks the decode worker holds are not shipped."""
    if not is_kv_aware(cfg.decode_policy) or request.sampling.n > 1:
        return False
    candidates = decode_candidates(cfg, workers, request)
    if not candidates:
        return False
    held = expected_cached_blocks(cfg, candidates[0], request)
    hashes = request.block_hashes(cfg.block_size)
    prefill_held = max((w.kv.cached_blocks(hashes) for w in prefill_workers), default=0)
    tail = request.num_tokens - held * cfg.block_size
    return held > prefill_held and tail <= cfg.kv_local_tail_tokens


def expected_cached_blocks(cfg: FlowConfig, worker, request: FlowRequest) -> int:
    """The prompt's leading blocks ``worker`` holds as last polled (0 unless KV-aware), at
    most all but the block of the last token (a transfer always carries that one)."""
    if not is_kv_aware(cfg.decode_policy):
        return 0
    held = worker.kv.cached_blocks(request.block_hashes(cfg.block_size))
    return min(held, (request.num_tokens - 1) // cfg.block_size)


def expected_hashes(cfg: FlowConfig, worker, request: FlowRequest) -> list[bytes]:
    """ReserveRequest.block_hashes for ``worker``: the leading blocks it should hold."""
    k = expected_cached_blocks(cfg, worker, request)
    return request.block_hashes(cfg.block_size)[:k]
