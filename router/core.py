"""The router's request path shared by the gRPC and HTTP front doors: validate, tokenize,
admit, run the flow, detokenize, apply stop strings, count usage."""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.request import SamplingParams, check_token_ids, sampling_from_message
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from grpc_plumbing.tracing import start_tracing
from protos import pdserve_pb2 as pb
from router.drain import Drain, Draining
from router.flow.lifecycle import RequestFlow
from router.flow.request import FlowRequest
from router.flow.trace import RequestTrace
from router.flow.types import FlowConfig, FlowTimings, Overloaded
from router.limits import FirstTokenQueue, check_request_limits
from router.metrics import Metrics
from router.policies import get_policy, is_kv_aware
from router.pool import BreakerSettings, WorkerPool
from router.settings import RouterSettings

MAX_REQUEST_ID_LEN = 256
# Prompt logprobs travel in one message (the first token's): this many entries stay under
# gRPC's default 4 MiB (about 10 bytes each).
MAX_PROMPT_LOGPROB_ENTRIES = 300_000

log = logging.getLogger("pdserve.router")


@dataclass
class Delta:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: pb.Usage | None = None
    timings: FlowTimings | None = None
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)  # per token, when asked
    prompt_logprobs: list[pb.TokenLogprobs] = field(default_factory=list)  # on the first delta
    index: int = 0


@dataclass
class GenerateInput:
    prompt_ids: list[int]
    sampling: pb.SamplingParams
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{uuid.uuid4().hex[:16]}")
    trace_parent: object = None  # the client's trace context (its traceparent), when traced


class Router:
    def __init__(self, cfg: RouterSettings, prefill: list[str], decode: list[str]):
        self.cfg = cfg
        self.tokenizer = Tokenizer(cfg.model_dir)
        breaker = BreakerSettings(max_ejection_percent=cfg.max_ejection_percent)
        self.prefill = WorkerPool("prefill", cfg.cluster_token, cfg.cluster_tls, breaker)
        self.decode = WorkerPool("decode", cfg.cluster_token, cfg.cluster_tls, breaker)
        for address in prefill:
            self.prefill.add(address)
        for address in decode:
            self.decode.add(address)
        flow_cfg = FlowConfig(
            prefill_policy=get_policy("prefill", cfg.prefill_policy),
            decode_policy=get_policy("decode", cfg.decode_policy),
            block_size=cfg.block_size,
            reserve_timeout_s=cfg.reserve_timeout_s,
            local_prefill_max_tokens=cfg.local_prefill_max_tokens,
            kv_local_tail_tokens=cfg.kv_local_tail_tokens,
            concurrent_reserve_headroom=cfg.concurrent_reserve_headroom,
            first_token_timeout_s=cfg.first_token_timeout_s,
            first_token_s_per_token=cfg.first_token_s_per_token,
            token_timeout_s=cfg.token_timeout_s,
        )
        self.flow = RequestFlow(self.prefill, self.decode, flow_cfg)
        # Either pool's KV-aware policy reads both pictures (the decode side's local-tail rule
        # compares what the prefill workers hold).
        kv_aware = is_kv_aware(flow_cfg.prefill_policy) or is_kv_aware(flow_cfg.decode_policy)
        self.prefill.track_kv = self.decode.track_kv = kv_aware
        self.inflight = 0
        self.queue = FirstTokenQueue(cfg.max_queue_wait_s)  # admission's queue deadline
        self._active_ids: set[str] = set()  # workers key aborts and leases by request id
        self._poller: asyncio.Task | None = None
        self._ids = itertools.count()
        # (finish time, ttft_s, tpot_s or None) of recent requests: the autoscaler's signal.
        self.recent_latencies: collections.deque = collections.deque(maxlen=4096)
        self.metrics = Metrics(self, cfg.model_name)
        self.drain = Drain()  # a graceful stop: no admission, then the rest ended (router/drain.py)
        # OpenTelemetry (router/flow/trace.py): None when off, and then no request makes a span.
        self.tracing = start_tracing(cfg.otlp_traces_endpoint, "pdserve-router")

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        await self.refresh()
        self._poller = asyncio.ensure_future(self._poll_forever())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        await self.prefill.close()
        await self.decode.close()
        if self.tracing is not None:  # exports what is batched: off the loop
            await asyncio.to_thread(self.tracing.shutdown)

    async def refresh(self) -> None:
        await asyncio.gather(self.prefill.poll(), self.decode.poll())

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.status_poll_s)
            try:
                await self.refresh()
            except Exception:  # keep polling whatever one round did
                log.exception("status poll failed")

    # ---- pools at runtime (the controller scales them) ---------------------------------
    def _pool(self, role: str) -> WorkerPool:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        return self.prefill if role == "prefill" else self.decode

    async def add_worker(self, role: str, address: str) -> None:
        """The worker joins routing as soon as it answers a status poll."""
        handle = self._pool(role).add(address)
        await self._pool(role)._poll_one(handle, timeout=5.0)

    def drain_worker(self, role: str, address: str) -> None:
        self._pool(role).drain(address)

    async def remove_worker(self, role: str, address: str) -> None:
        await self._pool(role).remove(address)

    def inflight_on(self, role: str, address: str) -> int:
        w = self._pool(role).workers.get(address)
        return 0 if w is None else w.inflight_requests

    def pool_status(self) -> dict:
        def one(w):
            st = w.last_status
            return {
                "address": w.address,
                "healthy": w.healthy,
                "draining": w.draining,
                "circuit": w.circuit,  # the router's circuit breaker: closed | open | half_open
                "failed_in_a_row": w.consecutive_failures,
                "served_requests": w.served_requests,
                "kv_usage": 1 - w.free_blocks / w.total_blocks if w.total_blocks else 0.0,
                "running": st.num_running if st else 0,
                "waiting": st.num_waiting if st else 0,
                "queued_prompt_tokens": st.queued_prompt_tokens if st else 0,
            }

        return {
            "prefill": [one(w) for w in self.prefill.workers.values()],
            "decode": [one(w) for w in self.decode.workers.values()],
            "inflight_requests": self.inflight,
        }

    @property
    def ready(self) -> bool:
        """Every pool has a ready worker (a colocated cluster has only the decode pool)."""
        prefill_ok = bool(self.prefill.routable()) or not self.prefill.workers
        return prefill_ok and bool(self.decode.routable()) and not self.drain.draining

    # ---- input -------------------------------------------------------------------------
    def prepare(
        self,
        prompt_ids: list[int],
        sampling: pb.SamplingParams,
        request_id: str = "",
        trace_carrier=None,
    ) -> GenerateInput:
        """Validate everything a request carries; raises InvalidRequestError naming the field.
        ``trace_carrier``: the HTTP headers or gRPC metadata, read for a W3C traceparent
        while tracing is on."""
        params = sampling_from_message(sampling, self.cfg.default_max_tokens)
        check_request_limits(self.cfg.limits, prompt_ids, params)
        if request_id and ("#" in request_id or len(request_id) > MAX_REQUEST_ID_LEN):
            raise InvalidRequestError(
                "request_id",
                f"must be at most {MAX_REQUEST_ID_LEN} characters without '#' (the router's "
                "separator for retries)",
            )
        if not prompt_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        # prompt, stop_token_ids, logit_bias: every id-keyed parameter, named in its 400
        check_token_ids(self.tokenizer.vocab_size, prompt_ids, params)
        if params.prompt_logprobs is not None:
            entries = len(prompt_ids) * (params.prompt_logprobs + 1)
            if entries > MAX_PROMPT_LOGPROB_ENTRIES:
                raise InvalidRequestError(
                    "logprobs",
                    f"prompt logprobs (echo) of {len(prompt_ids)} positions x "
                    f"{params.prompt_logprobs + 1} exceed {MAX_PROMPT_LOGPROB_ENTRIES} entries "
                    "(they travel in one message); ask for fewer top logprobs",
                )
        if len(prompt_ids) + params.max_tokens > self.cfg.max_model_len:
            param = "prompt" if len(prompt_ids) >= self.cfg.max_model_len else "max_tokens"
            raise InvalidRequestError(
                param,
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context of {self.cfg.max_model_len} tokens",
            )
        wire = pb.SamplingParams()
        wire.CopyFrom(sampling)
        wire.max_tokens = params.max_tokens
        inp = GenerateInput(
            list(prompt_ids), wire, params, request_id or f"req-{uuid.uuid4().hex[:16]}"
        )
        if self.tracing is not None and trace_carrier is not None:
            inp.trace_parent = self.tracing.context_from(trace_carrier)
        return inp

    # ---- the request -------------------------------------------------------------------
    async def generate(self, inp: GenerateInput) -> AsyncIterator[Delta]:
        if inp.request_id in self._active_ids:
            # A second live request under one id would share the first's worker-side state
            # (aborts, leases) and could cancel it: refused, as vLLM does.
            raise InvalidRequestError("request_id", f"{inp.request_id!r} is already in flight")
        trace = (
            None if self.tracing is None else RequestTrace(self.tracing, inp, self.cfg.model_name)
        )
        try:
            self._admit(trace)
        except (Draining, Overloaded) as e:
            if trace is not None:
                trace.end(e)
            raise
        self.inflight += 1
        self._active_ids.add(inp.request_id)
        tracker = self.metrics.track()
        ticket = self.queue.enter()
        deltas = self._generate(inp, trace)
        try:
            # the items of ``deltas`` (None at the end); a WorkerFailure once a drain's grace is over
            while (delta := await self.drain.next(deltas)) is not None:
                self.queue.served(ticket)
                tracker.on_delta(delta)
                if trace is not None and delta.usage is not None:
                    trace.finish(delta)
                yield delta
        except Overloaded:
            self.metrics.rejected.inc()
            raise
        finally:
            self.queue.leave(ticket)
            self.inflight -= 1
            self._active_ids.discard(inp.request_id)
            if trace is not None:
                trace.end(sys.exc_info()[1])

    def _admit(self, trace) -> None:
        """Admission: raise Draining or Overloaded (counted as rejected) where the request may
        not start now."""
        if self.drain.draining:  # stopping: 429 / UNAVAILABLE with retry-after
            self.metrics.rejected.inc()
            if trace is not None:
                trace.refused("draining")
            raise Draining()
        full = self.queue.full() or self._decode_streams_full()
        if self.inflight >= self.cfg.max_inflight_requests:
            full = f"{self.inflight} requests in flight (max {self.cfg.max_inflight_requests})"
        if full is not None:
            self.metrics.rejected.inc()
            if trace is not None:
                trace.refused(full)
            raise Overloaded(full, self.queue.retry_after_s())
        if trace is not None:
            trace.admitted(self.inflight)

    def _decode_streams_full(self) -> str | None:
        """Every request ends on a decode worker, holding one of its streams (a worker refuses
        past its budget): with as many in the router as the routable decode workers have
        streams, a new one would be refused after its wait; refuse it now instead. None when
        there is room, or a worker does not say its budget (then its own refusal decides)."""
        workers = self.decode.routable()
        budgets = [w.last_status.max_streams if w.last_status else 0 for w in workers]
        if not workers or not all(budgets) or self.inflight < sum(budgets):
            return None
        return f"{self.inflight} requests in flight fill the decode pool's {sum(budgets)} streams"

    async def _generate(self, inp: GenerateInput, trace=None) -> AsyncIterator[Delta]:
        """Deltas of the request's n sequences; each one's last has its finish reason, and
        the request's last has the usage (summed over sequences) and timings too."""
        timings = FlowTimings()
        start = time.monotonic()
        params = inp.params
        texts = [_StopText(self.tokenizer, params) for _ in range(params.n)]
        running = set(range(inp.params.n))
        n_out = 0
        request = FlowRequest(inp.request_id, inp.prompt_ids, inp.sampling, timings, trace=trace)
        flow = self.flow.run(request)
        try:
            async for item in flow:
                i, tokens, reason, logprobs = item.index, item.ids, item.reason, item.logprobs
                if i not in running:  # stopped here by a stop string; the rest is dropped
                    continue
                delta_text, used = texts[i].push(tokens, final=reason is not None)
                if used is not None:
                    reason, tokens, logprobs = "stop", tokens[:used], logprobs[:used]
                n_out += len(tokens)
                lp = {"logprobs": logprobs, "prompt_logprobs": item.prompt_logprobs}
                if reason is not None:
                    running.discard(i)
                if reason is None or running:
                    yield Delta(tokens, delta_text, reason, index=i, **lp)
                    continue
                usage = pb.Usage(
                    prompt_tokens=len(inp.prompt_ids),
                    completion_tokens=n_out,
                    cached_prompt_tokens=timings.cached_tokens,
                )
                timings.e2e_s = time.monotonic() - start
                tpot = (timings.e2e_s - timings.ttft_s) / (n_out - 1) if n_out > 1 else None
                self.recent_latencies.append(  # the autoscaler's window (planner mode: lengths)
                    (time.monotonic(), timings.ttft_s, tpot, start, len(inp.prompt_ids), n_out)
                )
                yield Delta(tokens, delta_text, reason, usage, timings, index=i, **lp)
                return
        finally:
            await flow.aclose()


class _StopText:
    """Detokenizes and applies stop strings, holding back text that may start a stop string;
    the text ends before the first stop string (after it with ``include_stop_str_in_output``)
    and shows special tokens only without ``skip_special_tokens`` (vLLM's both)."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams):
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.stops = stops = params.stop
        self.keep = params.include_stop_str_in_output
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = 0

    def push(self, tokens: list[int], final: bool) -> tuple[str, int | None]:
        """The text to send for ``tokens`` and, once a stop string appears, how many of them
        it took: the tokens after the one that completes it are dropped (as vLLM, which stops
        there), so logprobs and usage match the text."""
        for i, t in enumerate(tokens):
            start = max(0, len(self.detok.text) - self.hold)  # a stop may begin this far back
            self.detok.push(t)
            idx = self._find_stop(start)
            if idx is not None:
                return self._emit(self.detok.text[:idx]), i + 1
        text = self.detok.text
        return self._emit(text if final else text[: max(self.sent, len(text) - self.hold)]), None

    def _find_stop(self, start: int) -> int | None:
        """Where the text ends at the earliest stop string (None: none yet); of stops that
        begin there, the first listed."""
        found = [
            (i, i + len(stop) if self.keep else i)
            for stop in self.stops
            if (i := self.detok.text.find(stop, start)) >= 0
        ]
        return min(found, key=lambda f: f[0])[1] if found else None

    def _emit(self, upto: str) -> str:
        delta = upto[self.sent :]
        self.sent = max(self.sent, len(upto))
        return delta
