"""Simulated workers: the project's own Scheduler and BlockManager on a simulated clock.

A step here is the step a worker's engine thread runs (engine/step.py's ``StepLoop``:
``schedule()``, the forward, ``update(plan, tokens)``), with the simulated worker as its hooks.
Only the executor is replaced: the forward takes the profile's latency for that plan on the
simulated clock, and every sampled token is a fixed non-EOS id (outputs end at ``max_tokens``,
as ``ignore_eos`` runs do). So batching, chunked prefill, admission, KV capacity and preemption
are the scheduler's own decisions.

Prefix caching is the engine's own, on prompts with made-up content: every prompt begins with
the ``shared_prefix`` tokens all prompts share (a chat template's system preamble: 26 tokens of
SmolLM2's, one full block that the live engine serves from its cache) and goes on with tokens
no other prompt has (benchmarks make every prompt unique with a nonce; a trace carries lengths,
not content).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.request import Request, RequestStatus, SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.step import StepHooks, StepLoop, TokensDone
from engine.step_trace import PlanShape
from pdserve.planner.cpu_share import CpuShare
from pdserve.planner.kv_link import LinkQueue
from pdserve.planner.profile import EngineSettings, Profile

TOKEN = 3  # what every simulated sample returns; never an EOS id (none are set)
PREFIX_TOKEN = 4  # the shared prefix's content
_unique_tokens = itertools.count(1 << 20)  # content no two prompts share


def prompt_content(prompt_tokens: int, shared_prefix: int) -> list[int]:
    """A prompt of ``prompt_tokens`` tokens that shares its first ``shared_prefix`` with every
    other and nothing after them."""
    shared = min(shared_prefix, prompt_tokens)
    return [PREFIX_TOKEN] * shared + [next(_unique_tokens) for _ in range(prompt_tokens - shared)]


class _SimRequest(Request):
    """A Request compared by identity. The dataclass ``__eq__`` compares every field, and the
    scheduler's ``req in self.running`` makes that O(batch^2) field comparisons per step: the
    simulated clock does not pay for it (the profile's measured steps do)."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__


class Clock:
    """The event queue: callbacks at simulated times, in time order (ties in arrival order)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def run(self) -> None:
        events = self._events
        while events:
            t, _, fn, args = heapq.heappop(events)
            self.now = t
            fn(*args)


class SimWorker(StepHooks):
    """One worker driving the engine's step on the simulated clock: the worker is the step's
    hooks and its executor. Also carries the load counters the router's policies read (the
    fields of router.pool.WorkerHandle they use), so the real policies run unchanged."""

    requeue_preempted = True
    step_slowdown = 1.0  # this role's live steps of ``slowed_kind`` over the bare ones
    slowed_kind = "prefill"

    def __init__(
        self,
        clock: Clock,
        profile: Profile,
        engine: EngineSettings,
        num_blocks: int,
        name: str,
        cpu: CpuShare | None = None,
        temperature: float = 0.0,
        shared_prefix: int = 0,
    ):
        self.clock = clock
        self.shared_prefix = shared_prefix
        self.temperature = temperature  # every request's: the profile charges sampled rows
        self.cpu = cpu or CpuShare(clock=clock)
        self.profile = profile
        self.address = name
        # Off without a shared prefix: nothing could hit, and hashing blocks would cost the
        # simulation time for nothing.
        caching = shared_prefix >= engine.block_size
        self.blocks = BlockManager(num_blocks, engine.block_size, enable_prefix_caching=caching)
        sched = SchedulerConfig(
            engine.max_num_batched_tokens, engine.max_num_seqs, engine.prefill_chunk_size
        )
        self.scheduler = Scheduler(sched, self.blocks, engine.max_model_len, self.requeue_preempted)
        self.step_loop = StepLoop(self.scheduler, self, self)
        self.busy = False
        self.busy_s = 0.0
        self.steps = 0
        self.inflight_tokens = 0
        self.inflight_requests = 0
        self.served_requests = 0
        self.owner: dict[str, object] = {}  # request id -> the router's request

    # What KV-aware routing reads of a worker (router/policies.py): a simulated worker keeps no
    # KV index the router could read, and its scheduler queues past max_num_seqs where a real
    # decode worker's stream budget would refuse, so it always has stream room.
    kv = None

    def has_stream_room(self) -> bool:
        return True

    @property
    def free_blocks(self) -> int:
        return self.blocks.num_free

    @property
    def total_blocks(self) -> int:
        return self.blocks.num_total

    def wake(self) -> None:
        """Start a step unless one runs; idle until woken again (a submit, an attach or blocks
        coming back) when the plan is empty."""
        if not self.busy and self.scheduler.has_unfinished:
            self.step_loop.step()

    def run(self, plan: SchedulerOutput, after_layer, done: TokensDone) -> None:
        """The executor: the forward takes the profile's latency; the tokens come at its end."""
        self.busy = True
        shape = PlanShape.of(plan.scheduled)  # once: the kind and the price both read it
        kind = "prefill" if shape.prompt_tokens else "decode"  # Profile.has_prefill's answer
        alone = self.profile.shape_seconds(shape)
        if kind == self.slowed_kind:
            alone *= self.step_slowdown
        self.steps += 1
        tokens = [TOKEN] * sum(1 for s in plan.scheduled if s.samples)
        fixed = self.prompt_fixed_s() if kind == "prefill" else None
        self.cpu.begin(kind, alone, lambda elapsed: self._end_step(done, tokens, elapsed), fixed)

    def prompt_fixed_s(self) -> float | None:
        """A prompt step's once-per-step co-run work, where not the prefill kind's."""
        return None

    def _end_step(self, done: TokensDone, tokens: list[int], elapsed: float) -> None:
        self.busy_s += elapsed
        done(tokens)  # the scheduler's update, then on_updated
        self.busy = False
        self.wake()

    def new_request(self, rid: str, prompt_tokens: int, outputs: int, max_tokens: int) -> Request:
        sampling = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, temperature=self.temperature
        )
        if self.blocks.enable_prefix_caching:
            prompt = prompt_content(prompt_tokens, self.shared_prefix)
        else:
            prompt = [TOKEN] * prompt_tokens
        return _SimRequest(rid, prompt, sampling, output_token_ids=[TOKEN] * outputs)

    def on_updated(self, updated: list[Request]) -> None:
        raise NotImplementedError


class SimPrefillWorker(SimWorker):
    """Chunked prefill; a request leaves the batch at its first token and its blocks stay held
    until the KV transfer commits (PrefillWorker.on_updated, finish_transfer)."""

    check_stop = False

    def __init__(self, *args, on_first_token: Callable, link: LinkQueue | None = None, **kw):
        super().__init__(*args, **kw)
        self.step_slowdown = self.profile.cpu.prefill_worker_slowdown
        self.on_first_token = on_first_token
        self.link = link  # None: the profile's transfer table, each transfer alone on the link
        self._started: dict[str, float] = {}

    def submit(self, owner, rid: str, prompt: int, outputs: int, max_tokens: int) -> None:
        self.scheduler.add(self.new_request(rid, prompt, outputs, max_tokens))
        self.owner[rid] = owner
        self.wake()

    def on_planned(self, plan: SchedulerOutput) -> None:
        for s in plan.scheduled:
            self._started.setdefault(s.request.request_id, self.clock.now)

    def on_updated(self, updated: list[Request]) -> None:
        now = self.clock.now
        for req in updated:
            table = self.scheduler.detach(req)
            req.status = RequestStatus.FINISHED_LENGTH
            started = self._started.pop(req.request_id)
            exposed = self._exposed_transfer_s(req.num_tokens - 1, started, now)
            self.clock.at(now + exposed, self._transfer_done, table)
            self.on_first_token(self.owner.pop(req.request_id), self, now, now + exposed)

    def _exposed_transfer_s(self, num_tokens: int, started: float, now: float) -> float:
        """The transfer's part after the first token: alone on the link (the profile's
        table), or queued behind the transfers already on a shared one."""
        if self.link is None:
            return self.profile.exposed_transfer_s(num_tokens, now - started)
        nbytes = num_tokens * self.profile.kv_bytes_per_token
        return self.link.push(started, now, nbytes, self.profile.num_layers) - now

    def _transfer_done(self, table: list[int]) -> None:
        self.blocks.free(table)
        self.wake()


class SimDecodeWorker(SimWorker):
    """Leases, continuous batching, local prefill for colocated requests; a preempted request
    leaves with its tokens and goes back to the router (DecodeWorker: requeue_preempted=False)."""

    requeue_preempted = False
    slowed_kind = "decode"  # a colocated prompt's step is the bare engine's (no streams yet)

    def __init__(self, *args, on_token: Callable, on_preempted: Callable, **kw):
        super().__init__(*args, **kw)
        self.step_slowdown = self.profile.cpu.decode_worker_slowdown
        self.on_token = on_token
        self.on_preempted = on_preempted
        self.num_preemptions = 0

    def prompt_fixed_s(self) -> float:
        return self.profile.cpu.local_prefill_fixed_s  # no KV frames streamed out beside it

    def reserve(self, num_tokens: int) -> list[int] | None:
        n = self.blocks.blocks_needed(num_tokens)
        return self.blocks.allocate(n) if self.blocks.can_allocate(n) else None

    def attach(self, owner, rid: str, prompt: int, outputs: int, max_tokens: int, lease) -> None:
        """The lease's KV is in: join the waiting queue (DecodeWorker.attach)."""
        req = self.new_request(rid, prompt, outputs, max_tokens)
        req.num_computed_tokens = req.num_tokens - 1
        req.block_table = list(lease)
        self.owner[rid] = owner
        status = self.scheduler.check_stop(req)
        if status is not None:  # the prefill's token already ended it
            self.scheduler.finish(req, status)
            self.owner.pop(rid)
            self.on_token(owner, req, self.clock.now, finished=True, new_token=False)
            return
        self.scheduler.attach_prefilled(req)
        self.wake()

    def submit_local(self, owner, rid: str, prompt: int, outputs: int, max_tokens: int) -> None:
        self.scheduler.add(self.new_request(rid, prompt, outputs, max_tokens))
        self.owner[rid] = owner
        self.wake()

    def on_planned(self, plan: SchedulerOutput) -> None:
        for req in plan.preempted:
            self.num_preemptions += 1
            self.on_preempted(self.owner.pop(req.request_id), self)

    def on_updated(self, updated: list[Request]) -> None:
        for req in updated:
            finished = req.is_finished
            owner = self.owner.pop(req.request_id) if finished else self.owner[req.request_id]
            self.on_token(owner, req, self.clock.now, finished, True)
