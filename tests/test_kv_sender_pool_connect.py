"""The sender pool connects outside its lock: a slow peer (a torch_dist pairing that stalls)
holds up only the Prefills to that endpoint, callers of one endpoint share one connect, and a
connect past its deadline fails its callers with a ConnectionError (the Prefill's UNAVAILABLE)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kv_transfer.sender_pool import SenderPool, SenderPoolSettings


class FakeSender:
    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.closed = False
        self.link_broken = False

    def touch(self) -> None:
        pass

    def idle_s(self, now=None) -> float:
        return 0.0

    def close(self) -> None:
        self.closed = True


class SlowConnector:
    """Connects to ``slow`` only once ``release`` is set; everything else at once."""

    def __init__(self):
        self.release = threading.Event()
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, transport: str, endpoint: str) -> FakeSender:
        with self.lock:
            self.calls.append(endpoint)
        if endpoint == "slow":
            self.release.wait(30)
        if endpoint == "dead":
            raise ConnectionError("refused")
        return FakeSender(endpoint)


@pytest.fixture
def pool():
    settings = SenderPoolSettings(connect_timeout_s=10.0, check_interval_s=60.0)
    pool = SenderPool(settings=settings)
    pool._connect = SlowConnector()
    yield pool
    pool._connect.release.set()
    pool.close()


def test_a_slow_peer_does_not_stall_other_endpoints(pool):
    with ThreadPoolExecutor(4) as ex:
        slow = ex.submit(pool.get, "torch_dist", "slow")
        time.sleep(0.2)  # the slow connect is under way
        t0 = time.monotonic()
        fast = [pool.get("torch_dist", f"fast-{i}") for i in range(5)]
        assert time.monotonic() - t0 < 1.0, "a slow connect stalled other endpoints"
        assert [s.endpoint for s in fast] == [f"fast-{i}" for i in range(5)]
        assert not slow.done()
        pool._connect.release.set()
        assert slow.result(5).endpoint == "slow"


def test_callers_of_one_endpoint_share_one_connect(pool):
    with ThreadPoolExecutor(8) as ex:
        waiting = [ex.submit(pool.get, "torch_dist", "slow") for _ in range(8)]
        time.sleep(0.3)
        pool._connect.release.set()
        senders = {id(f.result(5)) for f in waiting}
    assert len(senders) == 1 and pool._connect.calls.count("slow") == 1
    assert pool.get("torch_dist", "slow") is waiting[0].result()  # reused, not reconnected


def test_a_connect_past_its_deadline_fails_its_callers_and_serves_the_next():
    pool = SenderPool(settings=SenderPoolSettings(connect_timeout_s=0.3, check_interval_s=60.0))
    pool._connect = SlowConnector()
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="took over 0.3 s"):
            pool.get("torch_dist", "slow")
        assert time.monotonic() - t0 < 1.5
        pool._connect.release.set()  # the peer answers after all: its sender is kept
        deadline = time.monotonic() + 5
        while ("torch_dist", "slow") not in pool.endpoints():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert pool.get("torch_dist", "slow").endpoint == "slow"
        assert pool._connect.calls.count("slow") == 1
    finally:
        pool._connect.release.set()
        pool.close()


def test_a_failed_connect_raises_its_error_and_the_next_call_tries_again(pool):
    for _ in range(2):
        with pytest.raises(ConnectionError, match="refused"):
            pool.get("torch_dist", "dead")
    assert pool._connect.calls.count("dead") == 2 and not pool.endpoints()
