"""Leases: the decode side's reservation of destination blocks for one incoming transfer.

The decode worker opens a lease when it reserves blocks for a request, and only accepts frames
that name a live lease and stay inside its blocks. The lease id may be chosen by the caller, so
the router can send the prefill toward a lease whose reservation is still in flight: a frame
that arrives first waits for the lease (``wait_for``), and fails at once if the reservation
is refused. A lease that is not committed by its deadline is popped so the worker can free
its blocks.

A lease opened by a table that knows its cache's layers (``LeaseTable(num_layers=...)``, as a
decode worker's does) promises KV for every layer x every block: the receiver records which
(layer, block) cells its frames filled, and a commit that leaves one empty is refused (the
Decode must never run on stale KV). A refused commit is final: later frames are refused too,
and the lease's blocks stay its own until it is released or expires. Decode calls ``claim``
the lease while they wait for its KV; once one attached it, any other is refused.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from kv_transfer.errors import FrameError

# A lease pins blocks until its deadline: an infinite, NaN or year-long one would pin them for
# good (the deadline comparison is never true for NaN). The worker's default TTL may be higher.
MAX_LEASE_TTL_S = 600.0
DEFAULT_LEASE_TTL_S = 30.0  # a reservation the router never fills expires after this


def lease_ttl_problem(ttl_s, max_ttl_s: float = MAX_LEASE_TTL_S) -> str | None:
    """Why ``ttl_s`` cannot be a lease's time to live (None when it can): it must be a finite
    number of seconds in (0, max_ttl_s]; the message names the limit."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)):
        return "must be a number of seconds"
    if not math.isfinite(ttl_s) or ttl_s <= 0 or ttl_s > max_ttl_s:
        return f"must be finite and in (0, {max_ttl_s:g}] seconds (limit max_lease_seconds)"
    return None


class LeaseStateError(Exception):
    """The lease is not in the state the call needs (gRPC FAILED_PRECONDITION): a Decode on
    a lease another Decode attached already, or on one whose commit was refused."""


class CommitSignal:
    """A lease's "every frame is in": a ``threading.Event`` (set / is_set / wait) whose
    waiters can also be let go without it being set, so that a Decode call waiting for the KV
    gives its server thread back as soon as its caller leaves: ``wait(timeout, cancelled)``
    returns once ``cancelled`` is set and ``wake()`` is called."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._set = False

    def set(self) -> None:
        with self._cond:
            self._set = True
            self._cond.notify_all()

    def is_set(self) -> bool:
        return self._set

    def wake(self) -> None:
        """Make the waiters look at their ``cancelled`` again (set it first)."""
        with self._cond:
            self._cond.notify_all()

    def wait(self, timeout: float | None = None, cancelled: threading.Event | None = None) -> bool:
        """True once set; False after ``timeout`` or once cancelled, unless set by then."""
        with self._cond:
            self._cond.wait_for(lambda: self._set or (cancelled and cancelled.is_set()), timeout)
            return self._set


@dataclass
class Lease:
    lease_id: str
    request_id: str
    block_ids: tuple[int, ...]  # destination blocks reserved on the decode worker
    # time.monotonic() after which the lease is dead, committed or not: a commit moves it to
    # commit time + ttl_s (the window for the Decode call to attach), so the blocks of a
    # committed lease that nobody attaches (the router crashed, the client left) come back.
    deadline: float
    ttl_s: float = DEFAULT_LEASE_TTL_S
    frames_received: int = 0  # kv frames accepted
    bytes_received: int = 0  # kv payload bytes accepted
    committed: CommitSignal = field(default_factory=CommitSignal)
    first_frame_at: float | None = None  # monotonic time of the first accepted kv frame
    committed_at: float | None = None  # monotonic time the commit frame was accepted
    # Layers whose every block the commit must cover (None: the frame count alone decides).
    num_layers: int | None = None
    # [(layer * blocks + block) * num_heads + head] filled; num_heads 1 where frames carry
    # every KV head, the model's KV heads where a tensor-parallel sender ships rank slices.
    covered: bytearray = field(default_factory=bytearray)
    num_heads: int = 1
    num_covered: int = 0
    commit_refused: str | None = None  # why the commit was refused (final)
    # Its first blocks hold their KV already (the decode worker's prefix cache, shared with
    # other sequences): no frame may write them, and the commit counts them as covered.
    first_block: int = 0
    decodes: int = 0  # Decode calls on the lease now (waiting for its KV, or attaching)
    attached: bool = False  # a Decode took its blocks (closed with attached=True)
    # Senders handed the addresses of its blocks for one-sided writes (nixl) that may still
    # be writing: a write cannot be refused once posted, so its blocks are not reused before
    # they settle (their commit notification came, their link is gone) or the deadline passes
    # (they post nothing within a second of it).
    remote_writers: int = 0

    @property
    def is_committed(self) -> bool:
        return self.committed.is_set()

    def __post_init__(self) -> None:
        for layer in range(self.num_layers or 0) if self.first_block else ():
            self.cover(layer, range(self.first_block))

    def cover(self, layer: int, positions, heads: tuple[int, int] | None = None) -> None:
        """Frames filled ``positions`` (in the lease) of ``layer``, for the model's KV heads
        ``heads`` [lo, hi) (a tensor-parallel rank's slice; None: all of them)."""
        if self.num_layers is None:
            return
        n, units = len(self.block_ids), self.num_heads
        lo, hi = (0, units) if heads is None else heads
        if not self.covered:
            self.covered = bytearray(self.num_layers * n * units)
        filled = bytes([1]) * (hi - lo)
        for b in positions:
            at = (layer * n + b) * units
            self.num_covered += (hi - lo) - self.covered[at + lo : at + hi].count(1)
            self.covered[at + lo : at + hi] = filled

    def missing(self) -> str | None:
        """What a commit now would leave without KV (None: every promised cell is filled)."""
        n, units = len(self.block_ids), self.num_heads
        cells = self.num_layers * n if self.num_layers is not None else 0
        if self.num_layers is None or self.num_covered == cells * units:
            return None
        covered = self.covered or bytearray(cells * units)
        full = bytes([1]) * units
        empty = [c for c in range(cells) if covered[c * units : (c + 1) * units] != full]
        layer = empty[0] // n
        blocks = [c % n for c in empty if c // n == layer]
        heads = "" if units == 1 else f" for {units} KV heads"
        return (
            f"{len(empty)} of {self.num_layers} x {n} (layer x block) cells have no KV{heads} "
            f"(first: layer {layer}, blocks {blocks[:8]})"
        )

    def writes_may_land_until(self) -> float | None:
        """Until when a one-sided write into its blocks may still land (None: none can)."""
        return self.deadline if self.remote_writers > 0 else None

    def is_expired(self, now: float) -> bool:
        return now > self.deadline

    def mark_committed(self) -> None:
        """Every frame is in: the Decode call has a fresh ``ttl_s`` to attach."""
        self.committed_at = time.monotonic()
        self.deadline = max(self.deadline, self.committed_at + self.ttl_s)
        self.committed.set()


class LeaseTable:
    """Thread-safe map lease_id -> Lease; the receiver reads it, the worker opens/closes."""

    MAX_REFUSED = 1024  # refused ids remembered for frames still on their way
    MAX_ATTACHED = 4096  # attached ids remembered, so a second Decode is told why

    def __init__(
        self,
        default_ttl_s: float = DEFAULT_LEASE_TTL_S,
        max_ttl_s: float | None = None,
        num_layers: int | None = None,
        num_heads: int = 1,
    ):
        """``num_layers``: the cache's layers, every one of which each lease's commit must
        cover (None: the frame count alone decides, for tables without a cache behind);
        ``num_heads``: the model's KV heads, each of which it must cover in each layer x
        block (frames may carry a slice of them: kv_transfer/frame.py)."""
        self.max_ttl_s = max(MAX_LEASE_TTL_S, default_ttl_s) if max_ttl_s is None else max_ttl_s
        self._check_ttl(default_ttl_s)
        self.default_ttl_s = default_ttl_s
        self.num_layers = num_layers
        self.num_heads = num_heads
        self._leases: dict[str, Lease] = {}
        self._refused: OrderedDict[str, str] = OrderedDict()
        self._attached: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)

    def open(
        self,
        request_id: str,
        block_ids,
        ttl_s: float | None = None,
        lease_id: str | None = None,
        first_block: int = 0,
    ) -> Lease:
        """Open a lease on ``block_ids``; ``lease_id`` is the caller's (unique) or a new one;
        the first ``first_block`` blocks hold their KV already (see Lease.first_block)."""
        ttl = self.default_ttl_s if ttl_s is None else ttl_s
        self._check_ttl(ttl)
        lease = Lease(
            lease_id=lease_id or uuid.uuid4().hex,
            request_id=request_id,
            block_ids=tuple(int(b) for b in block_ids),
            deadline=time.monotonic() + ttl,
            ttl_s=ttl,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            first_block=first_block,
        )
        with self._changed:
            if lease.lease_id in self._leases:
                raise ValueError(f"lease {lease.lease_id[:64]} already exists")
            self._leases[lease.lease_id] = lease
            self._changed.notify_all()
        return lease

    def refuse(self, lease_id: str, reason: str) -> None:
        """The reservation for ``lease_id`` failed: frames waiting for it fail now."""
        self._remember_ended(lease_id, f"was refused: {reason}")

    def _remember_ended(self, lease_id: str, why: str) -> None:
        """Frames for ``lease_id`` from now on fail at once with ``why`` (released, expired,
        refused), instead of waiting pending_lease_wait_s for a lease that will not come."""
        with self._changed:
            self._refused[lease_id] = why
            while len(self._refused) > self.MAX_REFUSED:
                self._refused.popitem(last=False)
            self._changed.notify_all()

    def wait_for(self, lease_id: str, timeout: float) -> None:
        """Return once ``lease_id`` is open (at once if it is); FrameError if it was refused or
        does not open within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while lease_id not in self._leases:
                if lease_id in self._refused:
                    raise FrameError(f"lease {lease_id[:64]} {self._refused[lease_id]}")
                if lease_id in self._attached:
                    raise FrameError(f"lease {lease_id[:64]} is attached already")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FrameError(f"unknown lease {lease_id[:64]}")
                self._changed.wait(left)

    def __contains__(self, lease_id: str) -> bool:
        with self._lock:
            return lease_id in self._leases

    def get(self, lease_id: str) -> Lease:
        with self._lock:
            lease = self._leases.get(lease_id)
        if lease is None:
            raise FrameError(f"unknown lease {lease_id[:64]}")
        if lease.is_expired(time.monotonic()):
            raise FrameError(f"lease {lease_id} expired")
        return lease

    def claim(self, lease_id: str) -> Lease:
        """The live lease ``lease_id``, for one more Decode call (``unclaim`` when it ends).
        FrameError when it is unknown or expired; LeaseStateError when a Decode attached it."""
        with self._lock:
            if lease_id in self._attached:
                raise LeaseStateError(f"lease {lease_id[:64]} is attached already")
        lease = self.get(lease_id)
        with self._lock:
            lease.decodes += 1
        return lease

    def unclaim(self, lease: Lease) -> int:
        """A Decode call on ``lease`` ended; how many still are on it."""
        with self._lock:
            lease.decodes -= 1
            return lease.decodes

    def close(self, lease_id: str, attached: bool = False) -> Lease | None:
        """Remove the lease (its blocks are the caller's now); ``attached``: a Decode took
        them, and a later claim of the id is told so; else later frames fail at once."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is not None and attached:
                lease.attached = True
                self._attached[lease_id] = None
                while len(self._attached) > self.MAX_ATTACHED:
                    self._attached.popitem(last=False)
        if lease is not None and not attached:
            self._remember_ended(lease_id, "was released")
        return lease

    def in_use(self, lease_id: str) -> bool:
        """Open now, or attached recently: a new reservation may not take the id."""
        with self._lock:
            return lease_id in self._leases or lease_id in self._attached

    def ttl_problem(self, ttl_s) -> str | None:
        return lease_ttl_problem(ttl_s, self.max_ttl_s)

    def _check_ttl(self, ttl_s) -> None:
        problem = self.ttl_problem(ttl_s)
        if problem is not None:
            raise ValueError(f"lease_seconds {ttl_s!r}: {problem}")

    def extend(self, lease_id: str, ttl_s: float) -> None:
        self._check_ttl(ttl_s)
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                raise FrameError(f"unknown lease {lease_id[:64]}")
            lease.deadline = time.monotonic() + ttl_s

    def pop_expired(self, now: float | None = None) -> list[Lease]:
        """Remove and return the leases past their deadline, committed ones included (a
        committed lease that is attached in time is closed by the worker before that)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            dead = [lease for lease in self._leases.values() if lease.is_expired(now)]
            for lease in dead:
                del self._leases[lease.lease_id]
        for lease in dead:
            self._remember_ended(lease.lease_id, "expired")
        return dead

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)
