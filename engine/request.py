"""A request's state as it moves through the engine: one object, one status enum."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
}


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0

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
            ("min_tokens", isinstance(self.min_tokens, int) and self.min_tokens >= 0, ">= 0"),
            ("seed", self.seed is None or isinstance(self.seed, int), "an int"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise InvalidRequestError(name, f"must be {want}, got {getattr(self, name)!r}")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens", "must not exceed max_tokens")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass
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
    # Lifecycle timestamps (time.monotonic()), DistServe-style, feeding metrics.
    events: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.mark("arrived")

    def mark(self, event: str) -> None:
        self.events.setdefault(event, time.monotonic())

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
    ``SamplingParams``), where 0 means "not set" for max_tokens and top_p.

    Raises ``InvalidRequestError`` naming the bad field.
    """
    seed = msg.seed if msg.HasField("seed") else None
    return SamplingParams(
        max_tokens=msg.max_tokens or default_max_tokens,
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p or 1.0,
        seed=seed,
        stop_token_ids=tuple(msg.stop_token_ids),
        stop=tuple(msg.stop),
        ignore_eos=msg.ignore_eos,
        min_tokens=msg.min_tokens,
    )
