"""Helpers for tests that run a whole cluster: concurrent requests and leak checks."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

from grpc_plumbing.auth import TOKEN_KEY
from pdserve.client import AsyncClient, Completion
from pdserve.cluster.local import ClusterSpec, LocalCluster
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc


async def _run_all(address: str, requests: list[dict]) -> list[Completion]:
    client = AsyncClient(address)
    try:
        return list(await asyncio.gather(*(client.generate(**r) for r in requests)))
    finally:
        await client.close()


def generate_concurrently(cluster: LocalCluster, requests: list[dict]) -> list[Completion]:
    """Send every request at once through the router's gRPC API; wait for all."""
    return asyncio.run(_run_all(cluster.address, requests))


def _worker_channel(cluster: LocalCluster, address: str):
    """A channel to a worker of ``cluster``: mutual TLS with the cluster's keys when it has them."""
    import grpc

    tls = getattr(cluster.spec, "cluster_tls", None)
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.channel_credentials(), options=tls.channel_options())


def worker_statuses(cluster: LocalCluster, dead=()) -> list[pb.WorkerStatus]:
    """Every live worker's status (``dead``: addresses of workers killed on purpose), over the
    cluster's own token and TLS."""
    token = getattr(cluster.spec, "cluster_token", None)
    metadata = ((TOKEN_KEY, token),) if token else None
    out = []
    for role, addresses in (
        ("prefill", cluster.prefill_addresses),
        ("decode", cluster.decode_addresses),
    ):
        stub_cls = pb_grpc.PrefillWorkerStub if role == "prefill" else pb_grpc.DecodeWorkerStub
        for address in (a for a in addresses if a not in dead):
            with _worker_channel(cluster, address) as ch:
                out.append(stub_cls(ch).Status(pb.StatusRequest(), timeout=5, metadata=metadata))
    return out


def assert_all_blocks_free(cluster: LocalCluster, timeout: float = 10.0, dead=()) -> None:
    """Every block on every live worker is free again and no lease is open (frees after a
    commit are asynchronous, so poll briefly); ``dead``: workers killed on purpose."""
    deadline = time.monotonic() + timeout
    while True:
        statuses = worker_statuses(cluster, dead)
        busy = [
            s
            for s in statuses
            if s.num_free_blocks != s.num_total_blocks
            or s.num_leases
            or s.num_running
            or s.num_waiting
            or s.num_transfers
        ]
        if not busy:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks not returned: {busy}")
        time.sleep(0.05)


@contextlib.contextmanager
def http_cluster(model_path) -> Iterator[LocalCluster]:
    """A 1P1D in-process cluster of a tiny model with the HTTP API; every block back after."""
    spec = ClusterSpec(model=str(model_path), num_blocks=256, max_model_len=128, http_port=0)
    with LocalCluster(spec) as c:
        yield c
        assert_all_blocks_free(c)


@contextlib.contextmanager
def openai_client(cluster: LocalCluster):
    """The official client against ``cluster``'s HTTP API, without retries (a test sees every
    error as it is)."""
    import openai

    base_url = f"http://{cluster.http_address}/v1"
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as c:
        yield c
