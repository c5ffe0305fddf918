"""Leases: the decode side's reservation of destination blocks for one incoming transfer.

The decode worker opens a lease when it reserves blocks for a request, hands the lease id to
the prefill side, and only accepts frames that name a live lease and stay inside its blocks.
A lease that is not committed by its deadline is popped so the worker can free its blocks.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

from kv_transfer.frame import FrameError


@dataclass
class Lease:
    lease_id: str
    request_id: str
    block_ids: tuple[int, ...]  # destination blocks reserved on the decode worker
    deadline: float  # time.monotonic() after which an uncommitted lease is dead
    frames_received: int = 0  # kv frames accepted
    bytes_received: int = 0  # kv payload bytes accepted
    committed: threading.Event = field(default_factory=threading.Event)
    first_frame_at: float | None = None  # monotonic time of the first accepted kv frame
    committed_at: float | None = None  # monotonic time the commit frame was accepted

    @property
    def is_committed(self) -> bool:
        return self.committed.is_set()

    def is_expired(self, now: float) -> bool:
        return not self.is_committed and now > self.deadline


class LeaseTable:
    """Thread-safe map lease_id -> Lease; the receiver reads it, the worker opens/closes."""

    def __init__(self, default_ttl_s: float = 30.0):
        self.default_ttl_s = default_ttl_s
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()

    def open(self, request_id: str, block_ids, ttl_s: float | None = None) -> Lease:
        ttl = self.default_ttl_s if ttl_s is None else ttl_s
        lease = Lease(
            lease_id=uuid.uuid4().hex,
            request_id=request_id,
            block_ids=tuple(int(b) for b in block_ids),
            deadline=time.monotonic() + ttl,
        )
        with self._lock:
            self._leases[lease.lease_id] = lease
        return lease

    def get(self, lease_id: str) -> Lease:
        with self._lock:
            lease = self._leases.get(lease_id)
        if lease is None:
            raise FrameError(f"unknown lease {lease_id[:64]}")
        if lease.is_expired(time.monotonic()):
            raise FrameError(f"lease {lease_id} expired")
        return lease

    def close(self, lease_id: str) -> Lease | None:
        with self._lock:
            return self._leases.pop(lease_id, None)

    def extend(self, lease_id: str, ttl_s: float) -> None:
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                raise FrameError(f"unknown lease {lease_id[:64]}")
            lease.deadline = time.monotonic() + ttl_s

    def pop_expired(self, now: float | None = None) -> list[Lease]:
        """Remove and return uncommitted leases past their deadline.

        Committed leases stay: the worker hands them to the decode loop and closes them itself.
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            dead = [lease for lease in self._leases.values() if lease.is_expired(now)]
            for lease in dead:
                del self._leases[lease.lease_id]
        return dead

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)
