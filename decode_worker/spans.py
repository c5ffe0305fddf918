"""The decode worker's spans of one Decode call (tracing on only; grpc_plumbing/tracing.py):

  decode (server; child of the router's decode span, from the call's traceparent)
  ├── decode.kv_wait     on a lease: the call's arrival to the lease's KV complete
  ├── decode.queue       KV complete (or arrival) to the first decode step
  └── decode.run         the first decode step to the sequence's end

Built from the request's lifecycle marks (``Request.events``), the points the worker times
for the router's decode_queue_s anyway; nothing else is timed.
"""

from __future__ import annotations

import time


def start_decode_span(tracing, request, context):
    """The Decode call's span (Tracing.start_call)."""
    attributes = {
        "gen_ai.request.id": request.request_id,
        "gen_ai.request.max_tokens": request.sampling.max_tokens,
        "gen_ai.request.n": max(1, request.sampling.n),
        "pdserve.decode.lease_id": request.lease_id,
        "pdserve.decode.prefills_locally": not request.lease_id,
    }
    return tracing.start_call("decode", context, attributes)


def record_decode(tracing, span, req) -> None:
    """The call's children, as it ends (``req``: the engine's request, or None if the call
    ended before it joined the batch)."""
    if req is None:
        return
    ev, now = req.events, time.monotonic()
    ready = ev.get("kv_ready", ev["arrived"])
    if "kv_ready" in ev:
        tracing.record("decode.kv_wait", span, ev["arrived"], ready)
    if "scheduled" not in ev:
        return
    tracing.record("decode.queue", span, ready, ev["scheduled"])
    end = ev.get("finished", now)
    # The sequence's output tokens, those of earlier attempts (sent in the call) included.
    outputs = {"pdserve.decode.output_tokens": len(req.output_token_ids)}
    tracing.record("decode.run", span, ev["scheduled"], end, outputs)
    span.set_attribute("gen_ai.latency.time_in_queue", ev["scheduled"] - ready)
    span.set_attribute("gen_ai.latency.time_in_model_decode", end - ev["scheduled"])
