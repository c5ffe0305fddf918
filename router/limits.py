"""Caps on what one request may ask of the cluster, checked at the router before any worker
sees it. Each refusal is a 400 / INVALID_ARGUMENT naming the parameter and the limit (by its
config name), so an operator can tell a client's mistake from a limit worth raising.

Why each one: the body is read whole and parsed before anything else; the prompt is tokenized
and held in every attempt; every stop string is searched in every delta's text (cost grows
with their number times their length); max_tokens sizes the KV reservation.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from engine.errors import InvalidRequestError

# What a 429 / RESOURCE_EXHAUSTED tells the client to wait before trying again, in whole
# seconds (HTTP's Retry-After; gRPC's retry-after trailing metadata): about the time a tiny
# cluster's batch takes to turn over, short enough that a polite client keeps the pool busy.
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class RequestLimits:
    max_request_bytes: int = 1 << 20  # an HTTP body or a gRPC request message
    max_prompt_tokens: int | None = None  # None: only the model's context bounds it
    max_tokens: int | None = None  # None: only the context bounds it
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256

    def __post_init__(self):
        for name in ("max_request_bytes", "max_stop_strings", "max_stop_string_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("max_prompt_tokens", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or unset")


def over_limit(param: str, what: str, limit: int, name: str) -> InvalidRequestError:
    return InvalidRequestError(param, f"{what}; at most {limit} allowed (limit {name})")


def check_request_limits(limits: RequestLimits, prompt_ids, params) -> None:
    """Raise InvalidRequestError for the first limit the request passes (``params``: the
    request's engine SamplingParams)."""
    n = len(prompt_ids)
    if limits.max_prompt_tokens is not None and n > limits.max_prompt_tokens:
        raise over_limit(
            "prompt", f"{n} prompt tokens", limits.max_prompt_tokens, "max_prompt_tokens"
        )
    if limits.max_tokens is not None and params.max_tokens > limits.max_tokens:
        raise over_limit(
            "max_tokens", f"max_tokens is {params.max_tokens}", limits.max_tokens, "max_tokens"
        )
    stops = params.stop
    if len(stops) > limits.max_stop_strings:
        raise over_limit(
            "stop", f"{len(stops)} stop strings", limits.max_stop_strings, "max_stop_strings"
        )
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_string_chars:
        raise over_limit(
            "stop",
            f"a stop string of {longest} characters",
            limits.max_stop_string_chars,
            "max_stop_string_chars",
        )


class FirstTokenQueue:
    """Admitted requests still waiting for their first token, oldest first: the router's view
    of the queue in front of both pools (a reservation, a prefill behind others). While the
    oldest has waited longer than ``max_wait_s``, the queue is longer than its deadline allows
    and a new arrival would wait at least as long: it is refused at once (429), instead of
    queueing until its KV lease (30 s by default) expires under it. A deadline rather than a
    count, so the bound follows the cluster's real speed."""

    def __init__(self, max_wait_s: float):
        if not max_wait_s > 0:
            raise ValueError("max_wait_s must be > 0")
        self.max_wait_s = max_wait_s
        self._waiting: dict[int, float] = {}  # ticket -> arrival (insertion order: oldest first)
        self._tickets = itertools.count()

    def __len__(self) -> int:
        return len(self._waiting)

    def oldest_wait_s(self, now: float | None = None) -> float:
        if not self._waiting:
            return 0.0
        return (time.monotonic() if now is None else now) - next(iter(self._waiting.values()))

    def full(self) -> str | None:
        """Why a new request is refused now, or None."""
        waited = self.oldest_wait_s()
        if waited <= self.max_wait_s:
            return None
        return (
            f"{len(self)} requests queued, the oldest for {waited:.1f} s "
            f"(max_queue_wait_s {self.max_wait_s:g})"
        )

    def enter(self) -> int:
        ticket = next(self._tickets)
        self._waiting[ticket] = time.monotonic()
        return ticket

    def leave(self, ticket: int) -> None:
        """At the first token, or when the request ends without one (idempotent)."""
        self._waiting.pop(ticket, None)
