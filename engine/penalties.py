"""Logit bias and vLLM's penalties (presence, frequency, repetition), applied on the batch.

A request's logit bias becomes tensors the first time it is sampled (a whole row when it
covers much of the vocabulary, else token ids and values); each step adds a whole row to its
own row in place and scatters the batch's sparse ones in one op, so a vocabulary-sized bias
costs a step one add over its own row, not a Python loop over its entries nor a copy of the
batch. ``apply_`` works in place on the rows that ask for something (the engine's sampler owns
its step's logits); ``apply`` leaves its input as it was.

Each penalized request keeps two vocab-sized vectors here: a mask of its prompt tokens and the
count of each output token. The counts grow by the tokens sampled since the last step, so a
step costs O(batch x vocab) tensor work whatever the sequence length, and no Python loop runs
per token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.request import Request


class _History:
    """A request's token statistics on the logits' device."""

    def __init__(self, req: Request, vocab: int, device: torch.device):
        self.prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
        ids = torch.tensor(req.prompt_token_ids, dtype=torch.int64, device=device)
        self.prompt_mask[ids[ids < vocab]] = True
        self.output_counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.num_counted = 0

    def catch_up(self, req: Request) -> None:
        new = req.output_token_ids[self.num_counted :]
        if new:
            ids = torch.tensor(new, dtype=torch.int64, device=self.output_counts.device)
            ones = torch.ones(len(new), dtype=torch.float32, device=ids.device)
            self.output_counts.index_put_((ids,), ones, accumulate=True)
            self.num_counted = len(req.output_token_ids)


class _Bias:
    """A request's ``logit_bias`` as tensors on the logits' device, built once: each step adds
    it in one tensor op, whatever its size. A bias over at least 1/``DENSE_FRACTION`` of the
    vocabulary is kept as a whole row (one add beats a scatter of that many entries: 0.03 vs
    0.2 ms at 32k); a smaller one as (ids, values), scattered."""

    DENSE_FRACTION = 8

    def __init__(self, pairs: tuple[tuple[int, float], ...], vocab: int, device, dtype):
        self.pairs = pairs  # the SamplingParams' own tuple: rebuilt if it is another
        ids = torch.tensor([t for t, _ in pairs], dtype=torch.int64)
        vals = torch.tensor([b for _, b in pairs], dtype=dtype)
        keep = ids < vocab  # the router checks ids; a direct caller cannot crash a batch
        self.ids, self.vals = ids[keep].to(device), vals[keep].to(device)
        self.dense = None
        if len(self.ids) * self.DENSE_FRACTION >= vocab:
            self.dense = torch.zeros(vocab, dtype=dtype, device=device)
            self.dense.index_put_((self.ids,), self.vals, accumulate=True)


class Penalties:
    def __init__(self) -> None:
        self._histories: dict[str, _History] = {}
        self._biases: dict[str, _Bias] = {}

    def release(self, request_id: str) -> None:
        self._histories.pop(request_id, None)
        self._biases.pop(request_id, None)

    @staticmethod
    def changes(req: Request) -> bool:
        """Whether ``apply`` changes this request's row."""
        return bool(req.sampling.logit_bias) or req.sampling.has_penalties

    def apply(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """``logits`` [B, vocab] with each row's bias and penalties applied (a new tensor when
        any applies; the input is returned untouched otherwise)."""
        if not any(self.changes(r) for r in requests):
            return logits
        return self.apply_(logits.clone(), requests)

    @torch.inference_mode()  # the runner's logits are inference tensors: written in place here
    def apply_(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """``apply`` in place: only the rows of requests that ask for a bias or penalties are
        read and written, so the others cost nothing (no copy of the batch)."""
        self._apply_logit_bias(logits, requests)
        rows = [i for i, r in enumerate(requests) if r.sampling.has_penalties]
        if not rows:
            return logits
        reqs = [requests[i] for i in rows]
        vocab, device = logits.shape[-1], logits.device
        for req in reqs:
            hist = self._histories.get(req.request_id)
            if hist is None:
                hist = self._histories[req.request_id] = _History(req, vocab, device)
            hist.catch_up(req)
        hists = [self._histories[r.request_id] for r in reqs]
        counts = torch.stack([h.output_counts for h in hists])
        prompt_mask = torch.stack([h.prompt_mask for h in hists])
        idx = torch.tensor(rows, device=device)
        logits[idx] = penalize(logits[idx], reqs, counts, prompt_mask)
        return logits

    def _apply_logit_bias(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """Each biased row plus its request's cached ``_Bias``, in place: a whole row by one
        add on its own row (a view: no gather, no copy of other rows), the sparse ones in one
        scatter for the batch; per step, a Python loop over the biased requests only, none
        over their entries."""
        rows = [i for i, r in enumerate(requests) if r.sampling.logit_bias]
        if not rows:
            return
        biases = [self._bias(requests[i], logits) for i in rows]
        for i, b in zip(rows, biases):
            if b.dense is not None:
                logits[i].add_(b.dense)
        sparse = [(i, b) for i, b in zip(rows, biases) if b.dense is None]
        if sparse:
            device = logits.device
            ids = torch.cat([b.ids for _, b in sparse])
            lengths = torch.tensor([len(b.ids) for _, b in sparse], device=device)
            row_ids = torch.tensor([i for i, _ in sparse], device=device)
            vals = torch.cat([b.vals for _, b in sparse])
            logits.index_put_((row_ids.repeat_interleave(lengths), ids), vals, accumulate=True)

    def _bias(self, req: Request, logits: torch.Tensor) -> _Bias:
        pairs = req.sampling.logit_bias
        bias = self._biases.get(req.request_id)
        if bias is None or bias.pairs is not pairs:
            bias = _Bias(pairs, logits.shape[-1], logits.device, logits.dtype)
            self._biases[req.request_id] = bias
        return bias


def penalize(
    logits: torch.Tensor,  # [b, vocab]
    requests: Sequence[Request],
    counts: torch.Tensor,  # [b, vocab] float: times each token was generated
    prompt_mask: torch.Tensor,  # [b, vocab] bool: token occurs in the prompt
) -> torch.Tensor:
    """vLLM's ``apply_penalties``: repetition first (on tokens seen in prompt or output), then
    frequency x count and presence on output tokens."""

    def column(name: str) -> torch.Tensor:
        vals = [getattr(r.sampling, name) for r in requests]
        return torch.tensor(vals, dtype=logits.dtype, device=logits.device).unsqueeze(1)

    generated = counts > 0
    rep = torch.where(prompt_mask | generated, column("repetition_penalty"), 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - column("frequency_penalty") * counts
    return logits - column("presence_penalty") * generated.to(logits.dtype)
