"""A Prefill whose caller leaves right at its first token (the handler's generator closed at
that yield, before its KV commit) ends its KV stream: the queued frames are dropped, the push
call at the decode worker closes, the prefill worker's blocks come back, and once the lease is
released (the router's normal path after a failed attempt) every decode block is free."""

from __future__ import annotations

import grpc
import pytest

from kv_transfer.sender import KVStream
from kv_transfer.sender_pool import SenderPool
from pdserve.cluster.local import ClusterSpec, LocalCluster
from prefill_worker.server import PrefillServicer
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router.flow.types import lease_destination
from tests.cluster_utils import assert_all_blocks_free
from tests.conftest import tiny_llama_dir


class _Context:
    """A grpc ServicerContext the handler runs under, called here and never cancelled."""

    def __init__(self):
        self.callbacks = []

    def is_active(self) -> bool:
        return True

    def add_callback(self, fn) -> None:
        self.callbacks.append(fn)

    def abort(self, code, details):
        raise AssertionError(f"aborted {code}: {details}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("prefill-cancel"), seed=3)
    with LocalCluster(ClusterSpec(model=str(path), num_blocks=64, max_model_len=256)) as c:
        yield c


def test_a_prefill_closed_at_its_first_token_closes_its_kv_stream(cluster, monkeypatch):
    streams: list[KVStream] = []
    opened = KVStream.__init__
    monkeypatch.setattr(
        KVStream, "__init__", lambda s, *a, **k: (opened(s, *a, **k), streams.append(s))[0]
    )
    decode = pb_grpc.DecodeWorkerStub(grpc.insecure_channel(cluster.decode_addresses[0]))
    senders = SenderPool()
    servicer = PrefillServicer(cluster.prefill_workers[0], senders)
    try:
        for i in range(3):
            prompt = list(range(3, 3 + 40 + 7 * i))  # several blocks, so frames stay queued
            lease = decode.Reserve(pb.ReserveRequest(request_id=f"c{i}", num_tokens=80))
            req = pb.PrefillRequest(
                request_id=f"c{i}",
                prompt_token_ids=prompt,
                sampling=pb.SamplingParams(max_tokens=8),
                destination=lease_destination(lease),
            )
            ctx = _Context()
            events = servicer.Prefill(req, ctx)
            assert next(events).HasField("first_token")
            events.close()  # the caller is gone: GeneratorExit at the first token's yield
            for cb in ctx.callbacks:  # grpc runs them once the call ends
                cb()
            assert streams[-1].finished, "the KV stream was left open"
            assert decode.Release(pb.ReleaseRequest(lease_id=lease.lease_id)).released
        assert_all_blocks_free(cluster)
    finally:
        senders.close()
