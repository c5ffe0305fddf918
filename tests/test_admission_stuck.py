"""Admission that one request cannot poison (issue 46): a request stuck on one worker stays
the oldest in the router's first-token queue, but no longer refuses everyone once it is
clear the queue moves (a later arrival got its first token first), or once it has waited far
past the deadline. A queue that does not move still refuses (tests/test_overload.py)."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from pdserve.client import Client
from pdserve.cluster.local import ClusterSpec, LocalCluster
from router.limits import FirstTokenQueue
from tests.cluster_utils import assert_all_blocks_free
from tests.conftest import tiny_llama_dir
from tests.test_disagg import engine_reference

MAX_WAIT_S = 1.0  # the queue's deadline here; the stuck request is held 2.5 x past it
HELD = [9, 9, 9, 4, 5]  # the prompt the patched prefill workers hold
PROMPT = [3, 5, 7, 11]


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_overtaken_request_no_longer_refuses_arrivals():
    clock = FakeClock()
    queue = FirstTokenQueue(max_wait_s=1.0, clock=clock)
    stuck = queue.enter()
    clock.now += 0.5
    queue.served(queue.enter())  # a later arrival had its first token: the queue moves
    clock.now += 1.0  # the stuck one waited 1.5 s, past the deadline
    assert queue.oldest_wait_s() == 0.0 and queue.full() is None
    behind = queue.enter()  # one that nobody overtook yet still counts
    clock.now += 1.1
    assert "the oldest for 1.1 s" in queue.full()
    queue.leave(behind)
    queue.leave(stuck)
    assert len(queue) == 0 and queue.full() is None


def test_a_lone_stuck_request_refuses_only_until_it_is_stale():
    """Nobody overtook it: the deadline refuses (it may be the queue that is slow), until the
    request waited stale_after_s (3 x the deadline); then it counts for nothing."""
    clock = FakeClock()
    queue = FirstTokenQueue(max_wait_s=1.0, clock=clock)
    assert queue.stale_after_s == 3.0
    stuck = queue.enter()
    clock.now += 1.5
    assert "max_queue_wait_s" in queue.full()
    clock.now += 1.6
    assert queue.full() is None and queue.num_live() == 0 and len(queue) == 1
    queue.leave(stuck)
    assert len(queue) == 0


def test_a_stale_request_stops_the_busy_clock_and_leaves_the_estimate():
    """The rate counts busy time, time with a request waiting: a stuck one would keep the
    queue busy for good and slow the estimate down until every arrival is refused."""
    clock = FakeClock()
    queue = FirstTokenQueue(max_wait_s=1.0, clock=clock)
    for _ in range(16):  # 10 first tokens per busy second
        ticket = queue.enter()
        clock.now += 0.1
        queue.served(ticket)
    queue.enter()  # stuck
    clock.now += 600.0
    assert queue.service_rate() == pytest.approx(15 / (1.5 + 3.0))  # busy until it went stale
    assert queue.estimated_wait_s() == pytest.approx(1 / (15 / 4.5)) and queue.full() is None


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("stuck"), num_kv_heads=2, seed=5)
    return path


def _hold_prompt(worker, held: threading.Event, release: threading.Event) -> None:
    """Make ``worker`` hold the Prefill of HELD (its handler waits) until ``release``."""
    submit = worker.submit

    def holding(request_id, prompt, *args, **kw):
        if list(prompt[: len(HELD)]) == HELD:
            held.set()
            release.wait(30)
        return submit(request_id, prompt, *args, **kw)

    worker.submit = holding


def test_one_request_held_on_a_prefill_worker_does_not_refuse_the_rest(tiny_model):
    """One request held open on one of two prefill workers, 2.5 x past max_queue_wait_s: the
    requests sent meanwhile (to the other worker) are admitted and exact throughout; the held
    one finishes exactly once let go, and every block comes back."""
    reference = engine_reference(tiny_model, [PROMPT, HELD], new_tokens=4)
    spec = ClusterSpec(
        model=str(tiny_model), num_prefill=2, num_blocks=128, max_model_len=128, http_port=0
    )
    held, release = threading.Event(), threading.Event()
    with LocalCluster(spec) as cluster, ThreadPoolExecutor(1) as pool:
        router = cluster.servers.router
        router.cfg = dataclasses.replace(router.cfg, max_queue_wait_s=MAX_WAIT_S)
        router.queue = FirstTokenQueue(MAX_WAIT_S)
        for worker in cluster.prefill_workers:
            _hold_prompt(worker, held, release)
        client = Client(cluster.address)
        try:
            stuck = pool.submit(client.generate, token_ids=HELD, max_tokens=4, ignore_eos=True)
            assert held.wait(10)
            start, outs = time.monotonic(), []
            while time.monotonic() - start < 2.5 * MAX_WAIT_S:
                try:
                    out = client.generate(token_ids=PROMPT, max_tokens=4, ignore_eos=True)
                except grpc.RpcError as e:
                    pytest.fail(f"refused after {time.monotonic() - start:.2f} s: {e.details()}")
                outs.append(out.token_ids)
            resp = httpx.post(
                f"http://{cluster.http_address}/v1/completions",
                json={"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True},
                timeout=30,
            )
            assert resp.status_code == 200, resp.text
            assert not stuck.done() and router.queue.oldest_wait_s() == 0.0
            assert len(router.queue) == 1  # the held one, waiting all along
            release.set()
            assert stuck.result(timeout=30).token_ids == reference[1]
        finally:
            release.set()
            client.close()
        assert len(outs) >= 3 and outs == [reference[0]] * len(outs)
        assert_all_blocks_free(cluster)
