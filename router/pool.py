"""The router's view of the worker pools: clients, load counters, draining, status polling."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field

import grpc

from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger("pdserve.router")

CLUSTER_TOKEN_KEY = "x-pdserve-token"  # the workers check it (kv_transfer.auth)

SUSPECT_S = 1.0  # how long a worker whose call failed stays out of routing

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 8 * 2**20),
    ("grpc.max_send_message_length", 8 * 2**20),
]


@dataclass
class WorkerHandle:
    address: str
    role: str  # "prefill" | "decode"
    channel: grpc.aio.Channel
    stub: object
    draining: bool = False
    healthy: bool = False
    # What the router itself has in flight there: exact for a single router, no polling lag.
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

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining and time.monotonic() >= self.suspect_until

    def mark_failed(self, seconds: float = SUSPECT_S) -> None:
        self.suspect_until = time.monotonic() + seconds


class _TokenStub:
    """A worker stub whose every call carries the cluster token."""

    def __init__(self, stub, metadata: tuple):
        self._stub = stub
        self._metadata = metadata

    def __getattr__(self, method: str):
        return functools.partial(getattr(self._stub, method), metadata=self._metadata)


class WorkerPool:
    def __init__(self, role: str, cluster_token: str | None = None, tls=None):
        self.role = role
        self.workers: dict[str, WorkerHandle] = {}
        self._metadata = ((CLUSTER_TOKEN_KEY, cluster_token),) if cluster_token else None
        self._tls = tls  # kv_transfer.tls.ClusterTls: mutual TLS to the workers

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
        handle = WorkerHandle(address, self.role, channel, stub)
        self.workers[address] = handle
        return handle

    async def remove(self, address: str) -> None:
        handle = self.workers.pop(address, None)
        if handle is not None:
            await handle.channel.close()

    def drain(self, address: str) -> None:
        """No new requests go to a draining worker; those running there finish."""
        self.workers[address].draining = True

    def routable(self) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.routable]

    async def poll(self, timeout: float = 2.0) -> None:
        """Refresh every worker's status; a worker that does not answer is not routable."""
        await asyncio.gather(*(self._poll_one(w, timeout) for w in list(self.workers.values())))

    async def _poll_one(self, w: WorkerHandle, timeout: float) -> None:
        try:
            st = await w.stub.Status(pb.StatusRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if w.healthy:
                log.warning("%s worker %s is unreachable: %s", self.role, w.address, e.code().name)
            w.healthy = False
            return
        except asyncio.CancelledError:
            # Removing a worker closes its channel, which cancels a Status call in flight: that
            # must not end the poll (nor the router's poller with it), only a real cancel may.
            if asyncio.current_task().cancelling():
                raise
            w.healthy = False
            return
        w.last_status = st
        w.free_blocks = st.num_free_blocks
        w.total_blocks = st.num_total_blocks
        w.healthy = True

    async def close(self) -> None:
        for address in list(self.workers):
            await self.remove(address)
