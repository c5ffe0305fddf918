"""A decode worker whose torch_dist pair acceptor dies stops reporting SERVING (#46): its
health turns NOT_SERVING and its Status UNAVAILABLE naming the acceptor, so the router routes
around it and the Ray controller replaces it, instead of a worker that looks fine and takes
no KV. A hostile client on its pairing port leaves it SERVING."""

from __future__ import annotations

import grpc
import pytest

from decode_worker.server import serve_decode_worker
from decode_worker.worker import DecodeWorker
from grpc_plumbing.auth import TOKEN_KEY
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from tests.conftest import tiny_llama_dir
from tests.test_grpc_health import NOT_SERVING, SERVING, check, wait_status

TOKEN = "kv-health-token"
SERVICE = "pdserve.v1.DecodeWorker"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("kv-health"), seed=7)
    return path


@pytest.fixture
def served(tiny, make_engine):
    worker = DecodeWorker(make_engine(tiny, num_blocks=32))
    server, address, kv_server = serve_decode_worker(
        worker, kv_transport="torch_dist", cluster_token=TOKEN
    )
    try:
        yield address, kv_server
    finally:
        server.stop(grace=None)
        kv_server.stop()
        worker.stop()


def status(address: str):
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.DecodeWorkerStub(channel)
        return stub.Status(pb.StatusRequest(), timeout=5, metadata=((TOKEN_KEY, TOKEN),))


def test_a_dead_pair_acceptor_takes_the_decode_worker_out(served):
    address, kv_server = served
    assert wait_status(address, SERVING, SERVICE) == SERVING
    for _ in range(20):  # garbage on the pairing port changes nothing
        with grpc.insecure_channel(kv_server.endpoint) as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=0.2)
            except grpc.FutureTimeoutError:
                pass
    assert check(address, SERVICE) == SERVING and status(address).kv_transport == "torch_dist"

    def boom():
        raise RuntimeError("the selector broke")

    kv_server._acceptor._tick = boom
    assert wait_status(address, NOT_SERVING, SERVICE) == NOT_SERVING
    assert check(address) == NOT_SERVING
    with pytest.raises(grpc.RpcError) as err:
        status(address)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "torch_dist pair acceptor died" in err.value.details()
