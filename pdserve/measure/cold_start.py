"""The first request after ready, against the ones after it: is the server warm when it says so?

Eleven requests of the same size go one at a time, right after the server reports ready: the
first one's TTFT is divided by the median TTFT of the next ten. A server that finishes its
one-off work (kernel compilation, primitive creation, first page faults) before it reports
ready scores about 1x; the target is at most 1.5x. Each prompt starts with its own number, so
no request reuses another's prefix cache and all of them prefill the same number of tokens.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

COLD_START_TARGET = 1.5  # first TTFT / median of the next ones
DEFAULT_FOLLOWERS = 10
PROBE_MAX_TOKENS = 2  # TTFT is what is measured; a second token shows the stream goes on


def probe_prompt(index: int, nonce: str) -> str:
    """The same words for every request, behind a distinct leading number (no shared prefix)."""
    return (
        f"{index:03d}-{nonce}. Once upon a time, in a small village by the sea, there lived an "
        "old fisherman who told stories to the children every evening. One night he began"
    )


@dataclass(frozen=True)
class ColdStart:
    first_ttft_s: float
    next_ttfts_s: tuple[float, ...]

    @property
    def median_next_s(self) -> float:
        return statistics.median(self.next_ttfts_s)

    @property
    def ratio(self) -> float:
        return self.first_ttft_s / max(self.median_next_s, 1e-9)

    @property
    def met(self) -> bool:
        return self.ratio <= COLD_START_TARGET

    def line(self) -> str:
        verdict = "met" if self.met else "NOT met"
        return (
            f"first request after ready: TTFT {self.first_ttft_s * 1e3:.1f} ms; median of the "
            f"next {len(self.next_ttfts_s)}: {self.median_next_s * 1e3:.1f} ms; ratio "
            f"{self.ratio:.2f}x (target <= {COLD_START_TARGET}x: {verdict})"
        )

    def to_dict(self) -> dict:
        return {
            "first_ttft_s": self.first_ttft_s,
            "next_ttfts_s": list(self.next_ttfts_s),
            "median_next_ttft_s": self.median_next_s,
            "ratio": self.ratio,
            "target": COLD_START_TARGET,
        }


async def measure_cold_start(
    first_token_after: Callable[[int], Awaitable[float]], followers: int = DEFAULT_FOLLOWERS
) -> ColdStart:
    """``first_token_after(i)`` sends probe request ``i`` and returns its TTFT in seconds
    (raising if it fails); requests go one at a time, so none waits behind another."""
    if followers < 1:
        raise ValueError(f"followers must be >= 1, got {followers}")
    ttfts = [await first_token_after(i) for i in range(followers + 1)]
    return ColdStart(ttfts[0], tuple(ttfts[1:]))


class Stopwatch:
    """TTFT of one streamed request: start at send, stop at the first chunk with a token."""

    def __init__(self) -> None:
        self.sent = time.perf_counter()
        self.ttft_s: float | None = None

    def token(self) -> None:
        if self.ttft_s is None:
            self.ttft_s = time.perf_counter() - self.sent
