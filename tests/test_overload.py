"""Overload (issue 19): past the router's admission bounds the answer is 429 /
RESOURCE_EXHAUSTED at once, with Retry-After (HTTP) or retry-after metadata (gRPC), never a
5xx; a burst far past them leaves every block free."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from pdserve.cluster.local import ClusterSpec, LocalCluster
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router.limits import FirstTokenQueue
from tests.cluster_utils import assert_all_blocks_free
from tests.conftest import tiny_llama_dir


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("overload"), seed=4)
    return path


def _tiny_cluster(model, **router) -> LocalCluster:
    """1P1D with a small decode pool; ``router``: RouterSettings fields to tighten."""
    spec = ClusterSpec(
        model=str(model), num_blocks=256, decode_num_blocks=48, max_model_len=128, http_port=0
    )
    cluster = LocalCluster(spec).start()
    r = cluster.servers.router
    r.cfg = dataclasses.replace(r.cfg, **router)
    r.flow.cfg.reserve_timeout_s = r.cfg.reserve_timeout_s
    r.flow.cfg.concurrent_reserve_headroom = r.cfg.concurrent_reserve_headroom
    r.queue = FirstTokenQueue(r.cfg.max_queue_wait_s)
    return cluster


async def _burst(address: str, n: int, max_tokens: int) -> list[tuple[int, float, dict]]:
    """n completions at once: (status, seconds to the answer, headers) of each."""
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(base_url=f"http://{address}", limits=limits, timeout=120) as c:

        async def one(i):
            body = {"prompt": [3 + i % 100, 5, 7], "max_tokens": max_tokens, "ignore_eos": True}
            start = time.monotonic()
            resp = await c.post("/v1/completions", json=body)
            if resp.status_code == 200:
                assert resp.json()["usage"]["completion_tokens"] == max_tokens
            return resp.status_code, time.monotonic() - start, dict(resp.headers)

        return list(await asyncio.gather(*(one(i) for i in range(n))))


def test_a_300_request_burst_gets_no_5xx_and_every_429_says_when_to_retry(tiny_model):
    cluster = _tiny_cluster(tiny_model, max_inflight_requests=32, reserve_timeout_s=2.0)
    try:
        results = asyncio.run(_burst(cluster.http_address, 300, 24))
        counts = collections.Counter(status for status, _, _ in results)
        assert set(counts) <= {200, 429}, counts
        assert counts[200] >= 32 and counts[429] > 0, counts
        for status, _, headers in results:
            if status == 429:
                assert int(headers["retry-after"]) >= 1
        assert_all_blocks_free(cluster)
    finally:
        cluster.stop()


def test_429_is_at_once_over_http_and_grpc_with_retry_after(tiny_model):
    """Admission full: the refusal does not wait for anything."""
    cluster = _tiny_cluster(tiny_model, max_inflight_requests=0)
    try:
        start = time.monotonic()
        resp = httpx.post(
            f"http://{cluster.http_address}/v1/completions",
            json={"prompt": [3, 4], "max_tokens": 2},
        )
        http_s = time.monotonic() - start
        assert resp.status_code == 429 and resp.json()["error"]["code"] == "overloaded"
        assert int(resp.headers["retry-after"]) >= 1
        with grpc.insecure_channel(cluster.address) as ch:
            call = pb_grpc.GenerationStub(ch).Generate(
                pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=[3, 4]), sampling=pb.SamplingParams(max_tokens=2)
                )
            )
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                list(call)
            grpc_s = time.monotonic() - start
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert int(dict(err.value.trailing_metadata())["retry-after"]) >= 1
        assert http_s < 0.5 and grpc_s < 0.5, (http_s, grpc_s)
        assert_all_blocks_free(cluster)
    finally:
        cluster.stop()


def test_first_token_queue_refuses_once_its_oldest_waits_past_the_deadline():
    queue = FirstTokenQueue(max_wait_s=0.05)
    first = queue.enter()
    assert queue.full() is None
    time.sleep(0.08)
    assert "max_queue_wait_s" in queue.full()
    second = queue.enter()  # the oldest decides, not the newest
    assert queue.full() is not None
    queue.leave(first)
    assert queue.full() is None and len(queue) == 1
    queue.leave(second)
    queue.leave(second)  # idempotent: at the first token and again when the request ends
    assert len(queue) == 0 and queue.full() is None


def test_a_queue_older_than_its_deadline_gets_429_at_once(tiny_model):
    """A request waiting for decode blocks ages the queue: the next arrival is refused at
    once with Retry-After, the waiting one still completes once blocks free up."""
    # Reserve first (no concurrent path): the waiting request has no first token yet.
    cluster = _tiny_cluster(
        tiny_model, max_queue_wait_s=0.2, reserve_timeout_s=20.0, concurrent_reserve_headroom=-1
    )
    try:
        with grpc.insecure_channel(cluster.decode_addresses[0]) as ch:
            decode = pb_grpc.DecodeWorkerStub(ch)
            hogs = [  # every one of the 48 blocks, 8 a lease
                decode.Reserve(pb.ReserveRequest(request_id=f"hog{i}", num_tokens=127))
                for i in range(6)
            ]
            base = f"http://{cluster.http_address}"
            body = {"prompt": [3, 4, 5], "max_tokens": 4, "ignore_eos": True}
            with httpx.Client(base_url=base, timeout=30) as client, ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(client.post, "/v1/completions", json=body)  # for blocks
                time.sleep(0.5)
                start = time.monotonic()
                refused = client.post("/v1/completions", json=body)
                refused_s = time.monotonic() - start
                assert refused.status_code == 429 and "max_queue_wait_s" in refused.text
                assert int(refused.headers["retry-after"]) >= 1 and refused_s < 0.5
                for hog in hogs:
                    assert decode.Release(pb.ReleaseRequest(lease_id=hog.lease_id)).released
                done = waiting.result(timeout=30)
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4
        assert_all_blocks_free(cluster)
    finally:
        cluster.stop()
