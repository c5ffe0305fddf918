"""What a request's flow is made of: its config, its timings, what it yields (``Tokens``),
the errors that end it, and the per-attempt sampling messages."""

from __future__ import annotations

from dataclasses import dataclass, field

from protos import pdserve_pb2 as pb

PREEMPTED = "preempted"
REFUSED = "lease refused"  # the concurrent reservation was refused after the first token


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


@dataclass
class FlowConfig:
    prefill_policy: object
    decode_policy: object
    block_size: int = 16  # only to estimate blocks for the decode policy
    reserve_timeout_s: float = 30.0
    max_attempts: int = 8
    # Prompts up to this many tokens are prefilled on the decode worker (no transfer). Pick it
    # from measured latencies: where local prefill costs less than the transfer round trip.
    local_prefill_max_tokens: int = 0
    # Reserve and prefill at once when a decode worker (as last polled, less the router's own
    # reservations since) keeps this share of its blocks free after the request; < 0: never.
    concurrent_reserve_headroom: float = 0.1


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
