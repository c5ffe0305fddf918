"""A decode worker that hangs in Reserve (issue 19: "Reserve has no timeout"): each Reserve
call has its own timeout, the router tries the next decode worker, and the request finishes
with its exact greedy output; the hung worker's late lease is released, not left to its TTL."""

from __future__ import annotations

import threading
import time

import pytest

from decode_worker.server import DecodeServicer
from pdserve.client import Client
from pdserve.cluster.local import ClusterSpec, LocalCluster
from tests.cluster_utils import assert_all_blocks_free
from tests.conftest import tiny_llama_dir
from tests.test_disagg import engine_reference

HANG_S = 2.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("reserve"), seed=8)
    return path


def _hang_first_reserve(monkeypatch) -> threading.Event:
    """The first Reserve, whichever decode worker gets it, sleeps HANG_S before reserving;
    the event is set once it has reserved (after its caller's timeout)."""
    real, first, done = DecodeServicer.Reserve, threading.Lock(), threading.Event()

    def reserve(servicer, request, context):
        if not first.acquire(blocking=False):
            return real(servicer, request, context)
        time.sleep(HANG_S)
        try:
            return real(servicer, request, context)
        finally:
            done.set()

    monkeypatch.setattr(DecodeServicer, "Reserve", reserve)
    return done


def test_a_hung_reserve_times_out_and_the_next_decode_worker_serves(tiny_model, monkeypatch):
    monkeypatch.setattr("router.flow.reservation.RESERVE_CALL_TIMEOUT_S", 0.5)
    hung = _hang_first_reserve(monkeypatch)  # before the cluster starts: gRPC binds handlers
    prompt = list(range(5, 45))
    (reference,) = engine_reference(tiny_model, [prompt], new_tokens=8)
    spec = ClusterSpec(model=str(tiny_model), num_decode=2, num_blocks=128, max_model_len=128)
    with LocalCluster(spec) as cluster, Client(cluster.address) as client:
        cluster.router.flow.cfg.concurrent_reserve_headroom = -1.0  # reserve first, always
        start = time.monotonic()
        out = client.generate(token_ids=prompt, max_tokens=8, ignore_eos=True)
        took = time.monotonic() - start
        assert out.token_ids == reference and out.finish_reason == "length"
        assert took < HANG_S  # it did not wait for the hung worker
        assert hung.wait(10)
        assert_all_blocks_free(cluster, timeout=5.0)  # the late lease too, well before its TTL
