"""gRPC face of the decode worker: DecodeWorker service, plus KvTransfer when KV comes by gRPC."""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time

import grpc

from decode_worker.spans import record_decode, start_decode_span
from decode_worker.worker import CallerLeft, DecodeWorker, ReservationError
from engine.errors import EngineError, InvalidRequestError
from engine.wire import kv_events_status, logprob_message, logprob_messages
from grpc_plumbing.auth import resolve_cluster_token
from grpc_plumbing.health import (
    DEFAULT_STALL_TIMEOUT_S,
    CallerGone,
    add_worker_health,
    bounded_get,
)
from grpc_plumbing.server import worker_server
from kv_transfer.errors import FrameError
from kv_transfer.lease import LeaseStateError
from kv_transfer.sender import start_receiver_server
from kv_transfer.transport_grpc import add_kv_servicer
from kv_transfer.transports import TOKEN_TRANSPORTS
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger("pdserve.decode")

# Server threads kept for the calls that must never wait behind streams: Status (the router's
# poll), Reserve, Release, health probes.
CONTROL_THREADS = 16


class StreamBudget:
    """The sync gRPC server holds one thread per call for the call's whole life, and a Decode
    stream lives as long as its request. So streams are admitted against a budget that leaves
    threads for everything else: with ``max_streams`` S, new work (a Reserve, or a Decode
    without a lease) is admitted while open Decode calls + open leases < S; a Decode on a lease
    was counted by its lease, and is refused only past 2 S (one per lease and one per KV push
    stream, which holds a thread too). The pool has 2 S + CONTROL_THREADS threads, so the
    control calls always find one. Refusals are RESOURCE_EXHAUSTED, at once: the router tries
    another worker, then answers 429."""

    def __init__(self, max_streams: int):
        if max_streams < 1:
            raise ValueError("max_streams must be >= 1")
        self.max_streams = max_streams
        self.open = 0  # Decode calls in progress
        self._lock = threading.Lock()

    @property
    def server_threads(self) -> int:
        return 2 * self.max_streams + CONTROL_THREADS

    def has_room(self, open_leases: int) -> bool:
        return self.open + open_leases < self.max_streams

    def enter(self, open_leases: int, on_lease: bool) -> bool:
        with self._lock:
            room = self.open < 2 * self.max_streams if on_lease else self.has_room(open_leases)
            self.open += room
            return room

    def leave(self) -> None:
        with self._lock:
            self.open -= 1

    def full(self) -> str:
        return f"{self.open} decode streams open (max_streams {self.max_streams})"


def default_max_streams(worker: DecodeWorker) -> int:
    """A running batch (max_num_seqs) and half as many again waiting: what admission lets in."""
    return max(8, worker.scheduler.cfg.max_num_seqs * 3 // 2)


class DecodeServicer(pb_grpc.DecodeWorkerServicer):
    def __init__(
        self, worker: DecodeWorker, kv_endpoint: str, kv_transport: str, budget: StreamBudget
    ):
        self.worker = worker
        self.kv_endpoint = kv_endpoint
        self.kv_transport = kv_transport
        self.budget = budget
        self.liveness = None  # grpc_plumbing.health.Liveness, once the server is up
        self.tracing = None  # grpc_plumbing.tracing.Tracing when traces are exported

    def Reserve(self, request, context):
        if not self.budget.has_room(len(self.worker.leases)):
            reason = self.budget.full()
            if request.lease_id and request.lease_id not in self.worker.leases:
                # Its prefill may be on the way: frames waiting for this lease give up now,
                # instead of holding a KV push thread each until they time out.
                self.worker.leases.refuse(request.lease_id, reason)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, reason)
        try:
            lease = self.worker.reserve(
                request.request_id,
                request.num_tokens,
                request.lease_seconds or None,
                request.lease_id or None,
                list(request.block_hashes),
            )
        except ReservationError as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not context.is_active():  # the caller gave up (its call timed out): nobody will
            self.worker.release(lease.lease_id)  # attach or release this lease
            context.abort(grpc.StatusCode.CANCELLED, "the caller left before its lease")
        return pb.ReserveResponse(
            lease_id=lease.lease_id,
            block_ids=lease.block_ids,
            block_size=self.worker.block_size,
            kv_endpoint=self.kv_endpoint,
            kv_transport=self.kv_transport,
            deadline_s=max(0.0, lease.deadline - time.monotonic()),
            cached_blocks=lease.first_block,
        )

    def Release(self, request, context):
        return pb.ReleaseResponse(released=self.worker.release(request.lease_id))

    def Decode(self, request, context):
        if not self.budget.enter(len(self.worker.leases), on_lease=bool(request.lease_id)):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self.budget.full())
        span = None if self.tracing is None else start_decode_span(self.tracing, request, context)
        traced, error = ([] if span is not None else None), None  # off: no span, nothing kept
        try:
            yield from self._decode(request, context, traced)
        except Exception as e:  # an abort too: the span says how the call ended
            error = e
            raise
        finally:
            self.budget.leave()
            if span is not None:
                record_decode(self.tracing, span, traced[0] if traced else None)
                self.tracing.end(span, error)

    def _open_stream(self, request, context):
        """The request's stream of tokens: on its lease once the lease's KV is in, or prefilled
        here without one. None when the caller left while it waited for the KV (the lease is
        released, and the thread goes back to the server at once, not at the lease's end)."""
        args = (request.request_id, list(request.prompt_token_ids), list(request.output_token_ids))
        caller_left = threading.Event()
        leave = functools.partial(self.worker.leave, request.lease_id, caller_left)
        if request.lease_id and not context.add_callback(leave):
            leave()  # over already
        try:
            if not request.lease_id:  # prefill here
                return self.worker.submit_local(*args, request.sampling)
            return self.worker.attach(
                request.request_id,
                request.lease_id,
                *args[1:],
                request.sampling,
                list(request.fork_token_ids),
                caller_left,
            )
        except CallerLeft:
            return None
        except ReservationError as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except FrameError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, e.reason)
        except TimeoutError as e:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except LeaseStateError as e:  # a second Decode on the lease, or its commit refused
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except EngineError as e:  # failed as it joined the batch; its blocks are back
            context.abort(grpc.StatusCode[e.status_code], str(e))

    def _decode(self, request, context, traced: list | None = None):
        stream = self._open_stream(request, context)
        if stream is None:
            return
        if traced is not None:  # its spans are made of the request's marks at the end
            traced.append(stream.req)
        # Runs when the RPC ends for any reason; a no-op for a request that already finished.
        # If the caller left while we waited for the KV, abort now.
        if not context.add_callback(lambda: self.worker.abort(request.request_id)):
            self.worker.abort(request.request_id)
            return
        req = stream.req
        first, running = True, stream.n
        while running:
            try:
                chunks, error = _drain(stream.items, context, self.liveness)
            except CallerGone:
                return  # its callback aborts the request
            for chunk in chunks:
                if first and "scheduled" in req.events:
                    ready = req.events.get("kv_ready", req.events["arrived"])
                    chunk.decode_queue_s = req.events["scheduled"] - ready
                    chunk.cached_tokens = req.num_cached_tokens  # prefilled here: its cache hit
                    chunk.prompt_logprobs.extend(logprob_messages(req.prompt_logprobs))
                    first = False
                running -= bool(chunk.finish_reason)
                yield chunk
            if error is not None:
                context.abort(grpc.StatusCode[error.status_code], str(error))

    def Status(self, request, context):
        if self.liveness is not None:
            self.liveness.check(context)  # UNAVAILABLE: the router routes around it
        st = self.worker.status()
        return pb.WorkerStatus(
            kv_endpoint=self.kv_endpoint,
            kv_transport=self.kv_transport,
            open_streams=self.budget.open,
            max_streams=self.budget.max_streams,
            **st,
            **kv_events_status(self.worker.blocks, self.worker.loop.lock, request),
        )


def _drain(items: queue.Queue, context, liveness) -> tuple[list[pb.TokenChunk], EngineError | None]:
    """Wait for one item (in slices: grpc_plumbing.health.bounded_get), then take whatever
    else is ready (a slow reader gets bigger chunks): one chunk per run of items of the same
    sequence, a finish reason ending it. An error item ends the call: the chunks before it,
    and the error."""
    chunks: list[pb.TokenChunk] = []
    item = bounded_get(items, context, liveness)
    while True:
        index, token_or_reason, logprob = item
        if isinstance(token_or_reason, EngineError):
            return chunks, token_or_reason
        if not chunks or chunks[-1].index != index or chunks[-1].finish_reason:
            chunks.append(pb.TokenChunk(index=index))
        chunk = chunks[-1]
        if isinstance(token_or_reason, str):
            chunk.finish_reason = token_or_reason
        else:
            chunk.token_ids.append(token_or_reason)
            if logprob is not None:
                chunk.logprobs.append(logprob_message(logprob))
        try:
            item = items.get_nowait()
        except queue.Empty:
            return chunks, None


def serve_decode_worker(
    worker: DecodeWorker,
    host: str = "127.0.0.1",
    port: int = 0,
    kv_transport: str = "grpc",
    max_streams: int | None = None,
    cluster_token: str | None = None,
    kv_private_network: bool = False,
    tls=None,
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
    tracing=None,
):
    """Start the worker's engine thread and gRPC server; returns (server, address, kv server).
    With a cluster token (argument or PDSERVE_CLUSTER_TOKEN), every call, KV streams included,
    must carry it; without one the worker binds loopback only. torch_dist and nixl KV listen
    off loopback only with ``kv_private_network`` (their data paths are not encrypted). ``tls``
    (grpc_plumbing.tls.ClusterTls): mutual TLS on the worker API and gRPC/Flight KV.
    ``max_streams``: concurrent Decode streams (StreamBudget; default from max_num_seqs).
    ``stall_timeout_s``: the watchdog's bound on one engine step (grpc_plumbing/health.py).
    ``tracing``: a grpc_plumbing.tracing.Tracing to export each Decode's spans, or None."""
    token = resolve_cluster_token(cluster_token)
    budget = StreamBudget(max_streams or default_max_streams(worker))
    server, address = worker_server(host, port, token, budget.server_threads, tls)
    kv_server = None
    if kv_transport == "grpc":
        add_kv_servicer(server, worker.receiver, token)
        kv_endpoint = address
    else:
        opts = {"token": token} if token and kv_transport in TOKEN_TRANSPORTS else {}
        if kv_transport in ("torch_dist", "nixl"):  # their data paths are not encrypted
            opts["private_network"] = kv_private_network
        elif tls is not None and kv_transport != "shm":  # shm's KV never leaves the node
            opts["tls"] = tls
        kv_server = start_receiver_server(kv_transport, worker.receiver, host=host, **opts)
        kv_endpoint = kv_server.endpoint
    servicer = DecodeServicer(worker, kv_endpoint, kv_transport, budget)
    servicer.tracing = tracing
    pb_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    worker.start()
    name = pb.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
    servicer.liveness = add_worker_health(server, worker, name, stall_timeout_s)
    if kv_server is not None:  # a KV server that takes no KV (a dead torch_dist acceptor)
        servicer.liveness.checks.append(kv_server.problem)
    server.start()
    log.info(
        "decode worker %s serving on %s (KV %s at %s)",
        worker.worker_id,
        address,
        kv_transport,
        kv_endpoint,
    )
    return server, address, kv_server
