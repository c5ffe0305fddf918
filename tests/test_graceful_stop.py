"""A graceful stop of the router (issue 46, ``RouterServers.drain``): new requests are refused
at once (HTTP 429 with Retry-After, gRPC UNAVAILABLE with retry-after, health NOT_SERVING),
running streams finish with the text of an undisturbed run, and streams still running when
the grace period ends get a clean error (an SSE error event, gRPC UNAVAILABLE), not a cut
connection; every block comes back. Workers drain the same way (``RunningWorker.drain``)."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_worker.worker import DecodeWorker
from pdserve.client import Client
from pdserve.cluster.local import ClusterSpec, LocalCluster
from tests.cluster_utils import assert_all_blocks_free
from tests.conftest import tiny_llama_dir
from tests.http_utils import open_stream, sse_events

STREAMS = 6
STEP_DELAY_S = 0.02  # each decode step, so the streams are still running when the stop comes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("drain"), seed=11)
    return path


@pytest.fixture
def cluster(tiny, monkeypatch):
    updated = DecodeWorker.on_updated

    def slow(self, reqs):
        time.sleep(STEP_DELAY_S)
        return updated(self, reqs)

    monkeypatch.setattr(DecodeWorker, "on_updated", slow)
    spec = ClusterSpec(model=str(tiny), num_blocks=256, max_model_len=512, http_port=0)
    with LocalCluster(spec) as c:
        yield c


def _body(i: int, max_tokens: int) -> dict:
    prompt = [3 + i, 17, 29 + 2 * i, 40, 5 + i]
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }


class Stream(threading.Thread):
    """One streamed completion over plain HTTP: its text, whether it ended with [DONE], and
    any error event."""

    def __init__(self, address: str, body: dict):
        super().__init__(daemon=True)
        self.address, self.body = address, body
        self.text, self.done, self.errors = "", False, []
        self.started = threading.Event()

    def run(self) -> None:
        conn, resp = open_stream(self.address, "/v1/completions", self.body)
        try:
            assert resp.status == 200, resp.read()
            for data in sse_events(resp):
                if data == "[DONE]":
                    self.done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    self.errors.append(event["error"])
                    continue
                self.text += event["choices"][0]["text"]
                self.started.set()
        finally:
            self.started.set()
            conn.close()


def _run_streams(cluster, max_tokens: int) -> list[Stream]:
    streams = [Stream(cluster.http_address, _body(i, max_tokens)) for i in range(STREAMS)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(60)
    return streams


def _post_status(address: str, body: dict) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection(address, timeout=30)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        headers = {k.lower(): v for k, v in resp.getheaders()}
        return resp.status, headers, json.loads(resp.read())
    finally:
        conn.close()


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        req = health_pb2.HealthCheckRequest(service="")
        return health_pb2_grpc.HealthStub(ch).Check(req, timeout=5).status


def test_a_drain_lets_running_streams_finish_and_refuses_new_requests(cluster):
    undisturbed = _run_streams(cluster, 64)
    for s in undisturbed:
        s.join(60)
    reference = [s.text for s in undisturbed]
    assert all(reference)
    assert _health(cluster.address) == health_pb2.HealthCheckResponse.SERVING
    streams = _run_streams(cluster, 64)
    drain = asyncio.run_coroutine_threadsafe(cluster.servers.drain(30.0), cluster.loop)
    t0 = time.monotonic()
    while not cluster.router.drain.draining:
        time.sleep(0.01)
    status, headers, body = _post_status(cluster.http_address, _body(0, 4))
    assert status == 429 and int(headers["retry-after"]) >= 1, (status, body)
    assert "shutting down" in body["error"]["message"]
    with Client(cluster.address) as client, pytest.raises(grpc.RpcError) as err:
        client.generate(token_ids=[3, 4, 5], max_tokens=4)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert dict(err.value.trailing_metadata())["retry-after"]
    assert _health(cluster.address) == health_pb2.HealthCheckResponse.NOT_SERVING
    conn = http.client.HTTPConnection(cluster.http_address, timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 503
    conn.close()
    assert any(s.is_alive() for s in streams), "the streams ended before the drain was tested"
    assert drain.result(60) == 0  # nobody had to be ended
    assert time.monotonic() - t0 < 30
    for s, want in zip(streams, reference, strict=True):
        s.join(10)
        assert s.done and not s.errors and s.text == want
    assert_all_blocks_free(cluster)


def test_streams_past_the_grace_period_end_with_an_error_not_a_cut(cluster):
    streams = _run_streams(cluster, 400)
    with Client(cluster.address) as client:
        grpc_errors: list[grpc.RpcError] = []

        def grpc_stream():
            try:
                client.generate(token_ids=[9, 8, 7], max_tokens=400, ignore_eos=True)
            except grpc.RpcError as e:
                grpc_errors.append(e)

        t = threading.Thread(target=grpc_stream, daemon=True)
        t.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        ended = cluster.run(cluster.servers.drain(0.5), timeout=30)
        assert time.monotonic() - t0 < 5
        assert ended == STREAMS + 1
        t.join(10)
    for s in streams:
        s.join(10)
        assert not s.is_alive() and s.text  # a clean end of the HTTP response, after text
        assert len(s.errors) == 1 and "shutting down" in s.errors[0]["message"]
    assert len(grpc_errors) == 1 and grpc_errors[0].code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in grpc_errors[0].details()
    assert_all_blocks_free(cluster)


def test_a_worker_drain_waits_for_its_running_requests(cluster):
    # The decode worker (in process) drains while a request runs on it: it reports draining
    # (health NOT_SERVING) at once and returns once the request is done.
    running = cluster.running[-1]
    with Client(cluster.address) as client:
        result = {}
        t = threading.Thread(
            target=lambda: result.update(
                out=client.generate(token_ids=[5, 6], max_tokens=60, ignore_eos=True)
            )
        )
        t.start()
        deadline = time.monotonic() + 30
        while not running.worker.status()["num_running"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t0 = time.monotonic()
        assert running.drain(30.0)
        assert running.worker.draining and time.monotonic() - t0 > 0.1
        t.join(30)
    assert len(result["out"].token_ids) == 60
