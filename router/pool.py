"""The router's view of the worker pools: clients, load counters, draining, status polling."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from grpc_plumbing.auth import TOKEN_KEY
from grpc_plumbing.server import client_keepalive_options, message_options
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router.kv_index import HeldBlocks

log = logging.getLogger("pdserve.router")

SUSPECT_S = 1.0  # how long a worker whose call failed stays out of routing
# Status polls in a row that may time out before a worker leaves routing. A worker busy past
# the poll's timeout is slow, not gone (under overload its prefill steps hold the CPU), and
# taking it out sends every request to the local path or a 429; a dead one refuses the
# connection (UNAVAILABLE) and leaves at its first missed poll, a hung one at this many.
MAX_SLOW_POLLS = 3


@dataclass(frozen=True)
class BreakerSettings:
    """A worker's circuit breaker: after ``failures`` failed attempts in a row it leaves
    routing for ``cooldown_s``; then it is half-open (routable again), and its next outcome
    decides: a success closes the circuit, a failure opens it for another cool-down."""

    failures: int = 3
    cooldown_s: float = 10.0
    # At most this share of a pool's workers may be out of routing on an open circuit at once
    # (Envoy's outlier detection: max_ejection_percent): past it a failing worker stays in
    # routing (counted in ``ejections_refused``, logged), so the breaker never empties a pool.
    max_ejection_percent: float = 50.0


BREAKER = BreakerSettings()

# The workers' message limits, and keepalive pings: a worker that stops answering (frozen,
# partitioned) fails its calls within KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS even when no
# deadline would (grpc_plumbing.server; the workers' servers permit the pings).
CHANNEL_OPTIONS = message_options() + client_keepalive_options()


@dataclass
class WorkerHandle:
    address: str
    role: str  # "prefill" | "decode"
    channel: grpc.aio.Channel
    stub: object
    draining: bool = False
    healthy: bool = False
    # What the router itself has in flight there: exact for a single router, no polling lag.
    # Changed only by load() below.
    inflight_tokens: int = 0
    inflight_requests: int = 0
    served_requests: int = 0
    # From the last Status poll, adjusted by reservations made since.
    free_blocks: int = 0
    total_blocks: int = 0
    last_status: pb.WorkerStatus | None = field(default=None, repr=False)
    # A call here just failed as if the worker were lost: keep new work away until then
    # (monotonic), so a retry does not land on it before the next poll notices.
    suspect_until: float = 0.0
    breaker: BreakerSettings = BREAKER
    consecutive_failures: int = 0  # failed attempts since the last success
    slow_polls: int = 0  # status polls in a row that timed out
    circuit_open_until: float = 0.0  # monotonic; the breaker keeps work away until then
    circuit_trips: int = 0  # times the breaker opened
    ejections_refused: int = 0  # times it would have opened past max_ejection_percent
    # Whether one more worker of its pool may leave routing on its breaker (WorkerPool sets
    # it; a handle on its own may always).
    may_eject: object = field(default=lambda: True, repr=False)
    # What its prefix cache holds, as of the last poll (followed only for KV-aware routing).
    kv: HeldBlocks = field(default_factory=HeldBlocks, repr=False)

    @property
    def routable(self) -> bool:
        now = time.monotonic()
        out_until = max(self.suspect_until, self.circuit_open_until)
        return self.healthy and not self.draining and now >= out_until

    @property
    def streams_in_use(self) -> int:
        """Of a decode worker's stream budget: open Decode calls and open leases at the last
        poll, or what this router holds there now when that is more (the poll lags)."""
        st = self.last_status
        polled = st.open_streams + st.num_leases if st is not None else 0
        return max(polled, self.inflight_requests)

    def has_stream_room(self) -> bool:
        """A new lease would pass the decode worker's stream budget (its StreamBudget.has_room,
        as far as the router sees it); True where the worker does not say its budget."""
        st = self.last_status
        return st is None or not st.max_streams or self.streams_in_use < st.max_streams

    @property
    def circuit(self) -> str:
        """ "closed" (routing as usual), "open" (cooling down) or "half_open" (on probation)."""
        if self.consecutive_failures < self.breaker.failures:
            return "closed"
        return "open" if time.monotonic() < self.circuit_open_until else "half_open"

    @contextlib.contextmanager
    def load(self, tokens: int = 0) -> Iterator[None]:
        """Count one request (and ``tokens`` prompt tokens) in flight here while the block
        runs. The only place the load counters change, so no path (finish, error, cancel)
        can leave one behind."""
        self.served_requests += 1
        self.inflight_requests += 1
        self.inflight_tokens += tokens
        try:
            yield
        finally:
            self.inflight_requests -= 1
            self.inflight_tokens -= tokens

    def mark_failed(self, seconds: float = SUSPECT_S) -> None:
        """An attempt failed here as if the worker were lost; the breaker counts it."""
        now = time.monotonic()
        self.suspect_until = now + seconds
        self.consecutive_failures += 1
        if self.consecutive_failures >= self.breaker.failures:  # the Nth, or a failed probe
            if self.circuit != "open" and not self.may_eject():
                self._stay_in_routing()
                return
            self.circuit_open_until = now + self.breaker.cooldown_s
            self.circuit_trips += 1
            log.warning(
                "%s worker %s failed %d attempts in a row: out of routing for %.1f s",
                self.role,
                self.address,
                self.consecutive_failures,
                self.breaker.cooldown_s,
            )

    def _stay_in_routing(self) -> None:
        """Its breaker would open, but that would take more of its pool out than the cap:
        it stays in routing (half-open: its next outcome decides again)."""
        self.circuit_open_until = 0.0
        self.ejections_refused += 1
        log.warning(
            "%s worker %s failed %d attempts in a row, but stays in routing: %.0f%% of its "
            "pool is out already (max_ejection_percent)",
            self.role,
            self.address,
            self.consecutive_failures,
            self.breaker.max_ejection_percent,
        )

    def mark_succeeded(self) -> None:
        """An attempt's step here went through: the breaker closes (or stays closed)."""
        if self.consecutive_failures >= self.breaker.failures:
            log.info("%s worker %s is back: circuit closed", self.role, self.address)
        self.consecutive_failures = 0
        self.circuit_open_until = 0.0


class _TokenStub:
    """A worker stub whose every call carries the cluster token, beside the call's own
    metadata if it has any (a trace's traceparent)."""

    def __init__(self, stub, metadata: tuple):
        self._stub = stub
        self._metadata = metadata

    def __getattr__(self, method: str):
        call, token = getattr(self._stub, method), self._metadata

        def with_token(request, *, metadata=None, **kwargs):
            return call(request, metadata=token + tuple(metadata) if metadata else token, **kwargs)

        return with_token


class WorkerPool:
    def __init__(self, role: str, cluster_token: str | None = None, tls=None, breaker=BREAKER):
        self.role = role
        self.breaker = breaker  # BreakerSettings for every worker added
        self.workers: dict[str, WorkerHandle] = {}
        self._metadata = ((TOKEN_KEY, cluster_token),) if cluster_token else None
        self._tls = tls  # grpc_plumbing.tls.ClusterTls: mutual TLS to the workers
        self.track_kv = False  # polls follow each worker's prefix cache (KV-aware routing)

    def _channel(self, address: str) -> grpc.aio.Channel:
        if self._tls is None:
            return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        options = CHANNEL_OPTIONS + self._tls.channel_options()
        return grpc.aio.secure_channel(address, self._tls.channel_credentials(), options=options)

    def add(self, address: str) -> WorkerHandle:
        if address in self.workers:
            return self.workers[address]
        channel = self._channel(address)
        stub_cls = pb_grpc.PrefillWorkerStub if self.role == "prefill" else pb_grpc.DecodeWorkerStub
        stub = stub_cls(channel)
        if self._metadata is not None:
            stub = _TokenStub(stub, self._metadata)
        handle = WorkerHandle(address, self.role, channel, stub, breaker=self.breaker)
        handle.may_eject = self.may_eject
        self.workers[address] = handle
        return handle

    async def remove(self, address: str) -> None:
        handle = self.workers.pop(address, None)
        if handle is not None:
            await handle.channel.close()

    def drain(self, address: str) -> None:
        """No new requests go to a draining worker; those running there finish."""
        self.workers[address].draining = True

    def may_eject(self) -> bool:
        """One more worker may leave routing on an open circuit without more than
        ``max_ejection_percent`` of the pool out (a pool of one keeps its worker)."""
        out = sum(w.circuit == "open" for w in self.workers.values())
        return (out + 1) * 100 <= self.breaker.max_ejection_percent * len(self.workers)

    def routable(self) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.routable]

    async def poll(self, timeout: float = 2.0) -> None:
        """Refresh every worker's status; a worker that cannot be reached, or that has not
        answered in time MAX_SLOW_POLLS times in a row, is not routable."""
        await asyncio.gather(*(self._poll_one(w, timeout) for w in list(self.workers.values())))

    async def _poll_one(self, w: WorkerHandle, timeout: float) -> None:
        try:
            ask = pb.StatusRequest(**w.kv.request_fields()) if self.track_kv else pb.StatusRequest()
            st = await w.stub.Status(ask, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and w.healthy:
                w.slow_polls += 1
                if w.slow_polls < MAX_SLOW_POLLS:
                    return  # slow to answer, not gone: keep routing on its last status
            if w.healthy:
                log.warning("%s worker %s is unreachable: %s", self.role, w.address, e.code().name)
            w.healthy = False
            w.kv.forget()
            return
        except asyncio.CancelledError:
            # Removing a worker closes its channel, which cancels a Status call in flight: that
            # must not end the poll (nor the router's poller with it), only a real cancel may.
            if asyncio.current_task().cancelling():
                raise
            w.healthy = False
            return
        w.last_status = st
        if st.HasField("kv_events"):
            w.kv.apply(st.kv_events)
        w.free_blocks = st.num_free_blocks
        w.total_blocks = st.num_total_blocks
        w.healthy = True
        w.slow_polls = 0

    async def close(self) -> None:
        for address in list(self.workers):
            await self.remove(address)
