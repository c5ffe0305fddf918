"""Batched sampling: logit bias, penalties, min_tokens, structured output (engine/guided.py),
greedy, temperature, min-p, top-k, top-p, per-request seeds, and the logprobs of what was
sampled.

Random draws use the exponential-race trick (argmax of p / Exp(1) is a sample from p), so
each row can draw from its own seeded generator while the filtering stays batched.

Logprobs are the log-softmax of the logits the sampler used: after logit bias, penalties and
min_tokens, divided by the temperature (1 for greedy), before top-k/top-p filtering; this is
what vLLM's V0 sampler reports (its "processed" logprobs, less the top-k/top-p mask).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine.errors import InvalidRequestError
from engine.penalties import Penalties
from engine.request import Request, TokenLogprob

if TYPE_CHECKING:
    from engine.guided import GuidedDecoding

log = logging.getLogger("pdserve.engine")

# What a logprob of -inf is reported as (JSON has no infinity); vLLM uses the same value.
MIN_LOGPROB = -9999.0
_GOLDEN = 0x9E3779B97F4A7C15  # spreads (seed, position) over the generator's seed space


class Sampler:
    def __init__(self, guided: GuidedDecoding | None = None) -> None:
        self.penalties = Penalties()
        self.guided = guided  # structured output; None: a request that asks for it fails

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        """One token per row of ``logits`` [B, vocab] (fp32) for the matching request. Requests
        that asked for logprobs get the sampled token's appended to ``output_logprobs``.
        ``logits`` stay as given (a copy is processed when a row asks for a change)."""
        if any(self._changes(r) for r in requests):
            logits = logits.clone()
        return self._sample_in_place(logits, requests)

    def _changes(self, req: Request) -> bool:
        """Whether sampling changes this request's row of the logits before drawing."""
        return (
            self.penalties.changes(req)
            or len(req.output_token_ids) < req.sampling.min_tokens
            or req.sampling.guide is not None
        )

    @torch.inference_mode()  # the runner's logits are inference tensors
    def _sample_in_place(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        """``sample``, processing the rows that ask for it (bias, penalties, min_tokens) in
        place: a step pays for those rows only, never for a copy of the whole batch."""
        self.penalties.apply_(logits, requests)
        self._apply_min_tokens(logits, requests)
        self._apply_guides(logits, requests)
        out = self._draw(logits, requests)
        self._record_logprobs(logits, requests, out)
        self._sample_forks(logits, requests)
        return out

    def sample_isolated(
        self, logits: torch.Tensor, requests: Sequence[Request]
    ) -> tuple[list[int | None], dict[int, BaseException]]:
        """``sample``, where one request's failure is its own: (tokens, errors by row). If the
        batched pass raises, what it changed is put back (``_BatchedPass``) and each row is
        sampled alone; a row that raises alone gets None and its exception. Every row is
        independent (its own logits, seed and penalty state), so the rows that succeed get
        the tokens the batch would have given them. While nothing fails the cost is a count
        per request (and a copy of the default generator's state when a row draws from it).

        ``logits`` are this step's own: the batched pass processes in place the rows that ask
        for it, after keeping a copy of those rows only, which a failed pass puts back."""
        before = _BatchedPass.before(requests)
        kept = [(i, logits[i].clone()) for i, r in enumerate(requests) if self._changes(r)]
        try:
            return list(self._sample_in_place(logits, requests)), {}
        except Exception as e:  # noqa: BLE001 - isolated row by row below
            log.warning("sampling %d rows failed (%r); sampling each alone", len(requests), e)
        with torch.inference_mode():
            for i, row in kept:
                logits[i].copy_(row)
        before.restore_generator()
        tokens: list[int | None] = []
        errors: dict[int, BaseException] = {}
        for i, req in enumerate(requests):
            before.restore_logprobs(i, req)
            try:
                tokens.append(self.sample(logits[i : i + 1], [req])[0])
            except Exception as e:  # noqa: BLE001 - this row's own failure
                before.restore_logprobs(i, req)
                self.release(req.request_id)
                tokens.append(None)
                errors[i] = e
        return tokens, errors

    def _draw(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        out = logits.argmax(dim=-1).tolist()
        random_rows = [i for i, r in enumerate(requests) if not r.sampling.is_greedy]
        if random_rows:
            rows = torch.tensor(random_rows)
            # Random rows are drawn on the CPU (from GPU logits too): a seed gives the same
            # tokens on every device, and the rows are few next to the forward.
            probs = self._filtered_probs(logits[rows].cpu(), [requests[i] for i in random_rows])
            for j, i in enumerate(random_rows):
                gen = self._generator(requests[i])
                noise = torch.empty_like(probs[j]).exponential_(generator=gen)
                out[i] = int((probs[j] / noise).argmax())
        return out

    def _sample_forks(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """Requests with n > 1 (at their first token): sequences 1..n-1 draw their first
        tokens from the same processed logits, each from its own seed."""
        for i, req in enumerate(requests):
            n = req.sampling.n
            if n == 1:
                continue
            forks = [
                Request(
                    f"{req.request_id}#n{j}",
                    req.prompt_token_ids,
                    req.sampling.for_sequence(j),
                    output_token_ids=list(req.output_token_ids),  # the same position
                )
                for j in range(1, n)
            ]
            rows = logits[i : i + 1].expand(n - 1, -1)
            tokens = self._draw(rows, forks)
            self._record_logprobs(rows, forks, tokens)
            req.fork_first = [
                (t, f.output_logprobs[-1] if f.output_logprobs else None)
                for t, f in zip(tokens, forks)
            ]
            for f in forks:
                self.release(f.request_id)

    def release(self, request_id: str) -> None:
        self.penalties.release(request_id)
        if self.guided is not None:
            self.guided.release(request_id)

    def check_guide(self, kind: str, spec: str) -> None:
        """A structured-output spec compiles and some token can begin it: else
        InvalidRequestError naming it (a worker's admission: before the request runs)."""
        self._guided().check(kind, spec)

    def _apply_guides(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """In place: a structured-output row keeps only what its grammar allows next."""
        if any(r.sampling.guide is not None for r in requests):
            self._guided().mask_(logits, requests)

    def _guided(self) -> GuidedDecoding:
        if self.guided is None:
            raise InvalidRequestError("guide", "this model has no tokenizer to guide with")
        return self.guided

    @staticmethod
    def _record_logprobs(logits, requests: Sequence[Request], tokens: list[int]) -> None:
        rows = [i for i, r in enumerate(requests) if r.sampling.logprobs is not None]
        if not rows:
            return
        reqs = [requests[i] for i in rows]
        entries = logprob_entries(
            logits[torch.tensor(rows, device=logits.device)],
            [r.sampling.temperature for r in reqs],
            [tokens[i] for i in rows],
            [r.sampling.logprobs for r in reqs],
        )
        for req, entry in zip(reqs, entries):
            req.output_logprobs.append(entry)

    @staticmethod
    def _generator(req: Request) -> torch.Generator | None:
        """A seeded sequence draws its t-th token from a generator seeded by (seed, t), so a
        token is the same wherever it is drawn: prefill worker, decode worker, colocated, or
        again after a preemption."""
        if req.sampling.seed is None:
            return None
        t = len(req.output_token_ids)
        return torch.Generator().manual_seed((req.sampling.seed ^ (t * _GOLDEN)) % 2**64)

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """In place: a row still short of its ``min_tokens`` cannot end (EOS, stop ids)."""
        for i, r in enumerate(requests):
            if len(r.output_token_ids) < r.sampling.min_tokens:
                logits[i, list(r.eos_token_ids) + list(r.sampling.stop_token_ids)] = float("-inf")

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """Each row's distribution at its temperature, cut to its min-p, then its top-k and
        top-p (vLLM's order). Only rows with a top-p below 1 pay for sorting the vocabulary
        (about 3 ms a row at 49k tokens on one core); a top-k alone takes its k-th largest as
        the cut, a min-p the top logit, and a row with none (OpenAI's defaults) is a plain
        softmax."""
        temps = torch.tensor([r.sampling.temperature for r in requests], dtype=logits.dtype)
        logits = logits / temps.unsqueeze(1)
        _cut_by_min_p(logits, [r.sampling.min_p for r in requests])
        vocab = logits.shape[-1]
        top_k = [r.sampling.top_k if 0 < r.sampling.top_k < vocab else 0 for r in requests]
        top_p = [r.sampling.top_p for r in requests]
        by_mass = [i for i, p in enumerate(top_p) if p < 1.0]
        by_rank = [i for i, k in enumerate(top_k) if k and top_p[i] >= 1.0]
        if by_rank:
            rows = torch.tensor(by_rank)
            ks = torch.tensor([top_k[i] for i in by_rank])
            top = logits[rows].topk(int(ks.max()), dim=-1).values
            kth = top.gather(1, (ks - 1).unsqueeze(1))  # ties with the k-th stay in
            logits[rows] = logits[rows].masked_fill(logits[rows] < kth, float("-inf"))
        if by_mass:
            rows = torch.tensor(by_mass)
            ks = torch.tensor([top_k[i] or vocab for i in by_mass])
            ps = torch.tensor([top_p[i] for i in by_mass], dtype=logits.dtype)
            logits[rows] = _cut_by_rank_and_mass(logits[rows], ks, ps)
        return logits.softmax(dim=-1)


class _BatchedPass:
    """What a batched sampling pass changes besides its result, taken before it so that a
    failed pass can be undone before each row is sampled alone:

    - the logprobs it appended to each request (a fork's first tokens are assigned whole, so
      a second pass just replaces them);
    - the default CPU generator, which rows without a seed draw their noise from: a pass that
      failed after drawing advanced it, and the rows sampled alone would draw other noise
      than the batch would have given them. Seeded rows need nothing: each draw builds its
      generator from (seed, position) (``Sampler._generator``), so it never advances
      between passes. Penalty state catches up from ``output_token_ids``, which sampling
      does not change, so it is the same after a second pass.

    Exact for unseeded rows when no unseeded n > 1 request has its first token in the batch
    (the batch draws every row's token before the forks', row by row draws each row's forks
    after it, so the order of draws from the one generator differs)."""

    def __init__(self, num_logprobs: list[int], generator_state: torch.Tensor | None):
        self.num_logprobs = num_logprobs
        self.generator_state = generator_state

    @classmethod
    def before(cls, requests: Sequence[Request]) -> _BatchedPass:
        unseeded = any(r.sampling.seed is None and not r.sampling.is_greedy for r in requests)
        state = torch.get_rng_state() if unseeded else None
        return cls([len(r.output_logprobs) for r in requests], state)

    def restore_generator(self) -> None:
        if self.generator_state is not None:
            torch.set_rng_state(self.generator_state)

    def restore_logprobs(self, row: int, req: Request) -> None:
        del req.output_logprobs[self.num_logprobs[row] :]


def _cut_by_min_p(logits: torch.Tensor, min_p: Sequence[float]) -> None:
    """In place: in each row with a min-p, the tokens whose probability is under min_p x the
    top token's become -inf. p_i < min_p * p_max is logit_i < logit_max + log(min_p): no
    softmax needed, and the top token (and any tied with it) always stays."""
    rows = [i for i, p in enumerate(min_p) if p > 0.0]
    if not rows:
        return
    index = torch.tensor(rows, device=logits.device)
    ratio = torch.tensor([min_p[i] for i in rows], dtype=logits.dtype, device=logits.device)
    sub = logits[index]
    cut = sub.max(dim=-1, keepdim=True).values + ratio.log().unsqueeze(1)
    logits[index] = sub.masked_fill(sub < cut, float("-inf"))


def _cut_by_rank_and_mass(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """Rows cut to their ``top_k`` best tokens, then to the smallest prefix whose mass reaches
    ``top_p`` (always at least the top token); the rest -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1]).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def logprob_entries(
    logits: torch.Tensor,  # [n, vocab]
    temperatures: Sequence[float],  # per row; 0 (greedy) counts as 1
    token_ids: Sequence[int],  # per row: the token whose logprob is reported
    top_ks: Sequence[int],  # per row: how many alternatives to report
) -> list[TokenLogprob]:
    """Each row's log-softmax at its token, and its top-k, in one batched pass."""
    temps = torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=logits.device)
    logprobs = (logits.float() / temps.unsqueeze(1)).log_softmax(dim=-1).clamp_(min=MIN_LOGPROB)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)
    chosen = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    k = max(top_ks, default=0)
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0])
    top_vals, top_ids = top_vals.tolist(), top_ids.long().tolist()
    return [
        TokenLogprob(lp, tuple(zip(top_ids[j][: top_ks[j]], top_vals[j][: top_ks[j]])))
        for j, lp in enumerate(chosen)
    ]
