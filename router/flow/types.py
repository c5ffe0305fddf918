"""What a request's flow is made of: its config, its timings, what it yields (``Tokens``), how
an attempt ends (``AttemptOutcome``), the errors that end a request, and the per-attempt
sampling messages."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

import grpc

from engine.errors import InvalidRequestError
from engine.request import fork_seed
from grpc_plumbing.faults import FAULT_KEY, RECEIVER_FAULT
from protos import pdserve_pb2 as pb
from router.limits import RETRY_AFTER_S

# The decode worker's finish reason for a sequence it preempted (out of blocks): not the
# client's, the router sends the request around again with its tokens kept (recompute).
WIRE_PREEMPTED = "preempted"
# A worker call that ends with INTERNAL and details starting so failed inside the engine for
# this request alone (the workers' side of the contract): an error to the client, not retried.
ENGINE_ERROR_PREFIX = "engine error:"

# A worker call ending with one of these lost its worker (killed, restarted, drained, cut
# off) or its KV transfer: the request goes around again elsewhere with its tokens kept.
# INVALID_ARGUMENT, NOT_FOUND, UNAUTHENTICATED and the like are the request's own and end it.
# (INTERNAL is here for transport faults such as RST_STREAM; an engine error is not lost.)
LOST_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.INTERNAL,
    }
)
# A Decode call on a lease ending with one of these: the decode worker no longer knows the
# lease (it expired before the attach, or its KV did not arrive before its deadline).
LEASE_GONE_CODES = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED})


class AttemptOutcome(enum.Enum):
    """How one attempt of a request ended; the retry loop (``RequestFlow.run``) decides on
    this, never on the client's finish reasons ("stop", "length", "abort")."""

    FINISHED = "finished"  # the request's last token is out, with the client's finish reason
    PREEMPTED = "preempted"  # the decode worker ran out of blocks: again, tokens kept
    LEASE_REFUSED = "lease refused"  # the concurrent reservation was refused: again, reserve first
    LEASE_EXPIRED = "lease expired"  # the decode worker lost the lease before the attach: again
    TRANSFER_FAILED = "transfer failed"  # the KV transfer broke after the first token: migrate
    WORKER_LOST = "worker lost"  # a worker died, was cut off or drained mid-way: migrate
    # A worker stopped answering: no first token, or no next token, within the request's
    # budget (FlowConfig); handled as a lost worker (migrate), and kept out of routing longer.
    HUNG = "hung"
    FAILED = "failed"  # an engine error of this request: the client gets it, no retry

    @property
    def migrates(self) -> bool:
        """Counted as a migration: the worker it is charged to leaves routing for a while."""
        lost = (AttemptOutcome.TRANSFER_FAILED, AttemptOutcome.WORKER_LOST, AttemptOutcome.HUNG)
        return self in lost


@dataclass
class Tokens:
    """What a request's flow yields: new tokens of sequence ``index`` and, with the last,
    why it finished (the client's finish reason)."""

    ids: list[int]
    reason: str | None = None
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)  # one per id, when asked
    prompt_logprobs: list[pb.TokenLogprobs] = field(default_factory=list)  # first item, if asked
    index: int = 0


class Overloaded(Exception):
    """Past an admission bound, or no decode worker could reserve blocks in time (429 /
    RESOURCE_EXHAUSTED); ``retry_after_s`` is what the 429 tells the client to wait."""

    def __init__(self, reason: str, retry_after_s: int = RETRY_AFTER_S):
        super().__init__(reason)
        self.retry_after_s = retry_after_s


class WorkerFailure(Exception):
    """A worker failed the request and retries are used up (503 / UNAVAILABLE)."""


class EngineFailure(WorkerFailure):
    """The engine failed this request (a worker's INTERNAL "engine error: ..."): an error to
    the client (gRPC INTERNAL, HTTP 500), never a normal finish, and not retried."""


class AttemptEnded(Exception):
    """A worker call ended its attempt before the request finished: ``outcome`` says how,
    ``worker`` (a router.pool.WorkerHandle) where."""

    def __init__(self, outcome: AttemptOutcome, worker, error: grpc.aio.AioRpcError | str):
        self.outcome = outcome
        self.worker = worker
        self.error = error
        detail = error if isinstance(error, str) else f"{error.code().name}: {error.details()}"
        super().__init__(f"{worker.role} worker {worker.address}: {detail}")


def is_engine_error(error: grpc.aio.AioRpcError) -> bool:
    details = error.details() or ""
    return error.code() == grpc.StatusCode.INTERNAL and details.startswith(ENGINE_ERROR_PREFIX)


def is_receiver_fault(error) -> bool:
    """A worker call's error that names the KV receiver (the decode side) as its cause."""
    if not isinstance(error, grpc.aio.AioRpcError):
        return False
    return (FAULT_KEY, RECEIVER_FAULT) in tuple(error.trailing_metadata() or ())


def ended_by(worker, error: grpc.aio.AioRpcError, on_lease: bool = False) -> AttemptEnded:
    """The AttemptEnded for a failed Prefill or Decode call of ``worker`` (``on_lease``: a
    Decode that attaches a lease), or ``error`` re-raised when it is the request's own."""
    code = error.code()
    if is_engine_error(error):
        return AttemptEnded(AttemptOutcome.FAILED, worker, error)
    if on_lease and code in LEASE_GONE_CODES:
        return AttemptEnded(AttemptOutcome.LEASE_EXPIRED, worker, error)
    if on_lease and code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # its stream budget is full:
        return AttemptEnded(AttemptOutcome.LEASE_REFUSED, worker, error)  # reserve again (429)
    if code in LOST_CODES:
        return AttemptEnded(AttemptOutcome.WORKER_LOST, worker, error)
    if code == grpc.StatusCode.INVALID_ARGUMENT:  # the worker refused what the request asks
        raise refused_request(error) from error
    raise error


def refused_request(error: grpc.aio.AioRpcError) -> InvalidRequestError:
    """A worker's INVALID_ARGUMENT (details "param: reason", as InvalidRequestError writes
    them) as the request's own error: a 400 naming the parameter, not a worker failure."""
    details = error.details() or "invalid request"
    param, sep, reason = details.partition(": ")
    if not (sep and re.fullmatch(r"[A-Za-z_][\w.]*", param)):
        param, reason = "request", details
    return InvalidRequestError(param, reason)


def lease_destination(lease: pb.ReserveResponse) -> pb.KvDestination:
    """Where a prefill sends the KV for a decode worker's reservation."""
    return pb.KvDestination(
        endpoint=lease.kv_endpoint,
        transport=lease.kv_transport,
        lease_id=lease.lease_id,
        block_size=lease.block_size,
        num_blocks=len(lease.block_ids),
        first_block=lease.cached_blocks,  # held by its prefix cache already: not sent
    )


@dataclass
class FlowTimings:
    """A request's timings and counts, summed over its attempts (seconds, bytes, tokens)."""

    prefill_queue_s: float = 0.0  # waiting at the prefill worker
    prefill_s: float = 0.0  # the prefill itself
    kv_transfer_s: float = 0.0  # transfer time not hidden behind the prefill
    decode_queue_s: float = 0.0  # KV complete to the first decode step
    ttft_s: float = 0.0  # the flow's start to its first token
    e2e_s: float = 0.0  # the request's start to its last token (set by router.core)
    kv_bytes: int = 0
    cached_tokens: int = 0  # prompt tokens found in a prefix cache (the best attempt's)
    prefill_cached_tokens: int = 0  # of those, the prefill worker's (the best attempt's)
    decode_cached_tokens: int = 0  # the decode worker's, where it prefilled the rest itself
    preemptions: int = 0  # attempts the decode worker preempted
    migrations: int = 0  # attempts lost to a failed worker or transfer and retried


@dataclass
class FlowConfig:
    """What the request flow needs of the router's settings (router.settings.RouterSettings
    holds the defaults and explains each), with the policies as objects."""

    prefill_policy: object
    decode_policy: object
    block_size: int  # only to estimate blocks for the decode policy
    reserve_timeout_s: float
    local_prefill_max_tokens: int
    concurrent_reserve_headroom: float  # < 0: never reserve and prefill at once
    kv_local_tail_tokens: int = 64  # kv_aware: a decode worker holding all but this prefills
    max_attempts: int = 8
    # Attempts lost to a failed worker (killed, drained, transfer broken) that are retried
    # elsewhere, with the tokens streamed so far; past it the client gets an error.
    max_migrations: int = 3
    # A request whose attempts failed the same way on this many distinct workers is likely at
    # fault itself (a poison request): its further failures are charged to no worker, so it
    # cannot walk through a pool tripping every breaker.
    poison_after_workers: int = 2
    # Liveness (router.settings.RouterSettings explains each): a first token is awaited
    # first_token_timeout_s + first_token_s_per_token x the prompt tokens ahead of it and its
    # own; each later Decode chunk token_timeout_s. Past either, the attempt ends HUNG.
    first_token_timeout_s: float = 60.0
    first_token_s_per_token: float = 0.01
    token_timeout_s: float = 20.0

    def first_token_budget(self, tokens: int) -> float:
        """Seconds a worker may take to answer with the first token of a prompt, ``tokens``
        the prompt tokens it has to prefill before (its queue at the router, and this one)."""
        return self.first_token_timeout_s + self.first_token_s_per_token * max(tokens, 0)


def without_prompt_logprobs(sampling: pb.SamplingParams) -> pb.SamplingParams:
    out = pb.SamplingParams()
    out.CopyFrom(sampling)
    out.ClearField("prompt_logprobs")
    return out


def sequence_sampling(sampling: pb.SamplingParams, i: int) -> pb.SamplingParams:
    """Sequence i of n on its own: n = 1, seed + i (as the decode worker seeds its forks)."""
    out = without_prompt_logprobs(sampling)
    out.n = 1
    if out.HasField("seed"):
        out.seed = fork_seed(sampling.seed, i)  # wraps in int64, as the worker's forks
    return out
