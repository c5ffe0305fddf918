"""One request's path through the cluster, decode-first:

  Reserve blocks on a decode worker -> Prefill on a prefill worker toward that lease
  -> first token out as soon as it is sampled -> Decode streams the rest.

When the decode worker had room to spare at the last poll, Prefill and Reserve go out together,
Prefill first (the router names the lease, frames name blocks by position in it, and the decode
side holds an early frame until the lease opens). The first token leaves as soon as it is
sampled, without waiting for the reservation's answer: Decode starts once the lease is confirmed.
A refused reservation ends the attempt (LEASE_REFUSED): that prefill's KV is dropped and the
request goes around again the safe way, reserve first, with the token already sent appended to
its prompt (as after a preemption). So a prefill never feeds a full pool, and the
reservation's round trip stays off the first token.

Or, colocated (no prefill worker up, or a prompt short enough to skip the transfer): Decode
without a lease, and the decode worker prefills the request in its own batch.

The request (``FlowRequest``) goes through attempts (``Attempt``); each ends with an
``AttemptOutcome``, and ``RequestFlow.run`` decides on it alone: FINISHED ends the request;
PREEMPTED, LEASE_REFUSED and LEASE_EXPIRED go around again with the tokens so far appended
(recompute); TRANSFER_FAILED and WORKER_LOST do too, on another worker, as a migration (up to
``max_migrations``); FAILED (an engine error of this request) ends it with an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator

import grpc

from engine.block_manager import blocks_for
from protos import pdserve_pb2 as pb
from router.flow import kv_route
from router.flow.attempt import (
    Attempt,
    raise_if_transfer_lost,
    read_within,
    stream_tokens,
    transfer_done,
    wait_first_chunk_or_lost_transfer,
)
from router.flow.request import FlowRequest
from router.flow.reservation import Reservations
from router.flow.types import (
    WIRE_PREEMPTED,
    AttemptEnded,
    AttemptOutcome,
    EngineFailure,
    FlowConfig,
    Overloaded,
    Tokens,
    WorkerFailure,
    ended_by,
    is_receiver_fault,
    sequence_sampling,
)
from router.pool import SUSPECT_S, WorkerPool

log = logging.getLogger("pdserve.router")

# A worker that hung an attempt stays out of routing this long (a lost one: SUSPECT_S): time
# for its status polls to time out (router.pool.MAX_SLOW_POLLS) or its watchdog to answer.
HUNG_SUSPECT_S = 10.0
Outcome = AttemptOutcome


class RequestFlow(Reservations):
    def __init__(self, prefill: WorkerPool, decode: WorkerPool, cfg: FlowConfig):
        self.prefill = prefill
        self.decode = decode
        self.cfg = cfg

    # ---- the request: attempts until one finishes ---------------------------------------
    async def run(self, request: FlowRequest) -> AsyncIterator[Tokens]:
        """Yield new tokens until the request finishes (a ``Tokens`` with the client's finish
        reason; with n > 1, one per sequence). Raises Overloaded, WorkerFailure (EngineFailure
        for an engine error) or the AioRpcError of a worker that refused the request."""
        if request.sampling.n > 1:
            async with contextlib.aclosing(self._run_n(request)) as sequences:
                async for tokens in sequences:
                    yield tokens
            return
        previous = None
        for _ in range(self.cfg.max_attempts):
            attempt = self._plan(request, previous)
            try:
                async with contextlib.aclosing(self._attempt(request, attempt)) as steps:
                    async for tokens in steps:
                        yield tokens
            finally:
                if request.trace is not None:
                    request.trace.end_attempt(attempt)
            if attempt.outcome is Outcome.FINISHED:
                return
            self._account(request, attempt)
            previous = attempt.outcome
        raise WorkerFailure(f"{request.request_id}: gave up after {self.cfg.max_attempts} attempts")

    def _plan(self, request: FlowRequest, previous: AttemptOutcome | None) -> Attempt:
        attempt_id = request.begin_attempt()
        routable = self.decode.routable()
        if self.prefill_locally(request.num_tokens) or kv_route.holds_all_but_tail(
            self.cfg, routable, request, self.prefill.routable()
        ):
            return Attempt(attempt_id, local=True)
        # After a refused concurrent reservation, the safe way: reserve first.
        return Attempt(attempt_id, local=False, concurrent=previous is not Outcome.LEASE_REFUSED)

    def prefill_locally(self, num_tokens: int) -> bool:
        """Colocated pool (no prefill worker up), or a prompt too short to be worth a transfer."""
        return not self.prefill.routable() or num_tokens <= self.cfg.local_prefill_max_tokens

    async def _attempt(self, request: FlowRequest, attempt: Attempt) -> AsyncIterator[Tokens]:
        """One attempt's tokens for the client (n = 1); ``attempt.outcome`` says how it ended.
        The decode worker's "preempted" is an outcome, not a finish reason: the tokens before
        it are already in ``request.outputs`` and go out without it."""
        async with contextlib.aclosing(self._steps(request, attempt)) as steps:
            async for tokens in steps:
                request.took(tokens)
                if tokens.reason == WIRE_PREEMPTED:
                    attempt.end(Outcome.PREEMPTED)
                    tokens.reason = None
                    if tokens.ids:
                        yield tokens
                    return
                if tokens.reason is not None:  # before the yield: the consumer may stop there
                    attempt.end(Outcome.FINISHED)
                yield tokens
                if tokens.reason is not None:
                    return
        if attempt.outcome is None:  # the Decode stream ended without a finish reason
            attempt.end(Outcome.PREEMPTED)

    async def _steps(self, request: FlowRequest, attempt: Attempt) -> AsyncIterator[Tokens]:
        """The attempt's path, its tokens as the workers send them. A worker call that ends
        the attempt sets its outcome; whatever happens, the attempt is cleaned up here."""
        path = self._local if attempt.local else self._disaggregated
        if request.trace is not None:
            request.trace.start_attempt(attempt, request.attempts)
        try:
            async with contextlib.aclosing(path(request, attempt)) as steps:
                async for tokens in steps:
                    yield tokens
        except AttemptEnded as ended:
            attempt.end(ended.outcome, ended)
        finally:
            await attempt.cleanup()

    def _account(self, request: FlowRequest, attempt: Attempt) -> None:
        """Count an attempt that did not finish, and raise if the request may not go again."""
        outcome, ended = attempt.outcome, attempt.ended
        if outcome is Outcome.FAILED:
            log.warning("%s: %s; failing the request", request.request_id, ended)
            raise EngineFailure(ended.error.details()) from ended
        if outcome.migrates:
            self._migrate(request, ended)
        elif outcome is Outcome.PREEMPTED:
            request.timings.preemptions += 1
        why = ended or outcome.value
        n_out = len(request.outputs)
        log.info("%s: %s after %d tokens; prefilling again", request.request_id, why, n_out)

    def _migrate(self, request: FlowRequest, lost: AttemptEnded) -> None:
        """Count a lost attempt and keep new work off its worker until the next polls (the
        tokens streamed so far stay: the next attempt prefills prompt + outputs elsewhere, and
        the client's stream goes on); WorkerFailure once migrations are used up."""
        hung = lost.outcome is Outcome.HUNG  # out until its polls show it back, not for 1 s
        poison_after = self.cfg.poison_after_workers
        if request.charges_worker(lost.outcome, lost.worker.address, poison_after):
            lost.worker.mark_failed(HUNG_SUSPECT_S if hung else SUSPECT_S)
        else:
            rid = request.request_id
            log.warning("%s: %s; not charged: the request failed so elsewhere too", rid, lost)
        request.timings.migrations += 1
        if request.timings.migrations > self.cfg.max_migrations:
            cause = ""
            if request.poisoned(poison_after):
                cause = f"; it failed so on {poison_after}+ workers: likely the request's fault"
            raise WorkerFailure(
                f"{request.request_id}: {lost} (after {self.cfg.max_migrations} migrations{cause})"
            ) from lost
        log.warning("%s: %s; migrating", request.request_id, lost)

    async def _run_n(self, request: FlowRequest) -> AsyncIterator[Tokens]:
        """n sequences from one prefill: the decode worker forks the prompt's KV. A sequence
        the attempt does not finish (preempted, or a fork that found no free block) goes
        around again on its own, seeded seed + i, with its tokens kept."""
        n = request.sampling.n
        outputs = [request.outputs] + [[] for _ in range(1, n)]  # 0's: extended by the steps
        finished = [False] * n
        local = self.prefill_locally(request.num_tokens)
        # Reserve first (not concurrently): the forks grow past the lease.
        attempt = Attempt(request.begin_attempt(), local, concurrent=False)
        try:
            async with contextlib.aclosing(self._steps(request, attempt)) as steps:
                async for tokens in steps:
                    request.took(tokens)
                    if tokens.index:
                        outputs[tokens.index].extend(tokens.ids)
                    if tokens.reason == WIRE_PREEMPTED:
                        tokens.reason = None
                        request.timings.preemptions += 1
                    finished[tokens.index] = finished[tokens.index] or tokens.reason is not None
                    yield tokens
        finally:
            if request.trace is not None:
                request.trace.end_attempt(attempt)
        if attempt.outcome is not None and attempt.outcome is not Outcome.FINISHED:
            self._account(request, attempt)  # every unfinished sequence goes around alone
        for i in (i for i in range(n) if not finished[i]):
            alone = sequence_sampling(request.sampling, i)
            sequence = FlowRequest(
                f"{request.request_id}#n{i}", request.prompt, alone, request.timings, outputs[i]
            )
            sequence.trace = request.trace
            async with contextlib.aclosing(self.run(sequence)) as flow:
                async for tokens in flow:
                    tokens.index = i
                    yield tokens

    # ---- the paths ------------------------------------------------------------------------
    async def _local(self, request: FlowRequest, attempt: Attempt) -> AsyncIterator[Tokens]:
        """No lease: the decode worker prefills (its scheduler mixes the chunks into decode)."""
        num_blocks = blocks_for(request.num_tokens, self.cfg.block_size)
        for w in self._decode_candidates(request, num_blocks):
            attempt.decode = w
            # The decode worker prefills here: the first token's budget counts the prompt.
            budgets = (self.cfg.first_token_budget(request.num_tokens), self.cfg.token_timeout_s)
            with w.load():
                md = None if request.trace is None else request.trace.call("decode", attempt, w)
                call = w.stub.Decode(request.decode_message(attempt.attempt_id), metadata=md)
                try:
                    async for tokens in stream_tokens(call, request, budgets, w):
                        yield tokens
                    w.mark_succeeded()
                    return
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:  # draining: the next one
                        raise ended_by(w, e) from e
                finally:
                    call.cancel()
        raise Overloaded("no decode worker accepted the request")

    async def _disaggregated(self, request: FlowRequest, attempt: Attempt):
        first = await self._reserve_and_prefill(request, attempt)
        logprobs = [first.logprobs] if first.HasField("logprobs") else []
        yield Tokens([first.token_id], None, logprobs, list(first.prompt_logprobs))
        forks = list(first.fork_token_ids)  # n > 1: sampled from the same prefill
        for i, token in enumerate(forks, 1):
            lp = [first.fork_logprobs[i - 1]] if first.fork_logprobs else []
            yield Tokens([token], None, lp, index=i)
        async with contextlib.aclosing(self._decode(request, attempt, forks)) as decode:
            async for tokens in decode:
                yield tokens

    # ---- the steps of the disaggregated path ----------------------------------------------
    async def _reserve_and_prefill(self, request: FlowRequest, attempt: Attempt) -> pb.FirstToken:
        """Reserve decode blocks and prefill toward them; returns the first token. On the
        concurrent path the reservation may still be unanswered: see _decode."""
        if attempt.concurrent and self._plan_concurrent(request, attempt):
            send = functools.partial(self._send_reservation, request, attempt)
            try:
                return await self._prefill(request, attempt, after_send=send)
            except (grpc.aio.AioRpcError, AttemptEnded) as e:
                # A refused lease fails the prefill's transfer, which may end the prefill
                # before its first token: that is the refusal, not a prefill failure.
                engine_error = isinstance(e, AttemptEnded) and e.outcome is Outcome.FAILED
                if engine_error or not await attempt.refused():
                    raise
                refusal = "refused the concurrent reservation"
                raise AttemptEnded(Outcome.LEASE_REFUSED, attempt.decode, refusal) from None
        await self._reserve(request, attempt)
        return await self._prefill(request, attempt)

    async def _prefill(self, request: FlowRequest, attempt: Attempt, after_send=None):
        """Prefill toward the attempt's lease; returns the first token (pb.FirstToken).
        ``after_send`` runs once the Prefill call is on its way, before its first event is
        awaited. The prefill worker counts the prompt's tokens until the first token."""
        policy = self.cfg.prefill_policy
        tokens = request.prompt + request.outputs if request.outputs else request.prompt
        kv_args = kv_route.kv_args(self.cfg, policy, request)
        candidates = policy(self.prefill.routable(), tokens, **kv_args)
        if not candidates:
            # Routable when the attempt began, not now: a prefill worker too busy to answer its
            # status poll in time (overload), or one just lost (the next request prefills on
            # the decode side). Either way the client should come back shortly: 429.
            raise Overloaded("no prefill worker is available")
        p = candidates[0]
        msg = request.prefill_message(attempt.attempt_id, attempt.destination)
        request.note_decode_cached(attempt.destination.first_block * self.cfg.block_size)
        # Its budget: the prompt tokens the router has queued there before it, and its own.
        budget = self.cfg.first_token_budget(p.inflight_tokens + request.num_tokens)
        with p.load(request.num_tokens):
            try:
                md = None if request.trace is None else request.trace.call("prefill", attempt, p)
                call = p.stub.Prefill(msg, metadata=md)
                attempt.calls.append(call)
                attempt.prefill = p
                if after_send is not None:
                    after_send()
                event = await read_within(call, budget, p, "first token")
            except grpc.aio.AioRpcError as e:
                if is_receiver_fault(e):  # the decode worker's KV endpoint failed the prefill
                    raise AttemptEnded(Outcome.TRANSFER_FAILED, attempt.decode, e) from e
                raise ended_by(p, e) from e
        if event is grpc.aio.EOF or not event.HasField("first_token"):
            raise AttemptEnded(Outcome.WORKER_LOST, p, "the prefill ended without a first token")
        request.took_first_token(event.first_token)
        span = None if request.trace is None else request.trace.call_span(attempt, "prefill")
        attempt.transfer = asyncio.ensure_future(transfer_done(call, request, p, span))
        # Its failure is read where the attempt waits on it; an attempt that ends first (its
        # lease refused, its decode failed) leaves it unread: marked read here, not logged as
        # "Task exception was never retrieved".
        attempt.transfer.add_done_callback(_mark_read)
        return event.first_token

    async def _decode(self, request: FlowRequest, attempt: Attempt, forks=()):
        if await attempt.lease() is None:  # a concurrent reservation, refused
            attempt.end(Outcome.LEASE_REFUSED)
            return
        msg = request.decode_message(attempt.attempt_id, attempt.lease_id, forks)
        md = (
            None if request.trace is None else request.trace.call("decode", attempt, attempt.decode)
        )
        call = attempt.decode.stub.Decode(msg, metadata=md)
        attempt.calls.append(call)
        # The first chunk waits for the KV and a place in the decode batch: a first token's
        # budget (the prompt is in the KV already); then each chunk within token_timeout_s.
        budgets = (self.cfg.first_token_budget(0), self.cfg.token_timeout_s)
        try:
            await wait_first_chunk_or_lost_transfer(call, attempt, budgets[0])
            async for tokens in stream_tokens(
                call, request, budgets, attempt.decode, attempt.transfer
            ):
                # A chunk proves the decode worker took the lease's blocks; a Decode cancelled
                # before one may never have reached it, so cleanup releases (a no-op if it did).
                attempt.attached = True
                yield tokens
            attempt.decode.mark_succeeded()
        except grpc.aio.AioRpcError as e:
            raise_if_transfer_lost(attempt)  # a broken transfer explains a failed Decode
            raise ended_by(attempt.decode, e, on_lease=True) from e


def _mark_read(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()
