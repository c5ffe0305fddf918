"""The decode worker's sync gRPC server holds a thread per call for the call's life (issue 19):
more concurrent Decode streams than server threads must neither deadlock the worker nor starve
Status, Reserve, Release and health probes. Streams past the budget are refused at once with
RESOURCE_EXHAUSTED, and every block and thread comes back."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_worker.server import StreamBudget, serve_decode_worker
from decode_worker.worker import DecodeWorker
from kv_transfer.errors import FrameError
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from tests.conftest import tiny_llama_dir

MAX_STREAMS = 4
LEASE_S = 4.0  # a Decode waits this long for KV that never comes, holding its thread


@pytest.fixture
def decode_server(tmp_path, make_engine):
    path, _ = tiny_llama_dir(tmp_path, seed=6)
    worker = DecodeWorker(make_engine(path, num_blocks=64))
    server, address, _ = serve_decode_worker(worker, max_streams=MAX_STREAMS)
    channel = grpc.insecure_channel(address)
    try:
        yield worker, channel
    finally:
        channel.close()
        server.stop(grace=None)
        worker.stop()


def _reserve(stub, i: int):
    req = pb.ReserveRequest(request_id=f"r{i}", num_tokens=8, lease_seconds=LEASE_S)
    return stub.Reserve(req, timeout=2)


def _decode_on(stub, lease_id: str, i: int):
    """A Decode on a lease whose KV never arrives: it holds a server thread until the deadline."""
    req = pb.DecodeRequest(
        request_id=f"d{i}",
        lease_id=lease_id,
        prompt_token_ids=[5, 6, 7],
        output_token_ids=[8],
        sampling=pb.SamplingParams(max_tokens=4),
    )
    return stub.Decode(req, timeout=30)


def _assert_control_calls_answer_quickly(channel) -> None:
    start = time.monotonic()
    stub = pb_grpc.DecodeWorkerStub(channel)
    stub.Status(pb.StatusRequest(), timeout=1)
    assert not stub.Release(pb.ReleaseRequest(lease_id="none"), timeout=1).released
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert time.monotonic() - start < 1.0


def _refused(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        next(iter(call))
    return err.value.code()


def test_streams_past_the_thread_budget_are_refused_and_control_calls_still_answer(decode_server):
    worker, channel = decode_server
    stub = pb_grpc.DecodeWorkerStub(channel)
    budget = StreamBudget(MAX_STREAMS)
    leases = [_reserve(stub, i) for i in range(MAX_STREAMS)]
    with pytest.raises(grpc.RpcError) as err:  # a lease is a stream to come: the budget is full
        _reserve(stub, 99)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_streams" in err.value.details()
    # Refused under a lease id the router named (its prefill already on the way): frames
    # waiting for that lease give up at once, not when their wait times out.
    with pytest.raises(grpc.RpcError):
        stub.Reserve(pb.ReserveRequest(request_id="named", num_tokens=8, lease_id="named"))
    start = time.monotonic()
    with pytest.raises(FrameError, match="refused"):
        worker.leases.wait_for("named", timeout=5)
    assert time.monotonic() - start < 1
    # More Decode calls than the server has threads, all at once, each on a lease.
    calls = [
        _decode_on(stub, leases[i % MAX_STREAMS].lease_id, i)
        for i in range(budget.server_threads + 8)
    ]
    time.sleep(0.3)  # let them all reach the server
    _assert_control_calls_answer_quickly(channel)
    codes = [c.code() for c in calls if c.done()]
    assert len(codes) == len(calls) - 2 * MAX_STREAMS  # 2 S wait for their KV, the rest refused
    assert set(codes) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    local = pb.DecodeRequest(
        request_id="local", prompt_token_ids=[5, 6], sampling=pb.SamplingParams()
    )
    assert _refused(stub.Decode(local, timeout=2)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    for call in calls:
        call.cancel()
    # The cancelled Decodes give their threads, streams and leases back (at once since their
    # wait wakes on the cancel; a loaded machine may take a moment); then all is free.
    deadline = time.monotonic() + LEASE_S + 5
    while time.monotonic() < deadline:
        st = stub.Status(pb.StatusRequest(), timeout=2)
        if st.num_leases == 0 and st.num_free_blocks == st.num_total_blocks and not st.open_streams:
            break
        time.sleep(0.05)
    assert st.num_leases == 0 and st.num_free_blocks == st.num_total_blocks
    assert st.open_streams == 0
    # With the budget back, a stream is served again, to its end.
    chunks = list(
        stub.Decode(
            pb.DecodeRequest(
                request_id="after",
                prompt_token_ids=[5, 6],
                sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True),
            ),
            timeout=10,
        )
    )
    assert sum(len(c.token_ids) for c in chunks) == 3 and chunks[-1].finish_reason == "length"
