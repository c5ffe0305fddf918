"""One request's path through the cluster, decode-first:

  Reserve blocks on a decode worker -> Prefill on a prefill worker toward that lease
  -> first token out as soon as it is sampled -> Decode streams the rest.

When the decode worker had room to spare at the last poll, Prefill and Reserve go out together,
Prefill first (the router names the lease, frames name blocks by position in it, and the decode
side holds an early frame until the lease opens). The first token leaves as soon as it is
sampled, without waiting for the reservation's answer: Decode starts once the lease is confirmed.
A refused reservation drops that prefill's KV and the request goes around again the safe way,
reserve first, with the token already sent appended to its prompt (as after a preemption). So a
prefill never feeds a full pool, and the reservation's round trip stays off the first token.

Or, colocated (no prefill worker up, or a prompt short enough to skip the transfer): Decode
without a lease, and the decode worker prefills the request in its own batch.

A decode worker that runs out of blocks preempts a request ("preempted"); it comes back here and
goes around again with its generated tokens appended (recompute). The same retry covers a KV
transfer that failed after the first token.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from engine.block_manager import blocks_for
from protos import pdserve_pb2 as pb
from router.flow_attempt import (
    Attempt,
    stream_tokens,
    transfer_done,
    wait_first_chunk_or_lost_transfer,
)
from router.flow_types import (  # FlowConfig, Overloaded, ... are still imported from here
    PREEMPTED,
    REFUSED,
    WORKER_LOST,
    FlowConfig,
    FlowTimings,
    Overloaded,
    Tokens,
    WorkerFailure,
    WorkerLost,
    lost_or_raise,
    sequence_sampling,
    without_prompt_logprobs,
)
from router.pool import WorkerPool

log = logging.getLogger("pdserve.router")

RESERVE_CALL_TIMEOUT_S = 5.0  # one Reserve call; the reservation as a whole has its own limit


class RequestFlow:
    def __init__(self, prefill: WorkerPool, decode: WorkerPool, cfg: FlowConfig):
        self.prefill = prefill
        self.decode = decode
        self.cfg = cfg

    async def run(
        self,
        request_id: str,
        prompt: list[int],
        sampling: pb.SamplingParams,
        timings: FlowTimings,
        outputs: list[int] | None = None,
    ) -> AsyncIterator[Tokens]:
        """Yield new tokens until the request finishes (a ``Tokens`` with its reason; with
        n > 1, one per sequence). ``outputs``: tokens generated before, kept."""
        if sampling.n > 1:
            async for item in self._run_n(request_id, prompt, sampling, timings):
                yield item
            return
        outputs = [] if outputs is None else outputs
        start = time.monotonic()
        reason = None
        for i in range(self.cfg.max_attempts):
            n_tokens = len(prompt) + len(outputs)
            path = self._local
            if not self.prefill_locally(n_tokens):
                # After a refused concurrent reservation, the safe way: reserve first.
                path = functools.partial(self._disaggregated, concurrent=reason != REFUSED)
            # Workers abort by request id when a call ends, and that can land after the next
            # attempt arrived: each attempt goes under its own id.
            # '#' is the router's own: client ids may not hold it (Router.prepare).
            attempt_id = request_id if i == 0 else f"{request_id}#{i}"
            steps = path(attempt_id, prompt, outputs, sampling, timings)
            reason = None
            try:
                async for item in steps:
                    reason = item.reason
                    if item.ids and not timings.ttft_s:
                        timings.ttft_s = time.monotonic() - start
                    if item.prompt_logprobs:  # computed once: later attempts need not again
                        sampling = without_prompt_logprobs(sampling)
                    if reason in (PREEMPTED, REFUSED):
                        if item.ids:  # generated before the preemption: already in outputs
                            item.reason = None
                            yield item
                        break
                    yield item
                    if reason:
                        return
            except WorkerLost as lost:
                # Migration: the tokens streamed so far stay (outputs), the next attempt
                # prefills prompt + outputs elsewhere, and the client's stream goes on.
                reason = self._migrate(request_id, lost, timings)
            finally:
                await steps.aclose()
            if reason not in (REFUSED, WORKER_LOST):
                timings.preemptions += 1
            why = reason or "attempt ended early"
            log.info("%s: %s after %d tokens; prefilling again", request_id, why, len(outputs))
        raise WorkerFailure(f"{request_id}: gave up after {self.cfg.max_attempts} attempts")

    async def _run_n(self, request_id, prompt, sampling, timings) -> AsyncIterator[Tokens]:
        """n sequences from one prefill: the decode worker forks the prompt's KV. A sequence
        the attempt does not finish (preempted, or a fork that found no free block) goes
        around again on its own, seeded seed + i, with its tokens kept."""
        n, start = sampling.n, time.monotonic()
        outputs = [[] for _ in range(n)]  # index 0's is extended by the path itself
        finished = [False] * n
        path = self._local
        if not self.prefill_locally(len(prompt)):  # reserve first: forks grow past the lease
            path = functools.partial(self._disaggregated, concurrent=False)
        steps = path(request_id, prompt, outputs[0], sampling, timings)
        try:
            async for item in steps:
                if item.ids and not timings.ttft_s:
                    timings.ttft_s = time.monotonic() - start
                if item.index:
                    outputs[item.index].extend(item.ids)
                if item.reason == PREEMPTED:
                    item.reason = None
                    timings.preemptions += 1
                finished[item.index] = finished[item.index] or item.reason is not None
                yield item
        except WorkerLost as lost:  # every unfinished sequence goes around on its own
            self._migrate(request_id, lost, timings)
        finally:
            await steps.aclose()
        for i in (i for i in range(n) if not finished[i]):
            alone = sequence_sampling(sampling, i)
            flow = self.run(f"{request_id}#n{i}", prompt, alone, timings, outputs[i])
            try:
                async for item in flow:
                    item.index = i
                    yield item
            finally:
                await flow.aclose()

    def _migrate(self, request_id: str, lost: WorkerLost, timings: FlowTimings) -> str:
        """Count a lost attempt, keep new work off its worker until the next polls, and say
        why the request goes around again (WorkerFailure once migrations are used up)."""
        lost.worker.mark_failed()
        timings.migrations += 1
        if timings.migrations > self.cfg.max_migrations:
            raise WorkerFailure(
                f"{request_id}: {lost} (after {self.cfg.max_migrations} migrations)"
            ) from lost
        log.warning("%s: %s; migrating", request_id, lost)
        return WORKER_LOST

    def prefill_locally(self, num_tokens: int) -> bool:
        """Colocated pool (no prefill worker up), or a prompt too short to be worth a transfer."""
        return not self.prefill.routable() or num_tokens <= self.cfg.local_prefill_max_tokens

    async def _disaggregated(self, request_id, prompt, outputs, sampling, timings, concurrent):
        args = (request_id, prompt, outputs, sampling, timings)
        attempt, first = await self._reserve_and_prefill(*args, concurrent=concurrent)
        try:
            outputs.append(first.token_id)
            logprobs = [first.logprobs] if first.HasField("logprobs") else []
            yield Tokens([first.token_id], None, logprobs, list(first.prompt_logprobs))
            forks = list(first.fork_token_ids)  # n > 1: sampled from the same prefill
            for i, token in enumerate(forks, 1):
                lp = [first.fork_logprobs[i - 1]] if first.fork_logprobs else []
                yield Tokens([token], None, lp, index=i)
            decode = self._decode(attempt, request_id, prompt, outputs, sampling, timings, forks)
            async for item in decode:
                yield item
        finally:
            await attempt.cleanup()

    async def _local(self, request_id, prompt, outputs, sampling, timings):
        """No lease: the decode worker prefills (its scheduler mixes the chunks into decode)."""
        num_blocks = blocks_for(len(prompt) + len(outputs), self.cfg.block_size)
        req = pb.DecodeRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            output_token_ids=outputs,
            sampling=sampling,
        )
        for w in self.cfg.decode_policy(self.decode.routable(), num_blocks):
            w.served_requests += 1
            w.inflight_requests += 1
            call = w.stub.Decode(req)
            try:
                async for item in stream_tokens(call, outputs, timings):
                    yield item
                w.mark_succeeded()
                return
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:  # draining: try the next one
                    raise lost_or_raise(w, e) from e
            finally:
                w.inflight_requests -= 1
                call.cancel()
        raise Overloaded("no decode worker accepted the request")

    # ---- steps -------------------------------------------------------------------------
    async def _reserve_and_prefill(
        self, request_id, prompt, outputs, sampling, timings, concurrent
    ):
        """Reserve decode blocks and prefill toward them; returns (attempt, first token).
        On the concurrent path the reservation may still be unanswered: see _decode."""
        args = (request_id, prompt, outputs, sampling, timings)
        num_tokens = len(prompt) + len(outputs)
        attempt = self._plan_concurrent(num_tokens) if concurrent else None
        if attempt is not None:
            try:
                reserve = functools.partial(self._send_reservation, attempt, request_id, num_tokens)
                return attempt, await self._prefill(attempt, *args, after_send=reserve)
            except (grpc.aio.AioRpcError, WorkerLost):
                # A refused lease fails the prefill's transfer, which may end the prefill
                # before its first token: that is the refusal, not a prefill failure.
                if attempt.reservation is None or await attempt.lease() is not None:
                    await attempt.cleanup()
                    raise
            except BaseException:
                await attempt.cleanup()
                raise
            await attempt.cleanup()  # drops that prefill and its frames
            log.info("%s: %s refused the reservation", request_id, attempt.decode.address)
            # A new id at the prefill worker: see run(), the dropped prefill's abort may lag.
            args = (f"{request_id}#r", *args[1:])
        attempt = await self._reserve(args[0], num_tokens)
        try:
            return attempt, await self._prefill(attempt, *args)
        except BaseException:
            await attempt.cleanup()
            raise

    def _plan_concurrent(self, num_tokens: int) -> Attempt | None:
        """A decode worker that had room to spare at the last poll, and the lease the router
        names there (not yet reserved); None where none has."""
        headroom = self.cfg.concurrent_reserve_headroom
        num_blocks = blocks_for(num_tokens, self.cfg.block_size)
        if headroom < 0:
            return None
        for w in self.cfg.decode_policy(self.decode.routable(), num_blocks):
            st = w.last_status
            if st is None or not st.kv_endpoint or st.block_size != self.cfg.block_size:
                continue  # a worker that does not say where its KV goes, or sizes differ
            if w.free_blocks - num_blocks < headroom * w.total_blocks:
                continue
            dest = pb.KvDestination(
                endpoint=st.kv_endpoint,
                transport=st.kv_transport,
                lease_id=uuid.uuid4().hex,
                block_size=st.block_size,
                num_blocks=num_blocks,
            )
            return Attempt(w, dest, None)
        return None

    def _send_reservation(self, attempt: Attempt, request_id: str, num_tokens: int) -> None:
        """Reserve the planned lease without waiting for the answer (sent just after the
        Prefill, so the prefill worker starts first)."""
        w = attempt.decode
        req = pb.ReserveRequest(
            request_id=request_id, num_tokens=num_tokens, lease_id=attempt.lease_id
        )
        reserve = w.stub.Reserve(req, timeout=self.cfg.reserve_timeout_s)
        w.free_blocks -= attempt.destination.num_blocks
        w.served_requests += 1
        attempt.reservation = asyncio.ensure_future(reserve)

    async def _reserve(self, request_id: str, num_tokens: int) -> Attempt:
        """Decode first: never prefill into a pool that has no room. Waits, then 429."""
        deadline = time.monotonic() + self.cfg.reserve_timeout_s
        num_blocks = blocks_for(num_tokens, self.cfg.block_size)
        delay = 0.005
        while True:
            for w in self.cfg.decode_policy(self.decode.routable(), num_blocks):
                try:
                    lease = await w.stub.Reserve(
                        pb.ReserveRequest(request_id=request_id, num_tokens=num_tokens),
                        timeout=RESERVE_CALL_TIMEOUT_S,  # a hung worker: try the next one
                    )
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                        raise
                    continue
                w.free_blocks -= len(lease.block_ids)
                w.served_requests += 1
                dest = pb.KvDestination(
                    endpoint=lease.kv_endpoint,
                    transport=lease.kv_transport,
                    lease_id=lease.lease_id,
                    block_size=lease.block_size,
                    num_blocks=len(lease.block_ids),
                )
                done = asyncio.get_running_loop().create_future()
                done.set_result(lease)
                return Attempt(w, dest, done)
            if time.monotonic() > deadline:
                raise Overloaded(f"no decode worker could hold {num_tokens} tokens of KV")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)

    async def _prefill(
        self, attempt, request_id, prompt, outputs, sampling, timings, after_send=None
    ) -> pb.FirstToken:
        """Prefill toward the attempt's lease; returns the first token. ``after_send`` runs
        once the Prefill call is on its way, before its first event is awaited."""
        candidates = self.cfg.prefill_policy(self.prefill.routable(), prompt)
        if not candidates:
            # Routable when the attempt began, not now: a prefill worker too busy to answer its
            # status poll in time (overload), or one just lost (the next request prefills on
            # the decode side). Either way the client should come back shortly: 429.
            raise Overloaded("no prefill worker is available")
        p = candidates[0]
        req = pb.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            output_token_ids=outputs,
            sampling=sampling,
            destination=attempt.destination,
        )
        n_tokens = len(prompt) + len(outputs)
        p.inflight_tokens += n_tokens
        p.inflight_requests += 1
        p.served_requests += 1
        try:
            call = p.stub.Prefill(req)
            attempt.calls.append(call)
            attempt.prefill = p
            if after_send is not None:
                after_send()
            event = await call.read()
        except grpc.aio.AioRpcError as e:
            raise lost_or_raise(p, e) from e
        finally:
            p.inflight_tokens -= n_tokens
            p.inflight_requests -= 1
        if event is grpc.aio.EOF or not event.HasField("first_token"):
            raise WorkerLost(p, "the prefill ended without a first token")
        ft = event.first_token
        timings.prefill_queue_s += ft.queue_s
        timings.prefill_s += ft.prefill_s
        timings.cached_tokens = max(timings.cached_tokens, ft.cached_tokens)
        attempt.transfer = asyncio.ensure_future(transfer_done(call, timings, p))
        return ft

    async def _decode(self, attempt, request_id, prompt, outputs, sampling, timings, forks=()):
        if await attempt.lease() is None:  # a concurrent reservation, refused
            yield Tokens([], REFUSED)
            return
        req = pb.DecodeRequest(
            request_id=request_id,
            lease_id=attempt.lease_id,
            prompt_token_ids=prompt,
            output_token_ids=outputs,
            sampling=sampling,
            fork_token_ids=forks,
        )
        call = attempt.decode.stub.Decode(req)
        attempt.calls.append(call)
        try:
            await wait_first_chunk_or_lost_transfer(call, attempt)
            async for item in stream_tokens(call, outputs, timings, attempt.transfer):
                # A chunk proves the decode worker took the lease's blocks; a Decode cancelled
                # before one may never have reached it, so cleanup releases (a no-op if it did).
                attempt.attached = True
                yield item
            attempt.decode.mark_succeeded()
        except grpc.aio.AioRpcError as e:
            raise lost_or_raise(attempt.decode, e) from e
