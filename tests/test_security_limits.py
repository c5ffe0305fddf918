"""Limits: each one answers 400 (gRPC INVALID_ARGUMENT) naming it, and the server stays up;
leases must be finite and positive, over gRPC Reserve too; an off-loopback bind without the
authentication that makes it safe refuses to start, saying why, before anything binds."""

from __future__ import annotations

import asyncio
import math
import os
import socket
import subprocess
import sys

import grpc
import pytest

from grpc_plumbing.auth import OpenBindError, is_loopback
from grpc_plumbing.server import worker_server
from kv_transfer.lease import LeaseTable
from pdserve.client import Client
from pdserve.cluster.local import ClusterSpec, LocalCluster
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router.app import start_router
from router.limits import RequestLimits
from router.security import ApiSecurity
from router.settings import RouterSettings
from tests.cluster_utils import assert_all_blocks_free
from tests.conftest import tiny_llama_dir
from tests.http_utils import post

LIMITS = RequestLimits(
    max_request_bytes=4096,
    max_prompt_tokens=24,
    max_tokens=8,
    max_stop_strings=2,
    max_stop_string_chars=8,
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("lim"), num_heads=4, num_kv_heads=2, seed=5)
    spec = ClusterSpec(
        model=str(path), num_blocks=128, max_model_len=128, http_port=0, limits=LIMITS
    )
    with LocalCluster(spec) as c:
        yield c
        assert_all_blocks_free(c)


def completion(cluster, **body):
    return post(cluster.http_address, "/v1/completions", {"prompt": "w5 w6", **body})


def assert_serving(cluster):
    status, out = completion(cluster, max_tokens=2)
    assert status == 200 and out["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize(
    ("body", "param", "limit"),
    [
        ({"prompt": [5] * 25}, "prompt", "max_prompt_tokens"),
        ({"max_tokens": 9}, "max_tokens", "max_tokens"),
        ({"stop": ["a", "b", "c"]}, "stop", "max_stop_strings"),
        ({"stop": ["x" * 9]}, "stop", "max_stop_string_chars"),
    ],
)
def test_each_http_limit_is_a_400_naming_it(cluster, body, param, limit):
    status, out = completion(cluster, **body)
    assert status == 400, out
    assert out["error"]["param"] == param and limit in out["error"]["message"]
    assert_serving(cluster)


def test_a_body_over_the_cap_is_a_413_naming_it(cluster):
    status, out = completion(cluster, prompt="w5 " * 2000)
    assert status == 413, out
    assert out["error"]["param"] == "body" and "max_request_bytes" in out["error"]["message"]
    assert_serving(cluster)


def test_a_body_over_the_cap_is_refused_from_its_content_length(cluster):
    status, out = post(cluster.http_address, "/v1/chat/completions", b"{" + b" " * 5000 + b"}")
    assert status == 413 and "max_request_bytes" in out["error"]["message"]
    assert_serving(cluster)


@pytest.mark.parametrize(
    ("kw", "limit"),
    [
        ({"token_ids": [5] * 25, "max_tokens": 2}, "max_prompt_tokens"),
        ({"token_ids": [5], "max_tokens": 9}, "max_tokens"),
        ({"token_ids": [5], "max_tokens": 2, "stop": ["a", "b", "c"]}, "max_stop_strings"),
    ],
)
def test_each_grpc_limit_is_invalid_argument_naming_it(cluster, kw, limit):
    with Client(cluster.address) as client:
        with pytest.raises(grpc.RpcError) as e:
            client.generate(**kw)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and limit in e.value.details()
        assert client.generate(token_ids=[5, 6], max_tokens=2).finish_reason


def test_a_grpc_request_over_max_request_bytes_is_refused(cluster):
    with Client(cluster.address) as client:
        with pytest.raises(grpc.RpcError) as e:
            client.generate(prompt="w5 " * 2000, max_tokens=2)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.health().ready


@pytest.mark.parametrize("seconds", [math.nan, math.inf, -1.0, 1e9])
def test_reserve_refuses_a_lease_that_is_not_finite_and_positive(cluster, seconds):
    with grpc.insecure_channel(cluster.decode_addresses[0]) as channel:
        stub = pb_grpc.DecodeWorkerStub(channel)
        req = pb.ReserveRequest(request_id="r-nan", num_tokens=16, lease_seconds=seconds)
        with pytest.raises(grpc.RpcError) as e:
            stub.Reserve(req, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "lease_seconds" in e.value.details() and "max_lease_seconds" in e.value.details()
        st = stub.Status(pb.StatusRequest(), timeout=10)
    assert st.num_leases == 0 and st.num_free_blocks == st.num_total_blocks


@pytest.mark.parametrize("seconds", [math.nan, math.inf, 0.0, -5.0, 601.0, "10"])
def test_the_lease_table_refuses_bad_ttls(seconds):
    table = LeaseTable(30.0)
    with pytest.raises(ValueError, match="lease_seconds"):
        table.open("r", [1], ttl_s=seconds)
    lease = table.open("r", [1], ttl_s=1.5)
    with pytest.raises(ValueError):
        table.extend(lease.lease_id, seconds)
    with pytest.raises(ValueError):
        LeaseTable(math.nan)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.5.6.7", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("192.168.1.2", False),
        ("example.com", False),
        ("", False),
    ],
)
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_router_off_loopback_without_a_key_refuses_before_binding(cluster, monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    port = free_port()
    cfg = RouterSettings(model_dir=str(cluster.model_dir))
    with pytest.raises(OpenBindError, match="without an API key.*--allow-unauthenticated"):
        asyncio.run(start_router(cfg, [], [], "0.0.0.0", port, port))
    assert port_is_free(port)


def test_allow_unauthenticated_is_the_operators_explicit_choice(cluster, monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    from router.security import check_api_exposure

    check_api_exposure("0.0.0.0", None, ApiSecurity(allow_unauthenticated=True))
    check_api_exposure("0.0.0.0", "sk-key", ApiSecurity())
    check_api_exposure("127.0.0.1", None, ApiSecurity())


def test_a_worker_off_loopback_without_a_token_refuses_before_binding(monkeypatch):
    monkeypatch.delenv("PDSERVE_CLUSTER_TOKEN", raising=False)
    port = free_port()
    with pytest.raises(OpenBindError, match="without a cluster token"):
        worker_server("0.0.0.0", port, None)
    assert port_is_free(port)
    server, _ = worker_server("127.0.0.1", 0, None)  # loopback: fine
    server.stop(None)


def test_python_m_router_off_loopback_without_a_key_exits_with_the_reason(cluster):
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}
    cmd = [sys.executable, "-m", "router", "--model", str(cluster.model_dir), "--prefill", "x"]
    cmd += ["--decode", "y", "--host", "0.0.0.0", "--port", str(free_port())]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0
    assert "refusing to serve the client API on 0.0.0.0 without an API key" in out.stderr
    assert "Traceback" not in out.stderr
