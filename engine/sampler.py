"""Batched sampling: greedy, temperature, top-k, top-p, per-request seeds, min_tokens.

Random draws use the exponential-race trick (argmax of p / Exp(1) is a sample from p), so
each row can draw from its own seeded generator while the filtering stays batched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.request import Request


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        """One token per row of ``logits`` [B, vocab] (fp32) for the matching request."""
        logits = self._apply_min_tokens(logits, requests)
        greedy = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(requests) if not r.sampling.is_greedy]
        if not random_rows:
            return greedy.tolist()
        out = greedy.tolist()
        rows = torch.tensor(random_rows)
        # Random rows are drawn on the CPU (from GPU logits too): a seed gives the same tokens
        # on every device, and the rows are few next to the forward.
        probs = self._filtered_probs(logits[rows].cpu(), [requests[i] for i in random_rows])
        for j, i in enumerate(random_rows):
            noise = torch.empty_like(probs[j]).exponential_(generator=self._generator(requests[i]))
            out[i] = int((probs[j] / noise).argmax())
        return out

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, req: Request) -> torch.Generator | None:
        if req.sampling.seed is None:
            return None
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator().manual_seed(req.sampling.seed)
            self._generators[req.request_id] = gen
        return gen

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        banned = [
            (i, list(r.eos_token_ids) + list(r.sampling.stop_token_ids))
            for i, r in enumerate(requests)
            if len(r.output_token_ids) < r.sampling.min_tokens
        ]
        if not banned:
            return logits
        logits = logits.clone()
        for i, ids in banned:
            logits[i, ids] = float("-inf")
        return logits

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        temps = torch.tensor([r.sampling.temperature for r in requests], dtype=logits.dtype)
        logits = logits / temps.unsqueeze(1)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        top_k = torch.tensor([r.sampling.top_k or vocab for r in requests])
        ranks = torch.arange(vocab).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
        top_p = torch.tensor([r.sampling.top_p for r in requests], dtype=logits.dtype)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
        filtered = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
        return filtered.softmax(dim=-1)
