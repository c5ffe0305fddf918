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

from pdserve.client import AsyncClient
from pdserve.cluster.local import ClusterSpec, LocalCluster
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router.flow.types import Overloaded
from router.limits import FirstTokenQueue
from tests.cluster_utils import assert_all_blocks_free
from tests.conftest import tiny_llama_dir
from tests.test_disagg import engine_reference


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


def _refused_generate(address: str) -> tuple[grpc.RpcError, float]:
    """A short Generate over gRPC that must fail: its error and the seconds it took."""
    with grpc.insecure_channel(address) as ch:
        call = pb_grpc.GenerationStub(ch).Generate(
            pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[3, 4]), sampling=pb.SamplingParams(max_tokens=2)
            )
        )
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        return err.value, time.monotonic() - start


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
        err, grpc_s = _refused_generate(cluster.address)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert int(dict(err.trailing_metadata())["retry-after"]) >= 1
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


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _serve_at(queue: FirstTokenQueue, clock: FakeClock, n: int, every_s: float) -> None:
    """n requests queued at once, their first tokens ``every_s`` apart."""
    tickets = [queue.enter() for _ in range(n)]
    for ticket in tickets:
        clock.now += every_s
        queue.served(ticket)


def test_the_queue_refuses_at_arrival_once_its_estimate_passes_the_deadline():
    clock = FakeClock()
    queue = FirstTokenQueue(max_wait_s=5.0, clock=clock)
    assert queue.service_rate() is None  # not enough first tokens seen: the deadline alone
    _serve_at(queue, clock, 16, every_s=0.1)  # 10 first tokens per busy second
    assert queue.service_rate() == pytest.approx(10.0)
    waiting = [queue.enter() for _ in range(49)]
    assert queue.estimated_wait_s() == pytest.approx(5.0) and queue.full() is None
    waiting.append(queue.enter())  # 50 ahead: the next would wait 5.1 s, past the deadline
    reason = queue.full()
    assert "would wait about 5.1 s" in reason and "max_queue_wait_s 5" in reason
    assert queue.oldest_wait_s() == 0.0  # refused at once, not after waiting
    assert queue.retry_after_s() == 1  # 0.1 s over: the shortest Retry-After
    waiting += [queue.enter() for _ in range(30)]
    assert queue.retry_after_s() == 4  # 8.1 s of queue: 3.1 s until one fits again
    waiting += [queue.enter() for _ in range(500)]
    assert queue.retry_after_s() == 5  # never more than the deadline itself
    for ticket in waiting[80:]:  # their clients left: they leave, not counted as service
        queue.leave(ticket)
    for ticket in waiting[:40]:  # the queue drains at its rate: arrivals are admitted again
        clock.now += 0.1
        queue.served(ticket)
    assert queue.service_rate() == pytest.approx(10.0)
    assert queue.estimated_wait_s() == pytest.approx(4.1) and queue.full() is None


def test_a_quiet_queue_does_not_look_slow():
    """One request at a time with long idle gaps: only busy time counts, so the rate is
    the queue's speed (10/s here), not the arrival rate (1 per 10 s)."""
    clock = FakeClock()
    queue = FirstTokenQueue(max_wait_s=1.0, clock=clock)
    for _ in range(16):
        _serve_at(queue, clock, 1, every_s=0.1)
        clock.now += 10.0
    assert queue.service_rate() == pytest.approx(10.0)
    queue.enter()
    assert queue.estimated_wait_s() == pytest.approx(0.2) and queue.full() is None


def test_a_stalled_queue_slows_its_estimate_down():
    clock = FakeClock()
    queue = FirstTokenQueue(max_wait_s=5.0, clock=clock)
    _serve_at(queue, clock, 16, every_s=0.1)
    queue.enter()
    assert queue.full() is None
    clock.now += 4.0  # no first token for 4 s with one waiting: 15 in 5.5 busy seconds
    assert queue.service_rate() == pytest.approx(15 / 5.5)
    assert queue.full() is None  # 2 / 2.7 = 0.73 s
    queue.leave(queue.enter())  # one left without a first token: not counted as service
    assert queue.service_rate() == pytest.approx(15 / 5.5)


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


async def _grpc_burst(address: str, prompts: list[list[int]], max_tokens: int):
    """Every prompt at once over gRPC: (token ids or None, status code, retry-after) each."""
    client = AsyncClient(address)

    async def one(prompt):
        try:
            out = await client.generate(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True)
            return out.token_ids, grpc.StatusCode.OK, None
        except grpc.aio.AioRpcError as e:
            return None, e.code(), dict(e.trailing_metadata() or ()).get("retry-after")

    try:
        return list(await asyncio.gather(*(one(p) for p in prompts)))
    finally:
        await client.close()


def _watch_refusals(router) -> tuple[list[str], list[int]]:
    """(reason of each refusal, ticket of each request the queue admitted). A request refused
    at arrival never takes a ticket: the admission check and the queue's enter run with no
    await between, so counting tickets shows every refusal was decided at once, however
    long a loaded machine (a GC pass, other tests' threads) takes to answer it."""
    refusals, tickets, generate, enter = [], [], router.generate, router.queue.enter

    async def watched(inp):
        try:
            async for delta in generate(inp):
                yield delta
        except Overloaded as e:
            refusals.append(str(e))
            raise

    def entered():
        tickets.append(enter())
        return tickets[-1]

    router.generate, router.queue.enter = watched, entered
    return refusals, tickets


def test_a_burst_past_what_can_start_in_time_is_refused_at_arrival(tiny_model):
    """Once the queue has measured its speed, a burst far past what it can start within the
    deadline is refused as it arrives (429 with Retry-After, decided in the router at once,
    by the estimate, the deadline or the decode pool's streams, never after waiting); the
    admitted requests finish with the exact greedy output, no 5xx, every block free."""
    distinct = [[3 + j, 5 + j % 7, 7] for j in range(50)]
    prompts = [distinct[i % 50] for i in range(300)]
    reference = engine_reference(tiny_model, distinct, new_tokens=24)
    cluster = _tiny_cluster(
        tiny_model, max_inflight_requests=1024, max_queue_wait_s=0.3, reserve_timeout_s=5.0
    )
    try:
        router = cluster.servers.router
        # A few requests at a time: the queue learns its rate. Their deadline is long (a fresh
        # cluster's first requests, on a loaded machine, may wait past 0.3 s); the burst's is
        # the short one.
        router.queue.max_wait_s = 30.0
        for start in range(0, 24, 4):
            warm = asyncio.run(_grpc_burst(cluster.address, prompts[start : start + 4], 24))
            assert [ids for ids, _, _ in warm] == reference[start : start + 4]
        assert router.queue.service_rate() is not None
        router.queue.max_wait_s = 0.3
        refusals, admitted = _watch_refusals(router)
        results = asyncio.run(_grpc_burst(cluster.address, prompts, 24))
        codes = collections.Counter(code for _, code, _ in results)
        assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
        for i, (ids, code, retry) in enumerate(results):
            if code == grpc.StatusCode.OK:
                assert ids == reference[i % 50]
            else:
                assert int(retry) >= 1
        assert len(refusals) == codes[grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert len(admitted) == codes[grpc.StatusCode.OK]  # no refusal after admission
        # Each refusal names the limit it hit: the queue's deadline, or (a burst can fill them
        # before the estimate passes the deadline) the decode pool's streams.
        limits = ("max_queue_wait_s", "the decode pool's")
        assert all(any(limit in why for limit in limits) for why in refusals), refusals
        assert any("would wait about" in why for why in refusals)  # the estimate refused
        assert_all_blocks_free(cluster)
    finally:
        cluster.stop()


def test_requests_past_the_decode_pool_s_streams_are_refused_at_arrival(tiny_model):
    """Each request ends on a decode worker holding one of its streams; the worker reports
    its budget, and with as many requests in the router as the pool has streams the next
    one is refused at arrival (not after its wait, at the worker). The router's count of
    requests in flight stands in for that many open streams here."""
    cluster = _tiny_cluster(tiny_model)
    try:
        router = cluster.servers.router
        (decode,) = router.decode.routable()
        budget = decode.last_status.max_streams
        assert budget >= 8 and decode.last_status.open_streams == 0
        router.inflight = budget
        err, refused_s = _refused_generate(cluster.address)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"decode pool's {budget} streams" in err.details() and refused_s < 0.5
        router.inflight = budget - 1  # one stream free: admitted, and it finishes
        resp = httpx.post(
            f"http://{cluster.http_address}/v1/completions",
            json={"prompt": [3, 4], "max_tokens": 2},
        )
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2
        router.inflight = 0
        assert_all_blocks_free(cluster)
    finally:
        cluster.stop()
