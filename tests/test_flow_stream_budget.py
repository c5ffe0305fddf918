"""The concurrent reserve path (Prefill sent beside the Reserve) checks the decode worker's
stream budget first (WorkerStatus open_streams / num_leases / max_streams, and what the router
holds there itself): a reservation the budget refuses would waste the prefill already sent.
With the budget full the router reserves first, and no prefill runs for a request that the
decode pool cannot take (RELIABILITY.md, issue 19's open item)."""

from __future__ import annotations

import time

import grpc
import pytest

from pdserve.cluster.local import ClusterSpec, LocalCluster
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router.pool import WorkerHandle
from tests.cluster_utils import assert_all_blocks_free
from tests.conftest import tiny_llama_dir
from tests.test_disagg import engine_reference

PROMPT = list(range(3, 23))
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("stream-budget"), seed=4)
    return path


def _generate(address: str):
    """(token ids, status code) of one greedy Generate over gRPC."""
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=PROMPT),
        sampling=pb.SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True),
    )
    with grpc.insecure_channel(address) as ch:
        ids = []
        try:
            for chunk in pb_grpc.GenerationStub(ch).Generate(req, timeout=30):
                ids.extend(chunk.token_ids)
        except grpc.RpcError as e:
            return ids, e.code()
    return ids, grpc.StatusCode.OK


def _until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_full_stream_budget_reserves_first_and_prefills_nothing(tiny_model):
    spec = ClusterSpec(model=str(tiny_model), num_blocks=256, max_model_len=128)
    with LocalCluster(spec) as cluster:
        router = cluster.servers.router
        router.flow.cfg.reserve_timeout_s = 0.5  # the refusal comes after this wait
        (decode_handle,) = router.decode.routable()
        (prefill_handle,) = router.prefill.routable()
        budget = decode_handle.last_status.max_streams
        assert budget >= 8
        # Fill the decode worker's streams with leases nobody fills: its blocks stay plenty.
        worker = cluster.decode_workers[0]
        held = [worker.reserve(f"held-{i}", 4, ttl_s=60) for i in range(budget)]
        _until(lambda: decode_handle.last_status.num_leases == budget)
        assert decode_handle.free_blocks > decode_handle.total_blocks // 2
        assert not decode_handle.has_stream_room()
        prefills_before = prefill_handle.served_requests
        ids, code = _generate(cluster.address)
        assert (ids, code) == ([], grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert prefill_handle.served_requests == prefills_before  # no prefill was wasted
        for lease in held:
            worker.release(lease.lease_id)
        _until(lambda: decode_handle.has_stream_room())
        ids, code = _generate(cluster.address)
        assert code == grpc.StatusCode.OK
        assert ids == engine_reference(str(tiny_model), [PROMPT], new_tokens=NEW_TOKENS)[0]
        assert prefill_handle.served_requests == prefills_before + 1
        assert_all_blocks_free(cluster)


def test_the_router_s_own_requests_count_before_the_next_poll():
    """Right after the router sent work to a worker, its last poll still shows the streams
    free: what the router holds there counts too."""
    handle = WorkerHandle("127.0.0.1:1", "decode", channel=None, stub=None)
    assert handle.has_stream_room()  # no status yet: the worker's own refusal decides
    handle.last_status = pb.WorkerStatus(open_streams=1, num_leases=1, max_streams=3)
    assert handle.streams_in_use == 2 and handle.has_stream_room()
    with handle.load(), handle.load(), handle.load():
        assert handle.streams_in_use == 3 and not handle.has_stream_room()
    handle.last_status = pb.WorkerStatus(open_streams=2, num_leases=1, max_streams=3)
    assert not handle.has_stream_room()
    handle.last_status = pb.WorkerStatus(open_streams=9, max_streams=0)  # budget unknown
    assert handle.has_stream_room()
