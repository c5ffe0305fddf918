"""One request's spans at the router (made only while tracing is on: the flow holds None
otherwise, and each span point is one ``is None`` check). grpc_plumbing/tracing.py exports
them; the workers add theirs under the router's calls (traceparent in the call's metadata):

  llm_request (server; child of the HTTP client's or gRPC caller's traceparent, if any)
  ├── admission
  ├── attempt            one per attempt: a migrated request has two or more, siblings
  │   ├── reserve        the reservation: Reserve calls until one gives a lease (client)
  │   ├── prefill        the Prefill call, to its TransferDone (client) -> the prefill worker's
  │   └── decode         the Decode call, to the stream's end (client) -> the decode worker's
  └── attempt ...

The attributes reuse what the router measures anyway (``FlowTimings``); names follow vLLM's
(``gen_ai.*``) where they overlap.
"""

from __future__ import annotations

import asyncio

from router.flow.types import AttemptOutcome


class RequestTrace:
    def __init__(self, tracing, inp, model_name: str):
        self.tracing = tracing
        params = inp.params
        attributes = {
            "gen_ai.request.id": inp.request_id,
            "gen_ai.response.model": model_name,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.n": params.n,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.usage.prompt_tokens": len(inp.prompt_ids),
        }
        self.root = tracing.start("llm_request", inp.trace_parent, "server", attributes)
        self.admission = tracing.start("admission", self.root)
        self.finished = False  # the last delta is out

    def admitted(self, inflight: int) -> None:
        self.admission.set_attribute("pdserve.admission.inflight", inflight)
        self.tracing.end(self.admission)

    def refused(self, reason: str) -> None:
        self.admission.set_attribute("pdserve.admission.refused", reason)
        self.tracing.end(self.admission, reason)

    def finish(self, delta) -> None:
        """The request's last delta is out: its usage and timings onto the request span."""
        t, span = delta.timings, self.root
        self.finished = True
        span.set_attribute("gen_ai.usage.completion_tokens", delta.usage.completion_tokens)
        span.set_attribute("gen_ai.usage.cached_tokens", delta.usage.cached_prompt_tokens)
        span.set_attribute("gen_ai.latency.time_to_first_token", t.ttft_s)
        span.set_attribute("gen_ai.latency.e2e", t.e2e_s)
        span.set_attribute("gen_ai.latency.time_in_queue", t.prefill_queue_s)
        span.set_attribute("gen_ai.latency.time_in_model_prefill", t.prefill_s)
        span.set_attribute("pdserve.latency.kv_transfer_exposed", t.kv_transfer_s)
        span.set_attribute("pdserve.latency.decode_queue", t.decode_queue_s)
        span.set_attribute("pdserve.kv.bytes", t.kv_bytes)
        span.set_attribute("pdserve.migrations", t.migrations)
        span.set_attribute("pdserve.preemptions", t.preemptions)
        if delta.finish_reason:
            span.set_attribute("gen_ai.response.finish_reasons", (delta.finish_reason,))

    def end(self, error: BaseException | None) -> None:
        """The request is over; ``error``: what ended it, if not its last delta. (A stream
        closed after its last delta ends with GeneratorExit: not an error.)"""
        if self.finished:
            error = None
        elif isinstance(error, (GeneratorExit, asyncio.CancelledError)):
            error = "cancelled before its end (the client left)"
        self.tracing.end(self.admission)  # ended already unless admission itself raised
        self.tracing.end(self.root, error)

    # ---- attempts and their worker calls ---------------------------------------------------
    def start_attempt(self, attempt, number: int) -> None:
        attributes = {
            "pdserve.attempt.id": attempt.attempt_id,
            "pdserve.attempt.number": number,
            "pdserve.attempt.local_prefill": attempt.local,
            "pdserve.attempt.concurrent_reserve": attempt.concurrent,
        }
        attempt.span = self.tracing.start("attempt", self.root, attributes=attributes)

    def end_attempt(self, attempt) -> None:
        span = attempt.span
        if span is None:
            return
        outcome = attempt.outcome
        span.set_attribute("pdserve.attempt.outcome", outcome.value if outcome else "ended")
        for role, worker in (("prefill", attempt.prefill), ("decode", attempt.decode)):
            if worker is not None:
                span.set_attribute(f"pdserve.{role}.worker", worker.address)
        failed = outcome is not None and (outcome.migrates or outcome is AttemptOutcome.FAILED)
        self.tracing.end(span, (attempt.ended or outcome.value) if failed else None)

    def call(self, name: str, attempt, worker) -> tuple[tuple[str, str], ...]:
        """A worker call's span under the attempt (ended by the attempt's cleanup, if not
        before); returns the call's metadata carrying it (traceparent)."""
        span = self.tracing.start(name, attempt.span, "client", {"pdserve.worker": worker.address})
        attempt.spans.append(span)
        return self.tracing.metadata(span)

    def call_span(self, attempt, name: str):
        """The attempt's latest call span named ``name``."""
        return next(s for s in reversed(attempt.spans) if s.name == name)

    def reserve(self, attempt):
        """The reservation's span: the decode-first Reserve calls, until one gives a lease."""
        span = self.tracing.start("reserve", attempt.span, "client")
        attempt.spans.append(span)
        return span

    def leased(self, span, worker, lease) -> None:
        span.set_attribute("pdserve.worker", worker.address)
        span.set_attribute("pdserve.kv.lease_id", lease.lease_id)
        span.set_attribute("pdserve.kv.blocks", len(lease.block_ids))
        self.tracing.end(span)

    def reservation(self, attempt, worker, future) -> None:
        """A concurrent Reserve sent without waiting: its span ends with its answer."""
        self.call("reserve", attempt, worker)
        span = attempt.spans[-1]

        def answered(f) -> None:
            refused = f.cancelled() or f.exception() is not None
            self.tracing.end(span, "refused" if refused else None)

        future.add_done_callback(answered)
