"""A request's state as it moves through the engine: one object, one status enum."""

from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field, replace

from engine.errors import InvalidRequestError
from engine.guided import check_guide


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    # Failed inside an engine step (Request.error says why): an error to its client, never a
    # normal finish.
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0  # 0 = off; else tokens under min_p x the top token's probability are cut
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False  # the stop string that ends the text stays in it
    skip_special_tokens: bool = True  # the text leaves special tokens (EOS, chat markers) out
    guide: tuple[str, str] | None = None  # structured output: (kind, spec), engine/guided.py
    ignore_eos: bool = False
    min_tokens: int = 0
    # vLLM's semantics: presence/frequency over output tokens, repetition over prompt + output
    # (divides positive logits, multiplies negative ones); logit_bias added to the raw logits.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    logprobs: int | None = None  # top-k logprobs per generated token; None = none at all
    prompt_logprobs: int | None = None  # the same for every prompt position (echo)
    n: int = 1  # sequences sampled from one prompt (seeds seed, seed + 1, ...)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        checks = [
            (
                "max_tokens",
                isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                "an int >= 1",
            ),
            ("temperature", 0.0 <= self.temperature <= 100.0, "in [0, 100]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an int >= 0 (0 = off)"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
            ("min_tokens", isinstance(self.min_tokens, int) and self.min_tokens >= 0, ">= 0"),
            ("seed", self.seed is None or isinstance(self.seed, int), "an int"),
            ("n", isinstance(self.n, int) and 1 <= self.n <= MAX_N, f"an int in [1, {MAX_N}]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 2.0, "in (0, 2]"),
            ("logit_bias", all(-100 <= b <= 100 for _, b in self.logit_bias), "in [-100, 100]"),
            ("logprobs", _optional_count(self.logprobs), f"an int in [0, {MAX_LOGPROBS}]"),
            (
                "prompt_logprobs",
                _optional_count(self.prompt_logprobs),
                f"an int in [0, {MAX_LOGPROBS}]",
            ),
        ]
        for name, ok, want in checks:
            if not ok:
                raise InvalidRequestError(name, f"must be {want}, got {getattr(self, name)!r}")
        if self.guide is not None:
            check_guide(*self.guide)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens", "must not exceed max_tokens")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def for_sequence(self, i: int) -> SamplingParams:
        """Sequence i of n: one sequence, seeded seed + i (vLLM's convention for n > 1)."""
        seed = None if self.seed is None else fork_seed(self.seed, i)
        return replace(self, n=1, seed=seed)

    @functools.cached_property
    def stop_token_set(self) -> frozenset[int]:
        """``stop_token_ids`` as a set, built once: a step looks each new token up in O(1)."""
        return frozenset(self.stop_token_ids)

    @property
    def has_penalties(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )


MAX_N = 16  # sequences per request
_INT64 = 1 << 64


def fork_seed(seed: int, i: int) -> int:
    """Sequence i's seed: seed + i, wrapped into int64 (the wire's type), so that every seed
    the API accepts, 2^63 - 1 included, seeds all n sequences."""
    return (seed + i + (_INT64 >> 1)) % _INT64 - (_INT64 >> 1)


MAX_LOGPROBS = 20  # top-k logprobs per position, as vLLM's default max_logprobs


def _optional_count(k: int | None) -> bool:
    return k is None or (isinstance(k, int) and 0 <= k <= MAX_LOGPROBS)


def check_token_ids(vocab_size: int, prompt, sampling: SamplingParams, outputs=()) -> None:
    """Every token id a request carries, against the model's vocabulary: an id past it would
    index the logits or the embedding out of bounds in the middle of a batch, failing every
    request in it. Checked at the router and again where a worker admits a request, so one bad
    request is refused alone. Raises ``InvalidRequestError`` naming the parameter."""
    fields = (
        ("prompt", prompt),
        ("output_token_ids", outputs),
        ("stop_token_ids", sampling.stop_token_ids),
        ("logit_bias", (t for t, _ in sampling.logit_bias)),
    )
    for param, ids in fields:
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                param, f"token id {bad} is outside the vocabulary [0, {vocab_size})"
            )


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probability of its token, and the ``top`` alternatives as
    (token id, logprob), most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(eq=False)  # identity: `req in running` must not compare every field
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of computed full blocks
    output_text: str = ""
    # Filled by the sampler when ``sampling.logprobs`` is set: one per output token it sampled.
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # Filled by the model runner when ``sampling.prompt_logprobs`` is set: positions 1.. of the
    # prompt (position 0 has nothing before it).
    prompt_logprobs: list[TokenLogprob] | None = None
    # With sampling.n > 1, set by the sampler with the first token: the first tokens (and
    # logprobs) of sequences 1..n-1, drawn from the same logits with seeds seed + i.
    fork_first: list[tuple[int, TokenLogprob | None]] = field(default_factory=list)
    # Why the request ended FINISHED_ERROR: "engine error: ..." or "worker error: ...".
    error: str | None = None
    # Lifecycle timestamps (time.monotonic()), DistServe-style, feeding metrics.
    events: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.mark("arrived")

    def mark(self, event: str) -> None:
        if event not in self.events:  # the first time only (a decode marks every token)
            self.events[event] = time.monotonic()

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Known tokens whose KV is not in the cache yet: the prompt (or, after a preemption,
        prompt + outputs) while prefilling, 1 while decoding."""
        return self.num_tokens - self.num_computed_tokens


def sampling_from_message(msg, default_max_tokens: int = 16) -> SamplingParams:
    """Build ``SamplingParams`` from a wire message with the same field names (a protobuf
    ``SamplingParams``), where 0 means "not set" for max_tokens, top_p and repetition_penalty.

    Raises ``InvalidRequestError`` naming the bad field.
    """
    seed = msg.seed if msg.HasField("seed") else None
    logprobs = msg.logprobs if msg.HasField("logprobs") else None
    prompt_logprobs = msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None
    return SamplingParams(
        max_tokens=msg.max_tokens or default_max_tokens,
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p or 1.0,
        min_p=msg.min_p,
        seed=seed,
        stop_token_ids=tuple(msg.stop_token_ids),
        stop=tuple(msg.stop),
        include_stop_str_in_output=msg.include_stop_str_in_output,
        skip_special_tokens=(
            msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True
        ),
        guide=(msg.guide.kind, msg.guide.spec) if msg.HasField("guide") else None,
        ignore_eos=msg.ignore_eos,
        min_tokens=msg.min_tokens,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty or 1.0,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        n=msg.n or 1,
    )
