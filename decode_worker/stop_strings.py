"""Stop strings on the decode worker, for the sequences of an n > 1 request. The router cuts
each sequence's text at its stop string, but one Decode stream carries all n, so it cannot
cancel one of them: the worker ends that sequence itself, at the same token (the one whose
text completes the stop string), instead of running it to max_tokens."""

from __future__ import annotations

from engine.request import Request
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


class StopStrings:
    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self._texts: dict[str, IncrementalDetokenizer] = {}

    def hit(self, req: Request) -> bool:
        """Whether ``req``'s latest output token completes one of its stop strings."""
        stops = req.sampling.stop
        if not stops or self.tokenizer is None or not req.output_token_ids:
            return False
        detok = self._texts.get(req.request_id)
        if detok is None:  # first look: the tokens before the latest (a prefill's, a fork's)
            skip = req.sampling.skip_special_tokens  # the text the router matches
            detok = IncrementalDetokenizer(self.tokenizer, skip)
            self._texts[req.request_id] = detok
            for token in req.output_token_ids[:-1]:
                detok.push(token)
            start = 0
        else:
            start = max(0, len(detok.text) - max(len(s) for s in stops) + 1)
        detok.push(req.output_token_ids[-1])
        return any(detok.text.find(stop, start) >= 0 for stop in stops)

    def forget(self, request_id: str) -> None:
        self._texts.pop(request_id, None)
