"""One attempt of a request (its id at the workers, the lease, the calls, the load it puts on
workers, how it ended), and the streaming steps that read its calls."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import grpc

from protos import pdserve_pb2 as pb
from router.flow.request import FlowRequest
from router.flow.types import AttemptEnded, AttemptOutcome, Tokens, is_receiver_fault
from router.pool import WorkerHandle

log = logging.getLogger("pdserve.router")


@dataclass
class Attempt:
    attempt_id: str  # the request's id at the workers for this attempt
    local: bool  # the decode worker prefills (no lease, no prefill worker)
    concurrent: bool = False  # Reserve goes out beside the Prefill, not before it
    decode: WorkerHandle | None = None  # where the lease is (or the local Decode runs)
    destination: pb.KvDestination | None = None  # the lease, as the prefill worker fills it
    # -> pb.ReserveResponse; raises AioRpcError if refused. None until it is sent.
    reservation: asyncio.Future | None = None
    prefill: WorkerHandle | None = None  # where the prefill runs, once sent
    transfer: asyncio.Future | None = None  # the Prefill call's TransferDone, once first token
    attached: bool = False  # the decode worker took the lease's blocks over
    calls: list = field(default_factory=list)  # worker calls to cancel with the attempt
    waiters: list = field(default_factory=list)  # futures to cancel with the attempt
    # The load this attempt puts on workers (WorkerHandle.load): given back with the attempt.
    loads: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    outcome: AttemptOutcome | None = None  # set once the attempt is over
    ended: AttemptEnded | None = None  # the worker call that ended it early, if one did
    # Tracing on only (router/flow/trace.py): the attempt's span, and its worker calls' spans
    # (ended with the attempt at the latest).
    span: object = None
    spans: list = field(default_factory=list)

    @property
    def lease_id(self) -> str:
        return self.destination.lease_id if self.destination is not None else ""

    def end(self, outcome: AttemptOutcome, ended: AttemptEnded | None = None) -> None:
        self.outcome, self.ended = outcome, ended

    def hold_load(self, worker: WorkerHandle, tokens: int = 0) -> None:
        """Count this attempt on ``worker`` until it is over (see cleanup)."""
        self.loads.enter_context(worker.load(tokens))

    async def lease(self) -> pb.ReserveResponse | None:
        """The reservation's answer once it is in; None if it was refused, failed or never
        sent."""
        if self.reservation is None:
            return None
        try:
            return await asyncio.shield(self.reservation)
        except grpc.aio.AioRpcError:
            return None

    async def refused(self) -> bool:
        """A reservation was sent and did not give a lease."""
        return self.reservation is not None and await self.lease() is None

    async def cleanup(self) -> None:
        """Cancel its calls and waiters, give back its load, and release the lease unless the
        decode worker took it over or it was never held. Every way an attempt ends comes
        through here."""
        for call in self.calls:
            call.cancel()
        for waiter in self.waiters:
            waiter.cancel()
        for span in self.spans:
            if span.is_recording():  # a call the attempt's end cut short
                span.end()
        if self.transfer is not None and not self.transfer.done():
            self.transfer.cancel()
        self.loads.close()
        if self.attached or await self.lease() is None:  # taken over, or never held
            return
        try:
            await self.decode.stub.Release(pb.ReleaseRequest(lease_id=self.lease_id), timeout=5)
        except grpc.aio.AioRpcError as e:
            log.warning("release of lease %s failed: %s", self.lease_id, e.code().name)


async def transfer_done(call, request: FlowRequest, prefill: WorkerHandle, span=None) -> None:
    """The Prefill call's second event: the KV is delivered (or the call fails, and with it
    the transfer: see raise_if_transfer_lost). ``span``: the call's, when traced."""
    event = await call.read()
    if event is not grpc.aio.EOF and event.HasField("transfer_done"):
        request.timings.kv_transfer_s += event.transfer_done.exposed_s
        request.timings.kv_bytes += event.transfer_done.bytes
        prefill.mark_succeeded()  # prefilled and delivered: its circuit breaker closes
        if span is not None:
            span.set_attribute("pdserve.kv.bytes", event.transfer_done.bytes)
            span.end()


async def wait_first_chunk_or_lost_transfer(call, attempt: Attempt, budget: float) -> None:
    """Until its first chunk the decode worker waits for the lease's KV: a prefill worker
    that dies after its first token fails the attempt now, not at the lease's deadline.
    (The decode worker's initial metadata comes with its first chunk, or with its error.)
    Neither within ``budget`` seconds: the attempt ends HUNG, charged to the prefill worker
    while its transfer is unfinished (the KV never came), else to the decode worker."""
    transfer = attempt.transfer
    if transfer is not None and not transfer.done():
        first_chunk = asyncio.ensure_future(call.initial_metadata())
        attempt.waiters.append(first_chunk)  # cancelled with the attempt if still waiting
        done, _ = await asyncio.wait(
            [first_chunk, transfer], timeout=budget, return_when=asyncio.FIRST_COMPLETED
        )
        if not done:
            raise AttemptEnded(
                AttemptOutcome.HUNG,
                attempt.prefill,
                f"the KV transfer did not finish within {budget:.1f} s (worker hung?)",
            )
    raise_if_transfer_lost(attempt)


async def read_within(call, budget: float, worker: WorkerHandle, what: str):
    """The next message of a streaming call, or grpc.aio.EOF; AttemptEnded HUNG charged to
    ``worker`` when none comes within ``budget`` seconds (a worker frozen, its engine stuck,
    or the network cut without a reset: the call itself would wait forever)."""
    # Not asyncio.wait_for: on Python < 3.12 it can swallow a cancel that lands as the read
    # completes, and under load a client's hang-up then went unnoticed until the stream's end.
    try:
        return await _read_before(call, budget)
    except TimeoutError:
        call.cancel()
        raise AttemptEnded(
            AttemptOutcome.HUNG, worker, f"no {what} within {budget:.1f} s (worker hung?)"
        ) from None


if hasattr(asyncio, "timeout"):  # 3.11+: a deadline on the running task, no task per read

    async def _read_before(call, budget: float):
        async with asyncio.timeout(budget):
            return await call.read()

else:  # 3.10: the read in a task of its own, awaited with a timeout that cannot eat a cancel

    async def _read_before(call, budget: float):
        read = asyncio.ensure_future(call.read())
        try:
            done, _ = await asyncio.wait((read,), timeout=budget)
        except asyncio.CancelledError:
            read.cancel()
            raise
        if not done:
            read.cancel()
            raise TimeoutError
        return read.result()


async def stream_tokens(call, request: FlowRequest, budgets, worker, transfer=None):
    """The Decode call's tokens as ``Tokens``; sequence 0's go onto the request's outputs
    (the other sequences' are kept by RequestFlow._run_n). ``budgets``: (seconds for the
    first chunk, seconds for each next one), past which the attempt ends HUNG (read_within)."""
    first = True
    while True:
        budget = budgets[0] if first else budgets[1]
        chunk = await read_within(call, budget, worker, "token" if not first else "first token")
        if chunk is grpc.aio.EOF:
            return
        if first:
            t = request.timings
            t.decode_queue_s += chunk.decode_queue_s
            t.decode_cached_tokens = max(t.decode_cached_tokens, chunk.cached_tokens)
            t.cached_tokens = max(t.cached_tokens, chunk.cached_tokens)
            first = False
            if transfer is not None:
                # Decoding starts only after the commit, so TransferDone is (nearly) in.
                await asyncio.wait([transfer], timeout=1.0)
        if chunk.index == 0:
            request.outputs.extend(chunk.token_ids)
        yield Tokens(
            list(chunk.token_ids),
            chunk.finish_reason or None,
            list(chunk.logprobs),
            list(chunk.prompt_logprobs),
            chunk.index,
        )


def raise_if_transfer_lost(attempt: Attempt) -> None:
    transfer = attempt.transfer
    if transfer is None or not transfer.done() or transfer.cancelled():
        return
    error = transfer.exception()
    if error is not None:
        detail = error.details() if isinstance(error, grpc.aio.AioRpcError) else repr(error)
        # Failed on the receiving side (the decode worker's KV endpoint): charge the decode
        # worker; else the prefill worker, whose call or link broke.
        blamed = attempt.decode if is_receiver_fault(error) else attempt.prefill
        raise AttemptEnded(
            AttemptOutcome.TRANSFER_FAILED,
            blamed,
            f"KV transfer failed after the first token: {detail}",
        )
