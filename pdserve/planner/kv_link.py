"""The KV link between the pools as a shared resource: a bandwidth and a latency, first come
first served, so many transfers at once queue.

A profile's transfer table prices one request's push alone (what ``pdserve profile`` times on
an idle link). At scale the link is shared: a prefill worker's NIC carries every transfer it
sends (``scope="prefill_worker"``), or one fabric carries the whole cluster's (``"cluster"``).
A transfer joins the link's queue when its prefill starts computing (the layer-wise push
streams each layer's KV as the layer ends) and holds the link for ``bytes / bandwidth``; it
cannot end before its compute does plus the last layer's share, and commits ``latency`` later.
With deterministic transfers arriving faster than the link drains them, the k-th waits
``k x (service - gap)``: the D/D/1 queue bound the unit test checks.
"""

from __future__ import annotations

from dataclasses import dataclass

SCOPES = ("prefill_worker", "cluster")


@dataclass(frozen=True)
class KvLink:
    bandwidth_bytes_per_s: float
    latency_s: float = 0.0
    scope: str = "prefill_worker"

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"kv link bandwidth must be > 0, got {self.bandwidth_bytes_per_s}")
        if self.latency_s < 0:
            raise ValueError(f"kv link latency must be >= 0, got {self.latency_s}")
        if self.scope not in SCOPES:
            raise ValueError(f"kv link scope must be one of {SCOPES}, got {self.scope!r}")

    @classmethod
    def from_table(
        cls, nbytes: tuple[float, ...], seconds: tuple[float, ...], scope: str = "prefill_worker"
    ) -> KvLink:
        """The link a profile's transfer table describes: bandwidth from the slope between its
        two largest points (where bytes dominate), latency from the intercept (>= 0)."""
        if len(nbytes) < 2:
            return cls(nbytes[0] / seconds[0], 0.0, scope)
        b0, b1, s0, s1 = nbytes[-2], nbytes[-1], seconds[-2], seconds[-1]
        bw = (b1 - b0) / (s1 - s0) if s1 > s0 else b1 / s1
        return cls(bw, max(0.0, s1 - b1 / bw), scope)


class LinkQueue:
    """One link's FIFO: when each transfer handed to it commits."""

    def __init__(self, link: KvLink):
        self.link = link
        self.free_at = 0.0
        self.transfers = 0
        self.busy_s = 0.0

    def push(self, ready_at: float, compute_end: float, nbytes: float, layers: int) -> float:
        """A transfer whose bytes start streaming at ``ready_at`` from a compute ending at
        ``compute_end``: the time its KV is committed on the decode side."""
        busy = nbytes / self.link.bandwidth_bytes_per_s
        start = max(ready_at, self.free_at)
        end = max(start + busy, compute_end + busy / max(layers, 1))
        self.free_at = end
        self.transfers += 1
        self.busy_s += busy
        return end + self.link.latency_s
