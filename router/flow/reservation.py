"""Reserving decode blocks for a request's KV: the decode half of the flow's disaggregated path
(router/flow/lifecycle.py). Either a lease named by the router and reserved beside the Prefill
(concurrent: the prefill starts before the answer), or reserved first and waited for, retrying
over the pool until reserve_timeout_s (then 429). With KV-aware routing the reservation names
the prompt's leading blocks the decode worker should hold already (router/flow/kv_route.py):
it pins those and they are not shipped.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc

from engine.block_manager import blocks_for
from protos import pdserve_pb2 as pb
from router.flow import kv_route
from router.flow.attempt import Attempt
from router.flow.request import FlowRequest
from router.flow.types import Overloaded, lease_destination, refused_request

RESERVE_CALL_TIMEOUT_S = 5.0  # one Reserve call; the reservation as a whole has its own limit


class Reservations:
    """RequestFlow's reservation steps (it sets ``cfg`` and ``decode``)."""

    def _decode_candidates(self, request: FlowRequest, num_blocks: int) -> list:
        return kv_route.decode_candidates(self.cfg, self.decode.routable(), request)

    def _plan_concurrent(self, request: FlowRequest, attempt: Attempt) -> bool:
        """Name a lease (not yet reserved) on a decode worker that had blocks to spare at the
        last poll and a stream free in its budget; False where none has. (A reservation the
        stream budget refuses would waste the prefill sent beside it; reserving first, the
        refusal costs a round trip.)"""
        headroom = self.cfg.concurrent_reserve_headroom
        num_blocks = blocks_for(request.num_tokens, self.cfg.block_size)
        if headroom < 0:
            return False
        for w in self._decode_candidates(request, num_blocks):
            st = w.last_status
            if st is None or not st.kv_endpoint or st.block_size != self.cfg.block_size:
                continue  # a worker that does not say where its KV goes, or sizes differ
            if w.free_blocks - num_blocks < headroom * w.total_blocks or not w.has_stream_room():
                continue
            attempt.decode = w
            attempt.destination = pb.KvDestination(
                endpoint=st.kv_endpoint,
                transport=st.kv_transport,
                lease_id=uuid.uuid4().hex,
                block_size=st.block_size,
                num_blocks=num_blocks,
                # Blocks its cache holds (as last polled) are not sent; it refuses the lease
                # if it no longer holds them all, and the request reserves first.
                first_block=kv_route.expected_cached_blocks(self.cfg, w, request),
            )
            return True
        return False

    def _send_reservation(self, request: FlowRequest, attempt: Attempt) -> None:
        """Reserve the planned lease without waiting for the answer (sent just after the
        Prefill, so the prefill worker starts first)."""
        w = attempt.decode
        first = attempt.destination.first_block
        req = pb.ReserveRequest(
            request_id=attempt.attempt_id,
            num_tokens=request.num_tokens,
            lease_id=attempt.lease_id,
            block_hashes=request.block_hashes(self.cfg.block_size)[:first],
        )
        reserve = w.stub.Reserve(req, timeout=self.cfg.reserve_timeout_s)
        w.free_blocks -= attempt.destination.num_blocks - first
        attempt.hold_load(w)
        attempt.reservation = asyncio.ensure_future(reserve)
        if request.trace is not None:
            request.trace.reservation(attempt, w, attempt.reservation)

    async def _reserve(self, request: FlowRequest, attempt: Attempt) -> None:
        """Decode first: never prefill into a pool that has no room. Waits, then 429."""
        deadline = time.monotonic() + self.cfg.reserve_timeout_s
        num_blocks = blocks_for(request.num_tokens, self.cfg.block_size)
        base = pb.ReserveRequest(request_id=attempt.attempt_id, num_tokens=request.num_tokens)
        if request.trace is not None:  # ended once a lease is held, or with the attempt
            span = request.trace.reserve(attempt)
        delay = 0.005
        while True:
            for w in self._decode_candidates(request, num_blocks):
                req = pb.ReserveRequest()
                req.CopyFrom(base)  # and the blocks this one should hold: it pins those it does
                req.block_hashes.extend(kv_route.expected_hashes(self.cfg, w, request))
                try:
                    # A hung worker: try the next one.
                    lease = await w.stub.Reserve(req, timeout=RESERVE_CALL_TIMEOUT_S)
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                        raise refused_request(e) from e
                    continue
                self._hold_lease(attempt, w, lease)
                if request.trace is not None:
                    request.trace.leased(span, w, lease)
                return
            if time.monotonic() > deadline:
                raise Overloaded(f"no decode worker could hold {request.num_tokens} tokens of KV")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)

    def _hold_lease(self, attempt: Attempt, w, lease: pb.ReserveResponse) -> None:
        w.free_blocks -= len(lease.block_ids) - lease.cached_blocks
        attempt.hold_load(w)
        attempt.decode = w
        attempt.destination = lease_destination(lease)
        attempt.reservation = asyncio.get_running_loop().create_future()
        attempt.reservation.set_result(lease)
