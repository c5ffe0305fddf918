"""What the receivers of one-sided writes share (nixl: NIXL WRITEs; shm: copies into a shared
memory cache): a sender that proved the cluster token is handed one live lease's blocks, writes
into them itself, and commits with the cells it wrote and a digest of their bytes
(kv_transfer.nixl.commit); the receiver checks that digest against its leased blocks.

- ``refuse_open_without_token``: neither serves off loopback without the cluster token.
- ``HandedLeases``: which control connections hold which leases' blocks. A write cannot be
  refused once posted, so a lease counts its writers (Lease.remote_writers) from hand-out
  until each settles (its commit came, its stream ended, its connection closed); the decode
  worker parks a released lease's blocks until then.
- ``digest_check``: the commit's check of the leased blocks' bytes against its digest.
"""

from __future__ import annotations

from collections.abc import Callable

from grpc_plumbing.auth import OpenBindError, is_loopback
from kv_transfer.errors import FrameError
from kv_transfer.lease import Lease
from kv_transfer.nixl.commit import NO_DIGEST, cell_crcs, digest
from kv_transfer.nixl.control import field


def refuse_open_without_token(transport: str, host: str, token: str | None) -> None:
    """Off loopback only with the cluster token: the control port hands out where the cache
    is (its blocks' addresses, or its shared memory), which only cluster members may learn."""
    if token is None and not is_loopback(host):
        raise OpenBindError(f"refusing to serve {transport} KV on {host} without a cluster token")


class HandedLeases:
    """Leases whose blocks were handed to writers, per control connection. A connection keeps
    ``handed`` (lease id -> Lease, the ones it holds); every method that changes a lease's
    writers takes the receiver's lock, under which the worker frees blocks."""

    def __init__(self, receiver, on_none_left: Callable[[str], None] | None = None):
        self._receiver = receiver
        # lease id -> the handed maps of the connections holding it (a sender that reconnected
        # after a break may hold it on two until the old connection ends)
        self._holders: dict[str, list[dict]] = {}
        self._on_none_left = on_none_left  # called under the lock when its last writer settles

    def hand(self, message: dict, handed: dict) -> Lease:
        """The live lease ``message`` names (``lease``, ``request``), now counted as written by
        the connection of ``handed``; FrameError when it is unknown, expired, another
        request's, committed or refused."""
        lease_id, request_id = field(message, "lease", str), field(message, "request", str)
        leases = self._receiver.leases
        leases.wait_for(lease_id, self._receiver.pending_lease_wait_s)
        lease = leases.get(lease_id)
        if lease.request_id != request_id:
            raise FrameError(f"lease {lease_id[:64]} belongs to another request")
        if lease.is_committed or lease.commit_refused is not None:
            raise FrameError(f"lease {lease_id[:64]} is committed or refused")
        with self._receiver.lock:  # the worker frees blocks under it: no release in between
            if lease.lease_id not in handed:
                lease.remote_writers += 1
                handed[lease.lease_id] = lease
                self._holders.setdefault(lease.lease_id, []).append(handed)
        return lease

    def held(self, lease_id: str) -> Lease | None:
        """The lease if a writer holds it now; call under the receiver's lock."""
        holders = self._holders.get(lease_id)
        return holders[0].get(lease_id) if holders else None

    def settle(self, lease_id: str, handed: dict | None = None) -> None:
        """The writer of ``lease_id`` on the connection of ``handed`` is done (None: every
        writer, its commit came): its blocks may be reused once none is left."""
        with self._receiver.lock:
            holders = self._holders.get(lease_id, [])
            for holder in [h for h in holders if handed is None or h is handed]:
                holders.remove(holder)
                lease = holder.pop(lease_id, None)
                if lease is not None:
                    lease.remote_writers -= 1
            if not holders:
                self._holders.pop(lease_id, None)
                if self._on_none_left is not None:
                    self._on_none_left(lease_id)

    def settle_all(self, handed: dict) -> None:
        """The connection of ``handed`` is gone: it writes no more."""
        for lease_id in list(handed):
            self.settle(lease_id, handed)


def digest_check(rows, commit, early: dict | None = None) -> Callable[[Lease], str | None] | None:
    """The check of a commit's written bytes against its digest, for
    KVReceiver.commit_written (None where the cache is not on the host: ``rows`` None).
    ``rows``: per layer, the K and V caches as [blocks, bytes] arrays (commit.block_rows);
    ``early``: {write index: (layer, positions, CRCs)} of writes hashed as they landed."""
    if rows is None:
        return None
    if commit.digest == NO_DIGEST:
        return lambda lease: "commit notification carries no digest of its KV"
    early = early or {}

    def check(lease) -> str | None:
        # Writes in order, a later one's CRCs replacing an earlier one's for a cell it
        # rewrote. A cell's CRC is from after its last write landed (hashed as that write
        # landed, or now), and a sender writes a layer again only once its previous write of
        # it completed: so it is the CRC of the cell's final bytes.
        cells = {}
        for index, (layer, positions) in enumerate(commit.writes):
            hashed = early.get(index)
            if hashed is not None and hashed[:2] == (layer, tuple(positions)):
                crcs = hashed[2]
            else:  # not hashed as it landed: hash it now
                blocks = [lease.block_ids[p] for p in positions]
                crcs = cell_crcs(rows[layer][0], rows[layer][1], blocks)
            cells.update({(layer, p): c for p, c in zip(positions, crcs)})
        if digest(cells) != commit.digest:
            return "KV in the leased blocks does not match the commit's digest"
        return None

    return check
