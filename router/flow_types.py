"""What a request's flow is made of: its config, its timings, what it yields (``Tokens``),
the errors that end it, and the per-attempt sampling messages."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from protos import pdserve_pb2 as pb

PREEMPTED = "preempted"
REFUSED = "lease refused"  # the concurrent reservation was refused after the first token
WORKER_LOST = "worker lost"  # a worker died, was cut off or failed the attempt mid-way

# A worker call ending with one of these lost its worker (killed, restarted, drained, cut
# off) or its KV transfer: the request goes around again elsewhere with its tokens kept.
# INVALID_ARGUMENT, NOT_FOUND, UNAUTHENTICATED and the like are the request's own and end it.
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


@dataclass
class Tokens:
    """What a request's flow yields: new tokens of sequence ``index`` and, with the last,
    why it finished."""

    ids: list[int]
    reason: str | None = None
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)  # one per id, when asked
    prompt_logprobs: list[pb.TokenLogprobs] = field(default_factory=list)  # first item, if asked
    index: int = 0


class Overloaded(Exception):
    """No decode worker could reserve blocks in time (429 / RESOURCE_EXHAUSTED)."""


class WorkerFailure(Exception):
    """A worker failed the request and retries are used up (503 / UNAVAILABLE)."""


class WorkerLost(Exception):
    """A worker call of an attempt failed with one of LOST_CODES (see ``RequestFlow.run``)."""

    def __init__(self, worker, error: grpc.aio.AioRpcError | str):
        self.worker = worker  # router.pool.WorkerHandle
        self.error = error
        detail = error if isinstance(error, str) else f"{error.code().name}: {error.details()}"
        super().__init__(f"{worker.role} worker {worker.address}: {detail}")


def lost_or_raise(worker, error: grpc.aio.AioRpcError) -> WorkerLost:
    """The WorkerLost for a failed call of ``worker``, or ``error`` re-raised when it is the
    request's own."""
    if error.code() in LOST_CODES:
        return WorkerLost(worker, error)
    raise error


@dataclass
class FlowTimings:
    prefill_queue_s: float = 0.0
    prefill_s: float = 0.0
    kv_transfer_s: float = 0.0
    decode_queue_s: float = 0.0
    ttft_s: float = 0.0
    kv_bytes: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    migrations: int = 0  # attempts lost to a failed worker and retried


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
    max_attempts: int = 8
    # Attempts lost to a failed worker (killed, drained, transfer broken) that are retried
    # elsewhere, with the tokens streamed so far; past it the client gets an error.
    max_migrations: int = 3


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
        out.seed = sampling.seed + i
    return out
