"""Continuous-batching scheduler with chunked prefill under a token budget.

Each step: running requests first (a decode token each, or the next chunk of a prefill), then
waiting requests while budget, sequence slots and KV blocks last. When a running request
cannot get a block, the most recently admitted request is preempted by recompute: its blocks
are freed and it goes back to the front of the queue with its generated tokens kept (colocated),
or leaves the scheduler through ``SchedulerOutput.preempted`` so the router can send it for a
fresh prefill elsewhere (a disaggregated decode worker, ``requeue_preempted=False``).

A waiting request that already holds blocks (its KV arrived from a prefill worker) is admitted
without allocation: prefilled and local requests share one queue and one policy.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.block_manager import BlockManager, NoFreeBlocksError
from engine.config import SchedulerConfig
from engine.errors import InvalidRequestError
from engine.request import Request, RequestStatus


@dataclass
class ScheduledSequence:
    request: Request
    # Tokens whose KV this step computes: positions num_computed .. num_computed + n - 1.
    num_new_tokens: int
    # Whether this step reaches the end of the known tokens, so its last logits get sampled.
    samples: bool


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    # Requests that lost their blocks this step and went back to the waiting queue.
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        blocks: BlockManager,
        max_model_len: int,
        requeue_preempted: bool = True,
    ):
        self.cfg = cfg
        self.requeue_preempted = requeue_preempted
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- queue lifecycle ---------------------------------------------------------------
    def add(self, req: Request) -> None:
        if not req.prompt_token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        if req.num_tokens >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"{req.num_tokens} tokens leave no room to generate within the context of "
                f"{self.max_model_len} tokens",
            )
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def attach_prefilled(self, req: Request) -> None:
        """Queue a request whose KV for all but its last token is already in ``block_table``."""
        if (
            req.num_uncomputed_tokens < 1
            or req.num_computed_tokens > len(req.block_table) * self.blocks.block_size
        ):
            raise ValueError(f"{req.request_id}: inconsistent prefilled state")
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Move ``req`` to a finished status and return its blocks (exactly once)."""
        if req.is_finished:
            return
        req.status = status
        req.mark("finished")
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release_blocks(req)

    def detach(self, req: Request) -> list[int]:
        """Take ``req`` out of the scheduler keeping its blocks; the caller frees them later."""
        self.running.remove(req)
        table, req.block_table = req.block_table, []
        return table

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        for req in list(self.running):
            if budget <= 0:
                break
            # Preempted while making room for an earlier one (only then can it have left: the
            # list scan, O(batch) a request, runs only in a step that preempted).
            if out.preempted and req not in self.running:
                continue
            n = self._chunk(req, budget)
            if not self._grow_or_preempt(req, n, out):
                continue
            out.scheduled.append(self._scheduled(req, n))
            budget -= n
        if not out.preempted:
            budget = self._admit_waiting(budget, out)
        return out

    def update(
        self,
        plan: SchedulerOutput,
        sampled: list[int],
        check_stop: bool = True,
        on_error: Callable[[Request, BaseException], None] | None = None,
    ) -> list[Request]:
        """Advance every scheduled request; ``sampled`` has one token per sampling sequence.

        Returns the requests that got a new token this step. A prefill worker passes
        ``check_stop=False``: its requests leave through ``detach`` once their KV is shipped.
        With ``on_error``, a request whose bookkeeping raises is handed to it (to fail alone)
        and the others go on; without, the exception propagates.
        """
        tokens = iter(sampled)
        updated = []
        for s in plan.scheduled:
            token = next(tokens) if s.samples else None
            try:
                if self._advance(s, token, check_stop):
                    updated.append(s.request)
            except Exception as e:
                if on_error is None:
                    raise
                on_error(s.request, e)
        return updated

    def _advance(self, s: ScheduledSequence, token: int | None, check_stop: bool) -> bool:
        """One request's update: its computed tokens, cached blocks, new token and stop."""
        req = s.request
        req.num_computed_tokens += s.num_new_tokens
        full_blocks = req.num_computed_tokens // self.blocks.block_size
        # Caching checked first: ``all_token_ids`` copies the sequence, once per decoded token.
        if self.blocks.enable_prefix_caching and full_blocks > len(req.block_hashes):
            self.blocks.cache_full_blocks(
                req.block_table, req.block_hashes, req.all_token_ids, req.num_computed_tokens
            )
        if token is None:
            return False
        req.output_token_ids.append(token)
        if "first_token" not in req.events:  # a call saved on every later token
            req.mark("first_token")
        status = self.check_stop(req) if check_stop else None
        if status is not None:
            self.finish(req, status)
        return True

    def check_stop(self, req: Request) -> RequestStatus | None:
        """Token-level stop conditions (stop strings are the engine's, on text)."""
        sp = req.sampling
        last = req.output_token_ids[-1]
        stop = (not sp.ignore_eos and last in req.eos_token_ids) or last in sp.stop_token_set
        if stop and len(req.output_token_ids) >= sp.min_tokens:
            return RequestStatus.FINISHED_STOPPED
        if len(req.output_token_ids) >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- internals ---------------------------------------------------------------------
    def _chunk(self, req: Request, budget: int) -> int:
        n = min(req.num_uncomputed_tokens, budget)
        if self.cfg.prefill_chunk_size:
            n = min(n, self.cfg.prefill_chunk_size)
        return n

    def _scheduled(self, req: Request, n: int) -> ScheduledSequence:
        return ScheduledSequence(req, n, req.num_computed_tokens + n == req.num_tokens)

    def _grow_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Make room for ``n`` more tokens of ``req``; False if ``req`` itself was preempted."""
        # Counted once: preempting others frees blocks but leaves ``req``'s table as it is.
        extra = self.blocks.slots_needed(req.block_table, req.num_computed_tokens + n)
        while not self.blocks.can_allocate(extra):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        if extra:
            req.block_table.extend(self.blocks.allocate(extra))
        return True

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            n = (
                self._admit_prefilled(req, budget)
                if req.block_table
                else self._admit_new(req, budget)
            )
            if n == 0:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.mark("scheduled")
            self.running.append(req)
            out.scheduled.append(self._scheduled(req, n))
            budget -= n
        return budget

    def _admit_new(self, req: Request, budget: int) -> int:
        """Allocate blocks (reusing cached prefix blocks); tokens scheduled, 0 if no room."""
        bs = self.blocks.block_size
        # Prompt logprobs need every prompt position computed: no prefix reuse (as vLLM).
        reuse = req.sampling.prompt_logprobs is None
        max_cached = (req.num_tokens - 1) // bs if reuse else 0
        cached = len(self.blocks.match_prefix(req.all_token_ids, max_cached))
        n = min(req.num_tokens - cached * bs, budget)
        if self.cfg.prefill_chunk_size:
            n = min(n, self.cfg.prefill_chunk_size)
        try:
            if reuse:
                table, num_cached = self.blocks.allocate_for_tokens(
                    req.all_token_ids, cached * bs + n
                )
            else:
                table, num_cached = self.blocks.allocate(self.blocks.blocks_needed(n)), 0
        except NoFreeBlocksError:
            return 0
        req.block_table, req.num_computed_tokens, req.block_hashes = table, num_cached, []
        req.num_cached_tokens = max(req.num_cached_tokens, num_cached)
        return n

    def _admit_prefilled(self, req: Request, budget: int) -> int:
        n = self._chunk(req, budget)
        needed = req.num_computed_tokens + n
        if not self.blocks.can_allocate(self.blocks.slots_needed(req.block_table, needed)):
            return 0
        self.blocks.append_slots(req.block_table, needed)
        return n

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release_blocks(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        if self.requeue_preempted:
            self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _release_blocks(self, req: Request) -> None:
        if req.block_table:
            self.blocks.free(req.block_table)
        req.block_table, req.block_hashes = [], []
