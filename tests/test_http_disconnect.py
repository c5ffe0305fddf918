"""A client that hangs up on a non-streaming HTTP request (issue 19): nothing is being sent to
it, so only the router's watch on the connection can tell. The request is aborted on both
pools within a step, and every block comes back."""

from __future__ import annotations

import json
import socket
import time

import pytest

from pdserve.cluster.local import ClusterSpec, LocalCluster
from tests.cluster_utils import assert_all_blocks_free, worker_statuses
from tests.conftest import tiny_llama_dir
from tests.http_utils import post

MAX_TOKENS = 400


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("disconnect"), seed=3)
    return path


def _record_stream_ends(worker) -> list[tuple[str, str, int]]:
    """(request id, finish reason, tokens generated) of every stream the decode worker ends."""
    ends = []
    end_stream = worker._end_stream

    def record(req, reason):
        ends.append((req.request_id, reason, len(req.output_token_ids)))
        end_stream(req, reason)

    worker._end_stream = record
    return ends


def _send_and_keep_open(address: str, path: str, body: dict) -> socket.socket:
    """A raw HTTP/1.1 request whose socket the test closes itself (a client hanging up)."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def _wait_until_decoding(cluster, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(s.role == "decode" and s.num_running for s in worker_statuses(cluster)):
            return
        time.sleep(0.01)
    raise AssertionError("the request never started decoding")


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": [5, 6, 7, 8]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5 w6 w7"}]}),
    ],
)
def test_a_non_streaming_client_that_hangs_up_is_aborted_on_both_pools(tiny_model, path, body):
    spec = ClusterSpec(model=str(tiny_model), num_blocks=256, max_model_len=512, http_port=0)
    with LocalCluster(spec) as cluster:
        ends = _record_stream_ends(cluster.decode_workers[0])
        body = {**body, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
        sock = _send_and_keep_open(cluster.http_address, path, body)
        _wait_until_decoding(cluster)
        sock.close()
        assert_all_blocks_free(cluster, timeout=5)  # both pools, no lease, nothing running
        assert len(ends) == 1
        _, reason, generated = ends[0]
        assert reason == "abort" and generated < MAX_TOKENS
        # The router is not wedged: the next request is answered in full.
        status, payload = post(cluster.http_address, path, {**body, "max_tokens": 3})
        assert status == 200 and payload["usage"]["completion_tokens"] == 3
        assert_all_blocks_free(cluster)
