"""What a disaggregated request's first token waits on besides its prompt step, read from a
stored live run: its TTFT less the prefill worker's step that computed it.

``router_overhead_s`` is timed through the router with fake workers that answer at once. In a
live cluster the reserve and prefill calls reach worker processes whose threads are busy
(KV frames, streamed tokens, the engine thread holding the GIL between kernels), and the first
token comes back through a prefill worker that is still shipping the last layer's frames. On
the Zen 4 VM that path took 8.7-18.8 ms a request (the median of a fidelity run), where one
request at a time through an idle 1P1D cluster takes 6.3 ms.

A run stores each request's send offset (the seeded schedule) and TTFT, and its workers' step
traces their wall-clock starts; the two clocks are tied by the offset that puts a prompt step
just after as many sends as possible. Only requests whose prompt ran in a step of its own,
started on an idle prefill worker before the next send, count: TTFT less that step is then
the path alone, whatever the offset's own error.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence

START_WITHIN_S = 0.030  # a prompt step this soon after a send is that request's
CACHED_AT_MOST = 48  # prompt tokens a step may leave to the prefix cache: else it is a chunk
ALIGN_WINDOW_S = 0.012  # the tie between the clocks: a step starts this soon after a send


def align_offset(sends: Sequence[float], starts: Sequence[float]) -> float:
    """The wall-clock time of send offset 0: the shift that puts a prompt step start within
    ``ALIGN_WINDOW_S`` after the most sends (a few ms after the earliest such start)."""

    def matched(t0: float) -> int:
        n = 0
        for s in sends:
            i = bisect.bisect_left(starts, t0 + s)
            n += i < len(starts) and starts[i] - (t0 + s) <= ALIGN_WINDOW_S
        return n

    candidates = [start - send - ALIGN_WINDOW_S / 2 for start in starts[:60] for send in sends[:3]]
    return max(candidates, key=matched) if candidates else 0.0


def request_hops(
    sends: Sequence[float],
    ttfts: Sequence[float],
    prompts: Sequence[int],
    steps: Sequence[tuple[float, float, int]],
) -> list[float]:
    """Each clean request's TTFT less its prompt step: ``sends`` the send offsets, ``ttfts``
    and ``prompts`` (prompt tokens) the requests' in the same order, ``steps`` the prefill
    worker's prompt steps as (wall-clock start, seconds, prompt tokens), sorted."""
    starts = [t for t, _, _ in steps]
    order = sorted(sends)
    t0 = align_offset(order, starts)
    hops = []
    for send, ttft, prompt in zip(sends, ttfts, prompts, strict=True):
        a = t0 + send
        i = bisect.bisect_left(starts, a)
        if i >= len(steps) or i > 0 and steps[i - 1][0] + steps[i - 1][1] > a:
            continue  # no step after it, or the worker was busy when it came
        start, seconds, tokens = steps[i]
        nxt = bisect.bisect_right(order, send)
        if start - a > START_WITHIN_S or nxt < len(order) and t0 + order[nxt] < start:
            continue  # late (not its own step), or another request joined it
        if tokens + CACHED_AT_MOST < prompt:
            continue  # the first chunk of a longer prompt
        if ttft >= seconds:
            hops.append(ttft - seconds)
    return hops


def hop_beyond_router(hops: Sequence[float], router_overhead_s: float) -> float:
    """``disaggregated_hop_s``: the median path less what the profile charges already."""
    return max(0.0, statistics.median(hops) - router_overhead_s) if hops else 0.0
