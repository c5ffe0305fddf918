"""A decode worker's reservations: blocks held under a lease for KV a prefill worker will send
(kv_transfer/lease.py), by content where the router names the prompt's leading blocks this
worker's prefix cache should hold (they become the lease's first blocks and are not sent), and
the lease's end: released, expired, or parked until no one-sided write can land in its blocks.
"""

from __future__ import annotations

import logging
import time

from engine.block_manager import NoFreeBlocksError
from engine.errors import InvalidRequestError
from kv_transfer.frame import MAX_ID_LEN

log = logging.getLogger("pdserve.decode")
HASH_BYTES = 16  # engine.block_manager.block_hash's digest


class ReservationError(Exception):
    """Not enough free KV blocks for a reservation (the router tries elsewhere or queues)."""


class LeaseReservations:
    """DecodeWorker's reservation half (it sets blocks, leases, receiver, loop, engine)."""

    def reserve(
        self,
        request_id: str,
        num_tokens: int,
        ttl_s: float | None = None,
        lease_id: str | None = None,
        block_hashes: list[bytes] = (),
    ):
        """Allocate blocks for ``num_tokens`` tokens of KV under a new lease (``lease_id`` if
        the caller chose one: its prefill may already be on the way, and a refusal tells the
        frames waiting for the lease to give up). ``block_hashes``: the prompt's leading full
        blocks the caller expects cached here (pdserve.proto ReserveRequest.block_hashes):
        those held become the lease's first blocks (``Lease.first_block``), shared with the
        prefix cache; with ``lease_id``, all of them or ReservationError."""
        try:
            return self._reserve(request_id, num_tokens, ttl_s, lease_id, block_hashes)
        except (ReservationError, InvalidRequestError) as e:
            if lease_id and lease_id not in self.leases:  # not a duplicate of a live one
                self.leases.refuse(lease_id, str(e))
            raise

    def _reserve(self, request_id, num_tokens, ttl_s, lease_id, block_hashes=()):
        for param, value in (("request_id", request_id), ("lease_id", lease_id or "-")):
            if not 0 < len(value) <= MAX_ID_LEN:  # a frame could never name it
                raise InvalidRequestError(param, f"must be 1-{MAX_ID_LEN} characters")
        if num_tokens < 1:
            raise InvalidRequestError("num_tokens", "must be >= 1")
        if ttl_s is not None and (problem := self.leases.ttl_problem(ttl_s)):
            raise InvalidRequestError("lease_seconds", problem)  # NaN would never expire
        if num_tokens >= self.engine.config.max_model_len:
            raise InvalidRequestError(
                "num_tokens", f"exceeds the context of {self.engine.config.max_model_len}"
            )
        n_blocks = self.blocks.blocks_needed(num_tokens)
        # At least the block of the last token is sent (a commit always carries KV).
        if len(block_hashes) > (num_tokens - 1) // self.block_size:
            raise InvalidRequestError(
                "block_hashes", f"at most {(num_tokens - 1) // self.block_size} for {num_tokens}"
            )
        if any(len(h) != HASH_BYTES for h in block_hashes):
            raise InvalidRequestError("block_hashes", f"each must be {HASH_BYTES} bytes")
        with self.loop.lock:
            if self.draining:
                raise ReservationError(f"{self.worker_id} is draining")
            if lease_id and self.leases.in_use(lease_id):  # open, or attached recently
                raise InvalidRequestError("lease_id", f"{lease_id[:64]} is already in use")
            return self._open_lease(request_id, n_blocks, ttl_s, lease_id, block_hashes)

    def _open_lease(self, request_id, n_blocks, ttl_s, lease_id, block_hashes):
        """Under the engine's lock: the lease's blocks, cached ones first."""
        if not block_hashes:
            if not self.blocks.can_allocate(n_blocks):
                raise ReservationError(f"need {n_blocks} blocks, {self.blocks.num_free} free")
            return self.leases.open(request_id, self.blocks.allocate(n_blocks), ttl_s, lease_id)
        held = len(self.blocks.match_hashes(block_hashes))
        if lease_id and held < len(block_hashes):  # its prefill sends from past them
            raise ReservationError(
                f"the prefix cache holds {held} of the {len(block_hashes)} blocks expected"
            )
        try:
            blocks, cached = self.blocks.take_cached(block_hashes[:held], n_blocks - held)
        except NoFreeBlocksError as e:
            raise ReservationError(str(e)) from None
        try:
            return self.leases.open(request_id, blocks, ttl_s, lease_id, first_block=cached)
        except Exception:
            self.blocks.free(blocks)
            raise

    def release(self, lease_id: str) -> bool:
        """Give a lease's blocks back (the prefill failed or the client went away)."""
        with self.loop.lock, self.receiver.lock:
            lease = self.leases.close(lease_id)
            if lease is not None:
                self._free_when_settled(lease)
        return lease is not None

    def _free_when_settled(self, lease) -> None:
        """Free a released lease's blocks now, or once no one-sided write can land in them."""
        if lease.writes_may_land_until() is None:
            self.blocks.free(lease.block_ids)
        else:
            self._parked.append(lease)

    def _free_settled(self) -> None:
        now, parked = time.monotonic(), self._parked
        self._parked = []
        for lease in parked:
            until = lease.writes_may_land_until()
            if until is None or until < now:
                self.blocks.free(lease.block_ids)
            else:
                self._parked.append(lease)

    def _expire_leases(self) -> None:
        with self.receiver.lock:  # no frame may land in a block once it is free again
            for lease in self.leases.pop_expired():
                log.warning(
                    "lease %s of %s expired; freeing %d blocks",
                    lease.lease_id,
                    lease.request_id,
                    len(lease.block_ids),
                )
                self.blocks.free(lease.block_ids)  # its writers post nothing past the deadline
            self._free_settled()
