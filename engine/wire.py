"""Engine values as wire messages: what both workers send back to the router."""

from __future__ import annotations

from collections.abc import Sequence

from engine.request import TokenLogprob
from protos import pdserve_pb2 as pb


def logprob_message(entry: TokenLogprob) -> pb.TokenLogprobs:
    top = [pb.TopLogprob(token_id=t, logprob=lp) for t, lp in entry.top]
    return pb.TokenLogprobs(logprob=entry.logprob, top=top)


def logprob_messages(entries: Sequence[TokenLogprob] | None) -> list[pb.TokenLogprobs]:
    return [logprob_message(e) for e in entries or ()]


def kv_events_status(blocks, lock, request: pb.StatusRequest) -> dict:
    """WorkerStatus's kv_events field for a Status call that asks for it (the router's KV
    index), as keyword arguments: {} when not asked. ``blocks`` is the worker's BlockManager,
    read under the engine's ``lock``."""
    if not request.kv_events:
        return {}
    with lock:
        delta = blocks.kv_events_since(request.kv_events_epoch, request.kv_events_seq)
    events = pb.KvCacheEvents(
        epoch=delta.epoch,
        seq=delta.seq,
        full=delta.full,
        stored=delta.stored,
        removed=delta.removed,
    )
    return {"kv_events": events}
