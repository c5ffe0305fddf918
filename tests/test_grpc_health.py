"""The standard grpc.health.v1 service, as probes use it: on the router and on every worker,
open without the API key or cluster token, SERVING only when ready, NOT_SERVING while
draining."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cluster.local import ClusterSpec, LocalCluster
from router.app import start_router
from router.settings import RouterSettings
from tests.conftest import tiny_llama_dir

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("health"))
    return path


def check(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def wait_status(address: str, want: int, service: str = "", timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    status = check(address, service)
    while status != want and time.monotonic() < deadline:
        time.sleep(0.05)
        status = check(address, service)
    return status


def test_router_and_workers_serve_health_without_key_or_token(tiny_model):
    spec = ClusterSpec(
        model=str(tiny_model),
        num_blocks=64,
        max_model_len=128,
        api_key="client-key",
        cluster_token="cluster-secret",
    )
    with LocalCluster(spec) as cluster:
        assert wait_status(cluster.address, SERVING) == SERVING
        assert check(cluster.address, "pdserve.v1.Generation") == SERVING
        for address in cluster.prefill_addresses:
            assert check(address) == SERVING
            assert check(address, "pdserve.v1.PrefillWorker") == SERVING
        for address in cluster.decode_addresses:
            assert check(address, "pdserve.v1.DecodeWorker") == SERVING
        # Only health is open: the worker API still wants the token.
        from protos import pdserve_pb2 as pb
        from protos import pdserve_pb2_grpc as pb_grpc

        with grpc.insecure_channel(cluster.decode_addresses[0]) as channel:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.DecodeWorkerStub(channel).Status(pb.StatusRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_draining_worker_is_not_serving_and_comes_back(tiny_model):
    spec = ClusterSpec(model=str(tiny_model), num_blocks=64, max_model_len=128)
    with LocalCluster(spec) as cluster:
        worker, address = cluster.decode_workers[0], cluster.decode_addresses[0]
        assert check(address) == SERVING
        worker.draining = True
        assert check(address) == NOT_SERVING
        assert check(address, "pdserve.v1.DecodeWorker") == NOT_SERVING
        worker.draining = False
        assert check(address) == SERVING


def test_router_without_workers_is_not_serving(tiny_model):
    model_dir = tiny_model

    async def scenario() -> int:
        servers = await start_router(RouterSettings(str(model_dir)), [], [])
        try:
            return await asyncio.to_thread(check, servers.grpc_address)
        finally:
            await servers.stop()

    assert asyncio.run(scenario()) == NOT_SERVING
