"""The router's state of one request on its way through the flow: what every attempt reads
(prompt, sampling) and what each leaves for the next (outputs so far, timings, counts)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.block_manager import prefix_block_hashes
from protos import pdserve_pb2 as pb
from router.flow.types import FlowTimings, Tokens, without_prompt_logprobs


@dataclass
class FlowRequest:
    request_id: str  # the client's (or, for one of n sequences run alone, "<id>#n<i>")
    prompt: list[int]  # prompt token ids
    sampling: pb.SamplingParams  # prompt logprobs dropped once computed (later attempts)
    timings: FlowTimings = field(default_factory=FlowTimings)
    outputs: list[int] = field(default_factory=list)  # sequence 0's tokens streamed so far
    attempts: int = 0  # attempts begun
    started: float = field(default_factory=time.monotonic)  # for the time to first token
    # Workers whose attempts failed, by how (AttemptOutcome): see charges_worker.
    failed_on: dict = field(default_factory=dict)
    trace: object = None  # router.flow.trace.RequestTrace while tracing is on, else None
    _hashes: tuple = field(default=(-1, []), repr=False)  # (tokens hashed, hashes): block_hashes

    def block_hashes(self, block_size: int) -> list[bytes]:
        """Chained hashes of the full blocks of what an attempt prefills (prompt + outputs),
        as the workers key their prefix caches; computed once per attempt's token count."""
        if self._hashes[0] != self.num_tokens:
            tokens = self.prompt + self.outputs
            self._hashes = (self.num_tokens, prefix_block_hashes(tokens, block_size))
        return self._hashes[1]

    @property
    def num_tokens(self) -> int:
        """Tokens an attempt prefills: the prompt plus every token generated so far."""
        return len(self.prompt) + len(self.outputs)

    def begin_attempt(self) -> str:
        """Count an attempt and name it. Workers abort by request id when a call ends, and
        that can land after the next attempt arrived: each attempt goes under its own id
        ('#' is the router's own: client ids may not hold it, see Router.prepare)."""
        number = self.attempts
        self.attempts += 1
        return self.request_id if number == 0 else f"{self.request_id}#{number}"

    def charges_worker(self, outcome, address: str, poison_after: int) -> bool:
        """Note that an attempt failed with ``outcome`` on worker ``address``; False once the
        request has failed so on ``poison_after`` other workers already (then it is likely
        the request's own fault, and the worker is not charged)."""
        workers = self.failed_on.setdefault(outcome, set())
        others = len(workers - {address})
        workers.add(address)
        return others < poison_after

    def poisoned(self, poison_after: int) -> bool:
        """Failed the same way on ``poison_after`` distinct workers or more."""
        return any(len(w) >= poison_after for w in self.failed_on.values())

    def took(self, tokens: Tokens) -> None:
        """Note what an attempt yielded: the first token's time, and prompt logprobs, which
        are computed once (later attempts need not again)."""
        if tokens.ids and not self.timings.ttft_s:
            self.timings.ttft_s = time.monotonic() - self.started
        if tokens.prompt_logprobs:
            self.sampling = without_prompt_logprobs(self.sampling)

    def took_first_token(self, first: pb.FirstToken) -> None:
        """A prefill's first token: its timings, and the token itself onto the outputs."""
        self.timings.prefill_queue_s += first.queue_s
        self.timings.prefill_s += first.prefill_s
        t = self.timings
        t.prefill_cached_tokens = max(t.prefill_cached_tokens, first.cached_tokens)
        t.cached_tokens = max(t.cached_tokens, first.cached_tokens)
        self.outputs.append(first.token_id)

    def note_decode_cached(self, tokens: int) -> None:
        """The decode worker holds ``tokens`` of the prompt already: they are not shipped."""
        t = self.timings
        t.decode_cached_tokens = max(t.decode_cached_tokens, tokens)
        t.cached_tokens = max(t.cached_tokens, tokens)

    def prefill_message(self, attempt_id: str, destination: pb.KvDestination) -> pb.PrefillRequest:
        return pb.PrefillRequest(
            request_id=attempt_id,
            prompt_token_ids=self.prompt,
            output_token_ids=self.outputs,
            sampling=self.sampling,
            destination=destination,
        )

    def decode_message(
        self, attempt_id: str, lease_id: str = "", forks: list[int] = ()
    ) -> pb.DecodeRequest:
        """Decode on a lease (its KV prefilled elsewhere), or without one: the decode worker
        prefills the prompt and the outputs so far itself."""
        return pb.DecodeRequest(
            request_id=attempt_id,
            lease_id=lease_id,
            prompt_token_ids=self.prompt,
            output_token_ids=self.outputs,
            sampling=self.sampling,
            fork_token_ids=forks,
        )
