"""The prefill worker's spans of one Prefill call (tracing on only; grpc_plumbing/tracing.py):

  prefill (server; child of the router's prefill span, from the call's traceparent)
  ├── prefill.queue      arrival to the first chunk scheduled
  ├── prefill.chunk      one per chunk: its forward (first token position, tokens)
  └── kv_transfer        first chunk to the decode worker's commit (bytes, frames, transport)

Built from the request's lifecycle marks (``Request.events``) and the job's chunk records, the
points the worker times for the router's timings anyway; nothing else is timed.
"""

from __future__ import annotations

import time


def start_prefill_span(tracing, request, context):
    """The Prefill call's span (Tracing.start_call)."""
    attributes = {
        "gen_ai.request.id": request.request_id,
        "gen_ai.usage.prompt_tokens": len(request.prompt_token_ids),
        "pdserve.prefill.output_tokens_so_far": len(request.output_token_ids),
    }
    return tracing.start_call("prefill", context, attributes)


def record_prefill(tracing, span, job, stats, destination) -> None:
    """The call's children, once the KV is committed (``stats``: the KV stream's)."""
    ev, now = job.req.events, time.monotonic()
    scheduled = ev.get("scheduled", ev["arrived"])
    tracing.record("prefill.queue", span, ev["arrived"], scheduled)
    for start, end, position, tokens in job.chunks or ():
        attributes = {"pdserve.chunk.first_token": position, "pdserve.chunk.tokens": tokens}
        tracing.record("prefill.chunk", span, start, end or now, attributes)
    first_push = job.chunks[0][0] if job.chunks else scheduled
    transfer = {
        "pdserve.kv.bytes": stats.bytes,
        "pdserve.kv.frames": stats.frames,
        "pdserve.kv.transport": destination.transport,
        "pdserve.kv.endpoint": destination.endpoint,
        "pdserve.kv.lease_id": destination.lease_id,
        "pdserve.kv.exposed_s": now - ev["prefilled"],  # not hidden behind the prefill
    }
    tracing.record("kv_transfer", span, first_push, now, transfer)
    span.set_attribute("gen_ai.latency.time_in_queue", scheduled - ev["arrived"])
    span.set_attribute("gen_ai.latency.time_in_model_prefill", ev["prefilled"] - scheduled)
    span.set_attribute("gen_ai.usage.cached_tokens", job.req.num_cached_tokens)
