"""Caps on what one request may ask of the cluster, checked at the router before any worker
sees it. Each refusal is a 400 / INVALID_ARGUMENT naming the parameter and the limit (by its
config name), so an operator can tell a client's mistake from a limit worth raising.

Why each one: the body is read whole and parsed before anything else; the prompt is tokenized
and held in every attempt; every stop string is searched in every delta's text (cost grows
with their number times their length); max_tokens sizes the KV reservation. The cost caps bound
what one request adds to every step of a batch and to the router's memory: each logit_bias
entry is a scatter element per step, each stop token id a set entry per sequence; every
sequence (n x prompts) is a stream on a decode worker; and a whole (non-streamed) response
holds every output token, with its logprobs, until the last one (max_total_tokens bounds it).
"""

from __future__ import annotations

import collections
import itertools
import math
import time
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.request import MAX_LOGPROBS

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
    # OpenAI allows 300 logit_bias entries; 1024 leaves room for banning a word list in all its
    # casings, and a vocabulary-sized bias is still served (one scatter a step) if raised.
    max_logit_bias: int = 1024
    max_stop_token_ids: int = 1024  # a set lookup per token: the cap bounds memory, not time
    max_sequences: int = 128  # n x prompts: each sequence is a decode stream of its own
    # n x prompts x max_tokens: what one response may hold (262,144 = 128 x a 2,048 context)
    max_total_tokens: int = 1 << 18
    max_logprobs: int = MAX_LOGPROBS  # logprobs / top_logprobs (vLLM's default; the ceiling)

    def __post_init__(self):
        names = ("max_request_bytes", "max_stop_strings", "max_stop_string_chars")
        names += ("max_sequences", "max_total_tokens")
        for name in names:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("max_logit_bias", "max_stop_token_ids"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}] (the engine's)")
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
    _check_cost_caps(limits, params)
    check_batch_limits(limits, params.n, [params.max_tokens])


def _check_cost_caps(limits: RequestLimits, params) -> None:
    caps = (
        ("logit_bias", len(params.logit_bias), "logit_bias entries", "max_logit_bias"),
        ("stop_token_ids", len(params.stop_token_ids), "stop token ids", "max_stop_token_ids"),
    )
    for param, count, what, name in caps:
        if count > getattr(limits, name):
            raise over_limit(param, f"{count} {what}", getattr(limits, name), name)
    for param, k in (("logprobs", params.logprobs), ("logprobs", params.prompt_logprobs)):
        if k is not None and k > limits.max_logprobs:
            what = f"{k} top logprobs per position"
            raise over_limit(param, what, limits.max_logprobs, "max_logprobs")


def check_batch_limits(limits: RequestLimits, n: int, max_tokens: list[int]) -> None:
    """The request as a whole: ``n`` sequences of each prompt, the prompts' ``max_tokens``
    (one entry per prompt; a completions request may carry a list of prompts)."""
    sequences = n * len(max_tokens)
    if sequences > limits.max_sequences:
        what = f"n ({n}) x {len(max_tokens)} prompts is {sequences} sequences"
        raise over_limit("n", what, limits.max_sequences, "max_sequences")
    total = n * sum(max_tokens)
    if total > limits.max_total_tokens:
        what = f"n ({n}) x max_tokens over {len(max_tokens)} prompts asks for {total} tokens"
        raise over_limit("max_tokens", what, limits.max_total_tokens, "max_total_tokens")


class FirstTokenQueue:
    """Admitted requests still waiting for their first token, oldest first: the router's view
    of the queue in front of both pools (a reservation, a prefill behind others).

    A new arrival is admitted only if it can have its first token within ``max_wait_s``: the
    queue estimates its wait as (requests ahead + 1) / the rate first tokens came out while
    it was busy (``service_rate``, over the last ``rate_window`` first tokens), and refuses at
    arrival (429 at once, Retry-After from the estimate) when that passes the deadline,
    rather than letting it wait and refusing it later. Busy time only, so a quiet queue does
    not look slow. Until it has seen enough first tokens, or when the estimate misses, the
    deadline itself is the backstop: while the oldest has waited longer than ``max_wait_s``,
    new arrivals are refused. A deadline rather than a count: the bound follows the cluster's
    real speed, and no admitted request's KV lease (30 s by default) expires in the queue.

    Only requests that can still be served count, so one stuck request (a hung worker, a
    prefill held open) cannot refuse everyone: a request that a later arrival overtook (its
    first token came out first) shows the queue moves, and is left out of the backstop; one
    that has waited past ``stale_after_s`` (three times the deadline, at least a second past
    it) is left out of everything, the estimate's count and its busy time included. Its own
    deadline (the router's first-token budget) ends it."""

    MIN_RATE_SAMPLES = 8  # first tokens seen before the rate is trusted
    STALE_FACTOR = 3.0  # stale_after_s = max(STALE_FACTOR x max_wait_s, max_wait_s + ...)
    MIN_STALE_MARGIN_S = 1.0  # ... a second: a timer's jitter is no proof a request is stuck

    def __init__(
        self,
        max_wait_s: float,
        rate_window: int = 64,
        clock=time.monotonic,
        stale_after_s: float | None = None,
    ):
        if not max_wait_s > 0:
            raise ValueError("max_wait_s must be > 0")
        self.max_wait_s = max_wait_s
        self._stale_after_s = stale_after_s
        self._clock = clock  # seconds, monotonic (tests pass a fake one)
        # ticket -> arrival of the requests that can still be served (oldest first), and the
        # tickets of those that waited past stale_after_s.
        self._live: dict[int, float] = {}
        self._stale: set[int] = set()
        self._tickets = itertools.count()
        self._newest_served = -1  # the newest ticket whose first token came out
        # Busy seconds (time with a live request waiting) before now, and since when it is busy.
        self._busy_before = 0.0
        self._busy_since = 0.0
        # The busy-seconds clock at each recent first token: their spacing is the service rate.
        self._served_at: collections.deque[float] = collections.deque(maxlen=rate_window)

    @property
    def stale_after_s(self) -> float:
        """How long a request may wait before it no longer counts (it is stuck, not queued)."""
        if self._stale_after_s is not None:
            return self._stale_after_s
        w = self.max_wait_s  # read each time: tests and operators may change it
        return max(self.STALE_FACTOR * w, w + self.MIN_STALE_MARGIN_S)

    def __len__(self) -> int:
        return len(self._live) + len(self._stale)

    def num_live(self, now: float | None = None) -> int:
        """Waiting requests that can still be served (not past stale_after_s)."""
        self._prune(self._clock() if now is None else now)
        return len(self._live)

    def oldest_wait_s(self, now: float | None = None) -> float:
        """How long the oldest request that can still be served, and that no later arrival
        overtook, has waited (0 with none)."""
        now = self._clock() if now is None else now
        self._prune(now)
        for ticket, arrival in self._live.items():
            if ticket > self._newest_served:
                return now - arrival
        return 0.0

    def service_rate(self, now: float | None = None) -> float | None:
        """First tokens per busy second, recently; None until MIN_RATE_SAMPLES were seen."""
        if len(self._served_at) < self.MIN_RATE_SAMPLES:
            return None
        now = self._clock() if now is None else now
        self._prune(now)
        span = self._busy_s(now) - self._served_at[0]
        return (len(self._served_at) - 1) / span if span > 0 else None

    def estimated_wait_s(self, now: float | None = None) -> float | None:
        """How long a request arriving now would wait for its first token; None: unknown."""
        now = self._clock() if now is None else now
        rate = self.service_rate(now)
        return None if rate is None else (self.num_live(now) + 1) / rate

    def full(self, now: float | None = None) -> str | None:
        """Why a new request is refused now, or None."""
        now = self._clock() if now is None else now
        waited = self.oldest_wait_s(now)
        if waited > self.max_wait_s:
            return (
                f"{self.num_live(now)} requests queued, the oldest for {waited:.1f} s "
                f"(max_queue_wait_s {self.max_wait_s:g})"
            )
        estimate = self.estimated_wait_s(now)
        if estimate is not None and estimate > self.max_wait_s:
            return (
                f"{self.num_live(now)} requests queued, a new one would wait about "
                f"{estimate:.1f} s for its first token (max_queue_wait_s {self.max_wait_s:g})"
            )
        return None

    def retry_after_s(self, now: float | None = None) -> int:
        """Whole seconds until the queue should admit again: until the estimate is back
        under the deadline (at least RETRY_AFTER_S, at most the deadline itself)."""
        estimate = self.estimated_wait_s(now)
        if estimate is None:
            return RETRY_AFTER_S
        over = math.ceil(estimate - self.max_wait_s)
        return max(RETRY_AFTER_S, min(over, math.ceil(self.max_wait_s)))

    def enter(self) -> int:
        now = self._clock()
        self._prune(now)
        if not self._live:
            self._busy_since = now
        ticket = next(self._tickets)
        self._live[ticket] = now
        return ticket

    def served(self, ticket: int) -> None:
        """At the request's first token: it leaves, and counts toward the service rate
        (called again for each later token: a no-op then)."""
        now = self._clock()
        self._prune(now)
        if ticket in self._live:
            self._served_at.append(self._busy_s(now))
        if ticket in self._live or ticket in self._stale:
            self._newest_served = max(self._newest_served, ticket)
        self._leave(ticket, now)

    def leave(self, ticket: int) -> None:
        """When the request ends without a first token (idempotent; after served too)."""
        now = self._clock()
        self._prune(now)
        self._leave(ticket, now)

    def _leave(self, ticket: int, now: float) -> None:
        self._stale.discard(ticket)
        if self._live.pop(ticket, None) is not None and not self._live:
            self._busy_before += now - self._busy_since

    def _prune(self, now: float) -> None:
        """Move the requests that waited past stale_after_s out of the live ones (oldest
        first); the busy clock stops when the last live one went stale, not now."""
        limit = self.stale_after_s
        while self._live:
            ticket, arrival = next(iter(self._live.items()))
            stale_at = arrival + limit
            if stale_at > now:
                return
            del self._live[ticket]
            self._stale.add(ticket)
            if not self._live:
                self._busy_before += stale_at - self._busy_since

    def _busy_s(self, now: float) -> float:
        return self._busy_before + (now - self._busy_since if self._live else 0.0)
