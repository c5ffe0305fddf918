"""Decode worker: reserves blocks under leases, receives KV, runs the continuous-batching loop.
It can also prefill requests itself (colocated mode, or prompts too short to be worth a transfer).

Queue lifecycle of a request here:
  Reserve        -> blocks allocated under a lease (expire by themselves after a deadline)
  KV frames      -> written straight into the leased blocks by the KV receiver
  Decode (RPC)   -> waits for the lease's commit, then the request joins the waiting queue
  engine thread  -> admitted to the running batch; one token per step, streamed back
  finish / abort / preempt -> blocks freed exactly once by the scheduler
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time

from decode_worker.reservations import LeaseReservations, ReservationError
from decode_worker.stop_strings import StopStrings
from engine.block_manager import NoFreeBlocksError
from engine.errors import EngineError, InvalidRequestError, WorkerError
from engine.llm_engine import LLMEngine
from engine.request import Request, RequestStatus, sampling_from_message
from engine.scheduler import SchedulerOutput
from engine.worker_base import EngineWorker
from kv_transfer.errors import FrameError
from kv_transfer.lease import DEFAULT_LEASE_TTL_S, LeaseStateError, LeaseTable
from kv_transfer.receiver import KVReceiver, RankCache

log = logging.getLogger("pdserve.decode")

PREEMPTED = "preempted"


class CallerLeft(Exception):
    """The Decode call waiting for a lease's KV ended (cancelled, timed out): nobody to answer."""


class _Stream:
    """Tokens of one request's sequences on their way from the engine thread to its Decode RPC:
    items are (sequence index, token, logprob) and, last for each sequence, (index, finish
    reason, None); or, last for the whole call, (0, EngineError, None) when it failed."""

    def __init__(self, req: Request, n: int = 1):
        self.req = req  # sequence 0
        self.n = n
        self.seqs = [req]  # the forks join as they are made
        self.items: queue.Queue = queue.Queue()

    def index(self, req: Request) -> int:
        return next(i for i, r in enumerate(self.seqs) if r is req)


class DecodeWorker(LeaseReservations, EngineWorker):
    role = "decode"

    def __init__(
        self,
        engine: LLMEngine,
        worker_id: str | None = None,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
    ):
        super().__init__(engine, worker_id)
        self.scheduler.requeue_preempted = False  # preempted requests go back through the router
        # Each lease promises KV for every layer x block x KV head: a commit must cover them
        # all (a tensor-parallel sender ships each rank's heads in frames of their own).
        ranks = [RankCache(heads, caches) for heads, caches in engine.runner.rank_caches()]
        num_heads = max(r.heads[1] for r in ranks)
        self.leases = LeaseTable(lease_ttl_s, num_layers=len(ranks[0].caches), num_heads=num_heads)
        self.receiver = KVReceiver(engine.runner.kv_caches, self.leases, ranks=ranks)
        self._streams: dict[str, _Stream] = {}
        # Released leases whose blocks one-sided writers may still reach (Lease.remote_writers)
        self._parked: list = []
        self.stop_strings = StopStrings(engine.tokenizer)

    # ---- decode ------------------------------------------------------------------------
    def attach(
        self,
        request_id: str,
        lease_id: str,
        prompt: list[int],
        outputs: list[int],
        sampling_msg,
        forks: list[int] = (),
        caller_left: threading.Event | None = None,
    ) -> _Stream:
        """Wait for the lease's KV, then queue the request for decoding; returns its stream.
        ``forks``: with n > 1, the first tokens the prefill sampled for sequences 1..n-1.
        ``caller_left``: set (with ``leave``) when the Decode call ends; the wait for the KV
        then ends at once (CallerLeft) and the lease is released, instead of holding the
        call's thread and a stream of the budget until the lease's deadline.

        Everything is checked before the lease closes (tokens, lengths against the lease's
        blocks, forks), and every way this call fails gives the lease's blocks back:
        FrameError (unknown or expired lease), LeaseStateError (a Decode attached the lease
        already, its commit was refused), InvalidRequestError (bad input), TimeoutError,
        CallerLeft. Several Decodes may wait on one lease: the first to attach takes it."""
        lease, attached = self.leases.claim(lease_id), False
        try:
            stream = self._prepare(request_id, lease, prompt, outputs, sampling_msg, forks)
            self._wait_for_commit(lease, caller_left)
            self._take_lease(lease, stream, forks)
            attached = True
        finally:
            # Failed: the lease's blocks go back, unless another Decode still waits on it
            # (a no-op once a Decode took them).
            if self.leases.unclaim(lease) == 0 and not attached:
                self.release(lease_id)
        self.loop.wake()
        return stream

    def _prepare(self, request_id, lease, prompt, outputs, sampling_msg, forks) -> _Stream:
        """The request's stream with sequence 0, after every check an attach can make before
        its KV is in (raises InvalidRequestError)."""
        sampling = sampling_from_message(sampling_msg)
        if not prompt or not outputs:
            raise InvalidRequestError("output_token_ids", "prompt and the first token are required")
        if len(forks) != sampling.n - 1:
            raise InvalidRequestError(
                "fork_token_ids", f"must hold n - 1 = {sampling.n - 1} tokens"
            )
        vocab = self.engine.config.model.vocab_size
        if any(not 0 <= t < vocab for t in forks):
            raise InvalidRequestError("fork_token_ids", f"must be in the vocabulary [0, {vocab})")
        total, context = len(prompt) + len(outputs), self.engine.config.max_model_len
        if total > context:
            raise InvalidRequestError(
                "prompt_token_ids", f"{total} tokens exceed the context of {context}"
            )
        need, held = self.blocks.blocks_needed(total - 1), len(lease.block_ids)
        if need != held:
            raise InvalidRequestError(
                "prompt_token_ids",
                f"KV for {total - 1} tokens fills {need} blocks, lease {lease.lease_id[:64]} "
                f"holds {held}",
            )
        req = self.new_request(request_id, prompt, outputs, sampling.for_sequence(0))
        req.num_computed_tokens = req.num_tokens - 1
        return _Stream(req, sampling.n)

    def _wait_for_commit(self, lease, caller_left: threading.Event | None) -> None:
        """Until every frame of the lease is in and its commit accepted. A refused commit
        does not end the wait early: the sender's failed transfer tells the router, which
        ends this call (a Decode failing first would race that report). Past the lease's
        deadline: LeaseStateError after a refused commit, TimeoutError otherwise."""
        if lease.committed.wait(max(0.0, lease.deadline - time.monotonic()), caller_left):
            return
        if caller_left is not None and caller_left.is_set():
            raise CallerLeft(f"the Decode call on lease {lease.lease_id} ended before its KV")
        if lease.commit_refused is not None:
            raise LeaseStateError(f"lease {lease.lease_id[:64]}: {lease.commit_refused}")
        raise TimeoutError(f"KV for lease {lease.lease_id} did not arrive before its deadline")

    def _take_lease(self, lease, stream: _Stream, forks) -> None:
        """Close the lease and hand its blocks to the request (and its forks). Past the close
        the scheduler owns them: whatever fails then finishes every sequence, which frees
        them."""
        req = stream.req
        req.mark("kv_ready")
        with self.loop.lock:
            names = [req.request_id, *(f"{req.request_id}#n{i}" for i in range(1, stream.n))]
            if any(name in self._streams for name in names):
                raise LeaseStateError(f"request {req.request_id[:64]} is decoding already")
            if self.leases.close(lease.lease_id, attached=True) is None:
                if lease.attached:  # by another Decode, waiting on it beside this one
                    raise LeaseStateError(f"lease {lease.lease_id[:64]} is attached already")
                raise TimeoutError(f"lease {lease.lease_id} expired")  # since the commit
            req.block_table = list(lease.block_ids)
            self._streams[req.request_id] = stream
            try:
                for seq in [req, *self._fork(stream, req, forks)]:
                    # A prefill's token may end it already.
                    status = self.scheduler.check_stop(seq) or self._stop_string(stream, seq)
                    if status is not None:
                        self._finish(seq, status)
                    else:
                        self.scheduler.attach_prefilled(seq)
            except Exception as e:
                error = e if isinstance(e, EngineError) else WorkerError(e)
                self._fail_stream(stream, error)
                raise error from e

    def leave(self, lease_id: str, caller_left: threading.Event) -> None:
        """The Decode call on ``lease_id`` ended: set ``caller_left`` and wake its ``attach``
        if it waits for the lease's KV (a no-op once it attached)."""
        caller_left.set()
        with contextlib.suppress(FrameError):  # attached already, released or expired
            self.leases.get(lease_id).committed.wake()

    def _fork(self, stream: _Stream, parent: Request, first_tokens) -> list[Request]:
        """Sequences 1..n-1 over ``parent``'s computed KV, each with its own first token: the
        full blocks are shared by reference count, the partial last one is copied. A fork
        that finds no free block ends "preempted" (the router runs it again on its own)."""
        forks, kv_tokens = [], parent.num_computed_tokens
        for i, token in enumerate(first_tokens, 1):
            outputs = [*parent.output_token_ids[:-1], token]
            seq = self.new_request(
                f"{parent.request_id}#n{i}",  # '#' never occurs in a client's id
                parent.prompt_token_ids,
                outputs,
                parent.sampling.for_sequence(i),
            )
            stream.seqs.append(seq)
            try:
                seq.block_table, fresh = self.blocks.fork(parent.block_table, kv_tokens)
            except NoFreeBlocksError:
                stream.items.put((i, PREEMPTED, None))
                continue
            self._streams[seq.request_id] = stream  # its blocks are the stream's to free now
            seq.num_computed_tokens = kv_tokens
            forks.append(seq)
            if fresh is not None:
                self.engine.runner.copy_block(parent.block_table[len(seq.block_table) - 1], fresh)
        return forks

    def submit_local(
        self, request_id: str, prompt: list[int], outputs: list[int], sampling_msg
    ) -> _Stream:
        """Colocated path: prefill here (chunked, mixed into the decode batch), then decode.

        Used for every request in a colocated pool, and for prompts short enough that the
        router skips the transfer."""
        sampling = sampling_from_message(sampling_msg)
        # With n > 1 the sampler draws every sequence's first token: on_updated forks then.
        req = self.new_request(request_id, prompt, outputs, sampling)
        stream = _Stream(req, sampling.n)
        with self.loop.lock:
            if self.draining:
                raise ReservationError(f"{self.worker_id} is draining")
            self.scheduler.add(req)  # validates the prompt against the context
            self._streams[request_id] = stream
        self.loop.wake()
        return stream

    # ---- the step's hooks (engine/step.py; each runs with loop.lock held) ------------------
    def before_schedule(self) -> None:
        self._apply_aborts()
        self._expire_leases()

    def on_planned(self, plan: SchedulerOutput) -> None:
        for req in plan.preempted:
            self._end_stream(req, PREEMPTED)
        if self.cores is not None:  # publish the threads this batch needs, and take them
            self.cores.on_step(len(self.scheduler.running) + len(self.scheduler.waiting))

    def on_updated(self, updated: list[Request]) -> None:
        for req in updated:
            stream = self._streams.get(req.request_id)
            if stream is not None:
                logprob = req.output_logprobs[-1] if req.output_logprobs else None
                stream.items.put((stream.index(req), req.output_token_ids[-1], logprob))
            if req.is_finished:
                self._end_stream(req, req.status.finish_reason)
                continue
            if req.fork_first and stream is not None:
                self._fork_after_prefill(stream, req)
            if self._stop_string(stream, req) is not None:
                self._finish(req, RequestStatus.FINISHED_STOPPED)

    def _stop_string(self, stream: _Stream | None, req: Request) -> RequestStatus | None:
        """FINISHED_STOPPED when a sequence of an n > 1 request reached a stop string (see
        decode_worker/stop_strings.py); with n = 1 the router cancels the call itself."""
        if stream is None or stream.n == 1 or not self.stop_strings.hit(req):
            return None
        return RequestStatus.FINISHED_STOPPED

    def _fork_after_prefill(self, stream: _Stream, req: Request) -> None:
        """A request with n > 1 prefilled here: its forks start from the tokens the sampler
        drew for them."""
        first, req.fork_first = req.fork_first, []
        req.sampling = req.sampling.for_sequence(0)
        for seq in self._fork(stream, req, [t for t, _ in first]):
            i = stream.index(seq)
            stream.items.put((i, seq.output_token_ids[-1], first[i - 1][1]))
            status = self.scheduler.check_stop(seq) or self._stop_string(stream, seq)
            if status is not None:
                self._finish(seq, status)
            else:
                self.scheduler.attach_prefilled(seq)

    def _apply_aborts(self) -> None:
        for request_id in self._aborts:
            stream = self._streams.get(request_id)
            for seq in stream.seqs if stream is not None else ():
                if seq.request_id in self._streams:  # not ended yet
                    self._finish(seq, RequestStatus.FINISHED_ABORTED)
        self._aborts.clear()

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.scheduler.finish(req, status)
        self._end_stream(req, status.finish_reason)

    def _end_stream(self, req: Request, reason: str) -> None:
        stream = self._streams.pop(req.request_id, None)
        self.engine.sampler.release(req.request_id)
        self.stop_strings.forget(req.request_id)
        if stream is None:
            return
        stream.items.put((stream.index(req), reason, None))
        if req is stream.req and len(stream.seqs) < stream.n:  # ended before it forked
            for i in range(len(stream.seqs), stream.n):  # the router runs each on its own
                stream.items.put((i, PREEMPTED, None))

    def on_failed(self, req: Request, error: EngineError) -> None:
        """``req`` failed inside a step (finished by the step already): its Decode call ends
        with the error, and so do the other sequences of an n > 1 request, since one call
        carries them all. The rest of the batch goes on."""
        stream = self._streams.get(req.request_id)
        if stream is not None:
            self._fail_stream(stream, error)

    def _fail_all(self, error: BaseException) -> None:
        """The engine thread's step raised outside any request: every stream ends with a
        worker error (UNAVAILABLE; the router moves them to another worker)."""
        failure = error if isinstance(error, WorkerError) else WorkerError(error)
        with self.loop.lock:
            for stream in {id(s): s for s in self._streams.values()}.values():
                self._fail_stream(stream, failure)

    def _fail_stream(self, stream: _Stream, error: EngineError) -> None:
        """End every live sequence of ``stream`` FINISHED_ERROR and the call with ``error``."""
        for seq in stream.seqs:
            if self._streams.pop(seq.request_id, None) is None:
                continue  # ended already
            seq.error = seq.error or str(error)
            self.scheduler.finish(seq, RequestStatus.FINISHED_ERROR)
            self.engine.sampler.release(seq.request_id)
            self.stop_strings.forget(seq.request_id)
        stream.items.put((0, error, None))

    # ---- status ------------------------------------------------------------------------
    def status(self) -> dict:
        with self.loop.lock:
            return {
                **self.base_status(),
                "block_size": self.block_size,
                "num_preemptions": self.scheduler.num_preemptions,
                "num_leases": len(self.leases),
                "frames_rejected": self.receiver.frames_rejected,
                # Its prefix cache: prompts it prefilled itself, and leases' pinned blocks.
                "prefix_hit_tokens": self.blocks.prefix_hit_tokens,
                "prefix_query_tokens": self.blocks.prefix_query_tokens,
            }
