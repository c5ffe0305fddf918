"""Prefill worker: chunked prefill under a token budget, prefix cache, layer-wise KV streaming.

Queue lifecycle of a request here:
  Prefill (RPC)  -> a job (request + KV stream to the decode worker's lease) joins the queue
  engine thread  -> prompt computed in chunks; after each layer of each chunk, that layer's
                    finished blocks go to the sender thread, so transfer overlaps compute
  last chunk     -> first token sampled and returned at once; the request leaves the scheduler
  commit         -> the decode side acknowledged every frame; only then are the blocks freed
                    (full ones stay in the prefix cache for the next prompt that shares them)
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field

import torch

from engine.errors import EngineError, InvalidRequestError, WorkerError
from engine.llm_engine import LLMEngine
from engine.request import Request, RequestStatus
from engine.scheduler import ScheduledSequence, SchedulerOutput
from engine.worker_base import EngineWorker
from kv_transfer.sender import KVStream

log = logging.getLogger("pdserve.prefill")


@dataclass
class PrefillJob:
    req: Request
    stream: KVStream
    # First block index not yet sent; a partially filled block is sent again with the next
    # chunk (whole blocks are idempotent to overwrite).
    next_block: int = 0
    # The lease's blocks before this one hold their KV already (the decode worker's cache).
    first_block: int = 0
    events: queue.Queue = field(default_factory=queue.Queue)
    # Traced requests only (else None, and nothing is timed): per chunk, [start, end
    # (time.monotonic()), first token position, tokens]; the Prefill call makes them spans.
    chunks: list | None = None


class PrefillWorker(EngineWorker):
    role = "prefill"

    def __init__(self, engine: LLMEngine, worker_id: str | None = None, layerwise_kv: bool = True):
        super().__init__(engine, worker_id)
        # False: every layer's blocks leave after the chunk's last layer, not as each layer is
        # computed: the transfer no longer overlaps compute (what layer-wise streaming saves,
        # measured by pdserve bench netns-cluster link).
        self.layerwise_kv = layerwise_kv
        self._jobs: dict[str, PrefillJob] = {}
        self.kv_sources = kv_sources(engine.runner.rank_caches())
        # Hook for tests that check ordering: called as (layer, request ids) after each layer.
        self.on_layer_computed = None

    # ---- submission --------------------------------------------------------------------
    def submit(
        self,
        request_id: str,
        prompt: list[int],
        outputs: list[int],
        sampling,
        stream: KVStream,
        lease_blocks: int,
        traced: bool = False,
        first_block: int = 0,
    ) -> PrefillJob:
        """Queue a prefill whose KV goes to a lease of ``lease_blocks`` blocks through
        ``stream`` (block i of the request to the lease's block i, from ``first_block``: the
        lease's blocks before it hold their KV already); ``traced``: time its chunks
        (``PrefillJob.chunks``)."""
        req = self.new_request(request_id, prompt, outputs, sampling)
        if lease_blocks < self.blocks.blocks_needed(req.num_tokens):
            raise InvalidRequestError(
                "destination.num_blocks",
                f"{lease_blocks} blocks cannot hold {req.num_tokens} tokens",
            )
        if not 0 <= first_block <= (req.num_tokens - 1) // self.block_size:
            raise InvalidRequestError(
                "destination.first_block",
                f"{first_block}: the block of the last of {req.num_tokens} tokens must be sent",
            )
        job = PrefillJob(req, stream, first_block, first_block, chunks=[] if traced else None)
        with self.loop.lock:
            self.scheduler.add(req)
            self._jobs[request_id] = job
        self.loop.wake()
        return job

    def finish_transfer(self, job: PrefillJob) -> None:
        """Called once the KV stream is committed (or abandoned after the first token): every
        frame has left, so the blocks may be reused. Full blocks stay in the prefix cache."""
        with self.loop.lock:
            if job.req.block_table:
                self.blocks.free(job.req.block_table)
                job.req.block_table = []
            self._jobs.pop(job.req.request_id, None)
        self.loop.wake()

    # ---- the step's hooks (engine/step.py) -----------------------------------------------
    check_stop = False  # a request leaves the batch at its first token, its KV still to ship

    def before_schedule(self) -> None:
        self._apply_aborts()
        if self.cores is not None:  # the node's cores less decode's need, before each chunk
            self.cores.before_chunk()

    def layer_callback(self, plan: SchedulerOutput):
        sends, timed = self._plan_sends(plan.scheduled)
        return self._send_after_each_layer(sends, timed)

    def on_updated(self, updated: list[Request]) -> None:
        for req in updated:
            job = self._jobs.get(req.request_id)
            # Out of the batch now; blocks stay held until the transfer is committed.
            table = self.scheduler.detach(req)
            req.block_table = table
            req.status = RequestStatus.FINISHED_LENGTH
            req.mark("prefilled")
            self.engine.sampler.release(req.request_id)
            if job is not None:
                job.events.put(req.output_token_ids[-1])

    def _plan_sends(self, batch: list[ScheduledSequence]):
        """Per sequence with a destination: (stream, src block ids, lease positions) this step;
        and the traced ones' chunk records, started now."""
        sends, timed = [], []
        bs = self.block_size
        for s in batch:
            job = self._jobs.get(s.request.request_id)
            if job is None:
                continue
            start = s.request.num_computed_tokens
            end = start + s.num_new_tokens
            # After a preemption the prompt is recomputed from ``start``: send from there again
            # (never the blocks the destination holds already).
            job.next_block = max(job.first_block, min(job.next_block, start // bs))
            idx = range(job.next_block, (end - 1) // bs + 1)
            if idx:  # else this chunk computed only blocks the destination holds
                src = torch.tensor([s.request.block_table[i] for i in idx], dtype=torch.int64)
                sends.append((job.stream, src, list(idx)))
                job.next_block = end // bs
            if job.chunks is not None:
                job.chunks.append(chunk := [time.monotonic(), None, start, s.num_new_tokens])
                timed.append(chunk)
        return sends, timed

    def _send_after_each_layer(self, sends, timed=()):
        ids = [stream.request_id for stream, _, _ in sends]
        last = len(self.kv_sources[0][1]) - 1

        def after_layer(layer: int) -> None:
            if self.layerwise_kv:
                ready = (layer,)
            else:  # every layer at once, after the last one
                ready = range(layer + 1) if layer == last else ()
            for sent in ready:
                for heads, caches in self.kv_sources:
                    k_cache, v_cache = caches[sent]
                    for stream, src, dst in sends:
                        stream.send_layer(sent, src, dst, k_cache, v_cache, heads)
            if self.on_layer_computed is not None:
                self.on_layer_computed(layer, ids)
            if layer == last:
                for chunk in timed:  # the chunk's forward is done (its KV is on its way)
                    chunk[1] = time.monotonic()

        return after_layer

    def _apply_aborts(self) -> None:
        """Aborts land between steps, so a batch in flight never loses blocks it is writing."""
        for request_id in self._aborts:
            job = self._jobs.get(request_id)
            if job is None or job.req.is_finished:  # prefilled: finish_transfer frees it
                continue
            self._jobs.pop(request_id)
            self.scheduler.finish(job.req, RequestStatus.FINISHED_ABORTED)
            job.stream.abort()
            job.events.put(RuntimeError("aborted"))
        self._aborts.clear()

    def on_failed(self, req: Request, error: EngineError) -> None:
        """``req`` failed inside a step (finished by the step, its blocks freed unless the
        transfer still holds them: finish_transfer frees those): its Prefill call ends with
        the error; the rest of the batch goes on."""
        job = self._jobs.pop(req.request_id, None)
        if job is not None:
            job.stream.abort()
            job.events.put(error)

    def _fail_all(self, error: BaseException) -> None:
        """The engine thread's step raised outside any request: every job ends with a worker
        error (UNAVAILABLE; the router prefills it elsewhere)."""
        failure = error if isinstance(error, WorkerError) else WorkerError(error)
        with self.loop.lock:
            for job in list(self._jobs.values()):
                if not job.req.is_finished:
                    job.req.error = str(failure)
                    self.scheduler.finish(job.req, RequestStatus.FINISHED_ERROR)
                job.stream.abort()
                job.events.put(failure)
            self._jobs.clear()

    # ---- status ------------------------------------------------------------------------
    def queued_prompt_tokens(self) -> int:
        reqs = list(self.scheduler.waiting) + list(self.scheduler.running)
        return sum(r.num_uncomputed_tokens for r in reqs)

    def status(self) -> dict:
        with self.loop.lock:
            return {
                **self.base_status(),
                "queued_prompt_tokens": self.queued_prompt_tokens(),
                "prefix_hit_tokens": self.blocks.prefix_hit_tokens,
                "prefix_query_tokens": self.blocks.prefix_query_tokens,
                # Jobs in flight, including those whose KV still streams after the first
                # token went out: a draining worker is idle only when this is 0.
                "num_transfers": len(self._jobs),
            }


def kv_sources(rank_caches) -> list[tuple[tuple[int, int] | None, list]]:
    """Where each KV head is sent from: (heads [lo, hi), cache) of one rank per distinct
    slice (ranks that replicate a head send it once), each rank's slice in frames of its own
    (no rank's cache is gathered with another's); heads None where one rank holds them all,
    so a one-rank worker's frames are as before."""
    if len(rank_caches) == 1:
        return [(None, rank_caches[0][1])]
    seen: dict[tuple[int, int], list] = {}
    for heads, caches in rank_caches:
        seen.setdefault(tuple(heads), caches)
    return sorted(seen.items())
