"""gRPC face of the prefill worker: the PrefillWorker service."""

from __future__ import annotations

import logging
import time

import grpc

from engine.errors import EngineError, InvalidRequestError
from engine.request import sampling_from_message
from engine.wire import kv_events_status, logprob_message, logprob_messages
from grpc_plumbing.auth import resolve_cluster_token
from grpc_plumbing.faults import FAULT_KEY, RECEIVER_FAULT
from grpc_plumbing.health import (
    DEFAULT_STALL_TIMEOUT_S,
    CallerGone,
    add_worker_health,
    bounded_get,
)
from grpc_plumbing.server import worker_server
from kv_transfer.errors import is_receiver_fault
from kv_transfer.sender import TransferError
from kv_transfer.sender_pool import SenderPool
from prefill_worker.spans import record_prefill, start_prefill_span
from prefill_worker.worker import PrefillWorker
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger("pdserve.prefill")


class PrefillServicer(pb_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker, senders: SenderPool):
        self.worker = worker
        self.senders = senders
        self.liveness = None  # grpc_plumbing.health.Liveness, once the server is up
        self.tracing = None  # grpc_plumbing.tracing.Tracing when traces are exported

    def Prefill(self, request, context):
        span = None if self.tracing is None else start_prefill_span(self.tracing, request, context)
        if span is None:  # tracing off, or an untraced caller: no span, nothing timed
            yield from self._prefill(request, context, None)
            return
        error = None
        try:
            yield from self._prefill(request, context, span)
        except Exception as e:  # an abort too: the span says how the call ended
            error = e
            raise
        finally:
            self.tracing.end(span, error)

    def _prefill(self, request, context, span):
        dest = request.destination
        if dest.block_size != self.worker.block_size:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"destination.block_size {dest.block_size} != worker block size {self.worker.block_size}",
            )
        stream = None
        try:
            sampling = sampling_from_message(request.sampling)
            stream = self.senders.get(dest.transport, dest.endpoint).open_stream(
                request.request_id, dest.lease_id
            )
            job = self.worker.submit(
                request.request_id,
                list(request.prompt_token_ids),
                list(request.output_token_ids),
                sampling,
                stream,
                dest.num_blocks,
                traced=span is not None,
                first_block=dest.first_block,
            )
        except (ValueError, ConnectionError, OSError) as e:  # InvalidRequestError is a ValueError
            if stream is not None:  # its push call is open at the decode worker: end it
                stream.abort()
            if isinstance(e, InvalidRequestError):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            _abort_transfer(context, is_receiver_fault(e), f"KV destination {dest.endpoint}: {e}")
        context.add_callback(lambda: self.worker.abort(request.request_id))
        try:
            item = self._first_event(job, context)
            if item is None:
                return  # the caller left; its callback aborts the request
            if isinstance(item, EngineError):  # INTERNAL, or UNAVAILABLE for a WorkerError
                context.abort(grpc.StatusCode[item.status_code], str(item))
            if isinstance(item, BaseException):
                context.abort(grpc.StatusCode.ABORTED, f"prefill failed: {item}")
            yield pb.PrefillEvent(first_token=_first_token(job.req, item))
            try:
                stats = job.stream.commit()
            except TransferError as e:
                _abort_transfer(context, e.receiver_fault, f"KV transfer failed: {e}")
            if span is not None:
                record_prefill(self.tracing, span, job, stats, dest)
            ev = job.req.events
            yield pb.PrefillEvent(
                transfer_done=pb.TransferDone(
                    bytes=stats.bytes,
                    frames=stats.frames,
                    exposed_s=time.monotonic() - ev["prefilled"],
                )
            )
        finally:
            # Closed before its commit (the caller cancelled at the first token: GeneratorExit
            # at the yield) or failed: end its KV stream, which drops the frames still queued
            # and closes the push call at the decode worker, before the blocks are freed.
            if not job.stream.finished:
                job.stream.abort()
            self.worker.finish_transfer(job)

    def _first_event(self, job, context):
        """The job's first event (a token or an error), in bounded waits; None if the caller
        left first (grpc_plumbing.health.bounded_get)."""
        try:
            return bounded_get(job.events, context, self.liveness)
        except CallerGone:
            return None

    def Status(self, request, context):
        if self.liveness is not None:
            self.liveness.check(context)  # UNAVAILABLE: the router routes around it
        events = kv_events_status(self.worker.blocks, self.worker.loop.lock, request)
        return pb.WorkerStatus(**self.worker.status(), **events)


def _abort_transfer(context, receiver_fault: bool, details: str) -> None:
    """UNAVAILABLE for a KV transfer that failed; where the receiving side failed it, with
    trailing metadata pdserve-fault: receiver, so the router charges the decode worker
    (router.flow.types.is_receiver_fault), not this one."""
    if receiver_fault:
        context.set_trailing_metadata(((FAULT_KEY, RECEIVER_FAULT),))
    context.abort(grpc.StatusCode.UNAVAILABLE, details)


def _first_token(req, token: int) -> pb.FirstToken:
    ev = req.events
    msg = pb.FirstToken(
        token_id=token,
        queue_s=ev.get("scheduled", ev["arrived"]) - ev["arrived"],
        prefill_s=ev["prefilled"] - ev.get("scheduled", ev["arrived"]),
        cached_tokens=req.num_cached_tokens,
        prompt_logprobs=logprob_messages(req.prompt_logprobs),
    )
    if req.output_logprobs:
        msg.logprobs.CopyFrom(logprob_message(req.output_logprobs[-1]))
    for fork_token, logprob in req.fork_first:  # n > 1: the other sequences' first tokens
        msg.fork_token_ids.append(fork_token)
        if logprob is not None:
            msg.fork_logprobs.append(logprob_message(logprob))
    return msg


def serve_prefill_worker(
    worker: PrefillWorker,
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 64,
    cluster_token: str | None = None,
    tls=None,
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
    tracing=None,
):
    """Start the worker's engine thread and gRPC server; returns (server, address, senders).
    With a cluster token (argument or PDSERVE_CLUSTER_TOKEN), callers must send it, and KV
    streams carry it; without one the worker binds loopback only. ``tls``
    (grpc_plumbing.tls.ClusterTls): mutual TLS on the worker API and on gRPC/Flight KV.
    ``stall_timeout_s``: the watchdog's bound on one engine step (grpc_plumbing/health.py).
    ``tracing``: a grpc_plumbing.tracing.Tracing to export each Prefill's spans, or None."""
    token = resolve_cluster_token(cluster_token)
    server, address = worker_server(host, port, token, max_workers, tls)
    senders = SenderPool(token, tls)
    servicer = PrefillServicer(worker, senders)
    servicer.tracing = tracing
    pb_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
    worker.start()
    name = pb.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
    servicer.liveness = add_worker_health(server, worker, name, stall_timeout_s)
    server.start()
    log.info("prefill worker %s serving on %s", worker.worker_id, address)
    return server, address, senders
