"""Engine values as wire messages: what both workers send back to the router."""

from __future__ import annotations

from collections.abc import Sequence

from engine.request import TokenLogprob
from protos import pdserve_pb2 as pb


def logprob_message(entry: TokenLogprob) -> pb.TokenLogprobs:
    top = [pb.TopLogprob(token_id=t, logprob=lp) for t, lp in entry.top]
    return pb.TokenLogprobs(logprob=entry.logprob, top=top)


def logprob_messages(entries: Sequence[TokenLogprob] | None) -> list[pb.TokenLogprobs]:
    return [logprob_message(e) for e in entries or ()]
