"""One attempt of a request's disaggregated path (decode lease, prefill call, KV transfer),
and the streaming steps that read its calls: a flow step's worker calls and what they mean."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc

from protos import pdserve_pb2 as pb
from router.flow_types import FlowTimings, Tokens, WorkerLost
from router.pool import WorkerHandle

log = logging.getLogger("pdserve.router")


@dataclass
class Attempt:
    decode: WorkerHandle
    destination: pb.KvDestination
    # -> pb.ReserveResponse; raises AioRpcError if refused. None until it is sent.
    reservation: asyncio.Future | None
    calls: list = field(default_factory=list)
    transfer: asyncio.Future | None = None
    attached: bool = False
    prefill: WorkerHandle | None = None  # where the prefill runs, once sent
    waiters: list = field(default_factory=list)  # futures to cancel with the attempt

    @property
    def lease_id(self) -> str:
        return self.destination.lease_id

    async def lease(self) -> pb.ReserveResponse | None:
        """The reservation's answer once it is in; None if it was refused, failed or never
        sent."""
        if self.reservation is None:
            return None
        try:
            return await asyncio.shield(self.reservation)
        except grpc.aio.AioRpcError:
            return None

    async def cleanup(self) -> None:
        """Cancel its calls and waiters, and release the lease unless the decode worker took it
        over or it was never held. Every way an attempt ends comes through here."""
        for call in self.calls:
            call.cancel()
        for waiter in self.waiters:
            waiter.cancel()
        if self.transfer is not None and not self.transfer.done():
            self.transfer.cancel()
        if self.attached or await self.lease() is None:  # taken over, or never held
            return
        try:
            await self.decode.stub.Release(pb.ReleaseRequest(lease_id=self.lease_id), timeout=5)
        except grpc.aio.AioRpcError as e:
            log.warning("release of lease %s failed: %s", self.lease_id, e.code().name)


async def transfer_done(call, timings: FlowTimings, prefill: WorkerHandle) -> None:
    event = await call.read()
    if event is not grpc.aio.EOF and event.HasField("transfer_done"):
        timings.kv_transfer_s += event.transfer_done.exposed_s
        timings.kv_bytes += event.transfer_done.bytes
        prefill.mark_succeeded()  # prefilled and delivered: its circuit breaker closes


async def wait_first_chunk_or_lost_transfer(call, attempt: Attempt) -> None:
    """Until its first chunk the decode worker waits for the lease's KV: a prefill worker
    that dies after its first token fails the attempt now, not at the lease's deadline.
    (The decode worker's initial metadata comes with its first chunk, or with its error.)"""
    transfer = attempt.transfer
    if transfer is not None and not transfer.done():
        first_chunk = asyncio.ensure_future(call.initial_metadata())
        attempt.waiters.append(first_chunk)  # cancelled with the attempt if still waiting
        await asyncio.wait([first_chunk, transfer], return_when=asyncio.FIRST_COMPLETED)
    raise_if_transfer_lost(attempt)


async def stream_tokens(call, outputs, timings, transfer=None):
    first = True
    async for chunk in call:
        if first:
            timings.decode_queue_s += chunk.decode_queue_s
            first = False
            if transfer is not None:
                # Decoding starts only after the commit, so TransferDone is (nearly) in.
                await asyncio.wait([transfer], timeout=1.0)
        if chunk.index == 0:  # the others' are kept by _run_n
            outputs.extend(chunk.token_ids)
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
        raise WorkerLost(attempt.prefill, f"KV transfer failed after the first token: {detail}")
