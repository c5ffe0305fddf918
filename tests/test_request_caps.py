"""Per-request cost caps (router/limits.py): each answers 400 / INVALID_ARGUMENT naming the
parameter and the limit, over HTTP and gRPC, and the server goes on serving; an oversized body
posted with urllib is answered 413, not cut; n > 1 with a seed at the top of int64 works for
every sequence."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request

import grpc
import pytest

from engine.request import SamplingParams
from pdserve.client import Client
from pdserve.cluster.local import ClusterSpec, LocalCluster
from protos import pdserve_pb2 as pb
from router.flow.types import sequence_sampling
from router.limits import RequestLimits
from tests.cluster_utils import assert_all_blocks_free
from tests.conftest import tiny_llama_dir
from tests.http_utils import open_stream, post, sse_events

LIMITS = RequestLimits(
    max_request_bytes=4096,
    max_logit_bias=4,
    max_stop_token_ids=4,
    max_sequences=4,
    max_total_tokens=40,
    max_logprobs=3,
)
TOP_SEED = 2**63 - 1


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("caps"), num_heads=4, num_kv_heads=2, seed=6)
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


FIVE_IDS = [10, 11, 12, 13, 14]


@pytest.mark.parametrize(
    ("path", "body", "param", "limit"),
    [
        ("completions", {"logit_bias": {str(t): 1.0 for t in FIVE_IDS}}, "logit_bias", "max_logit_bias"),
        ("completions", {"stop_token_ids": FIVE_IDS}, "stop_token_ids", "max_stop_token_ids"),
        ("completions", {"n": 5, "max_tokens": 2}, "n", "max_sequences"),
        ("completions", {"prompt": ["w5"] * 3, "n": 2, "max_tokens": 2}, "n", "max_sequences"),
        ("completions", {"n": 4, "max_tokens": 11}, "max_tokens", "max_total_tokens"),
        ("completions", {"prompt": ["w5", "w6"], "max_tokens": 21}, "max_tokens", "max_total_tokens"),
        ("completions", {"logprobs": 4, "max_tokens": 2}, "logprobs", "max_logprobs"),
        ("completions", {"logprobs": 4, "echo": True, "max_tokens": 2}, "logprobs", "max_logprobs"),
        ("chat/completions", {"logprobs": True, "top_logprobs": 4}, "top_logprobs", "max_logprobs"),
        ("chat/completions", {"n": 2, "max_tokens": 21}, "max_tokens", "max_total_tokens"),
    ],
)  # fmt: skip
def test_each_cost_cap_is_an_http_400_naming_it(cluster, path, body, param, limit):
    if path.startswith("chat"):
        body = {"messages": [{"role": "user", "content": "w5"}], **body}
    status, out = post(cluster.http_address, f"/v1/{path}", {"prompt": "w5 w6", **body})
    assert status == 400, out
    assert out["error"]["param"] == param, out
    assert limit in out["error"]["message"], out
    assert_serving(cluster)


def test_requests_at_each_cap_are_served(cluster):
    at_caps = {
        "logit_bias": {str(t): 0.0 for t in FIVE_IDS[:4]},
        "stop_token_ids": FIVE_IDS[:4],
        "prompt": ["w5", "w6"],
        "n": 2,
        "max_tokens": 10,  # 2 x 2 x 10 = 40 tokens
        "logprobs": 3,
        "ignore_eos": True,
    }
    status, out = completion(cluster, **at_caps)
    assert status == 200, out
    assert len(out["choices"]) == 4
    assert all(len(c["logprobs"]["top_logprobs"][0]) == 3 for c in out["choices"])


@pytest.mark.parametrize(
    ("kw", "limit"),
    [
        ({"logit_bias": {t: 1.0 for t in FIVE_IDS}}, "max_logit_bias"),
        ({"stop_token_ids": FIVE_IDS}, "max_stop_token_ids"),
        ({"n": 5}, "max_sequences"),
        ({"n": 4, "max_tokens": 11}, "max_total_tokens"),
        ({"logprobs": 4}, "max_logprobs"),
    ],
)
def test_each_cost_cap_is_grpc_invalid_argument_naming_it(cluster, kw, limit):
    with Client(cluster.address) as client:
        with pytest.raises(grpc.RpcError) as e:
            client.generate(token_ids=[5, 6], **{"max_tokens": 2, **kw})
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert limit in e.value.details(), e.value.details()
        assert client.generate(token_ids=[5, 6], max_tokens=2).finish_reason


def test_a_10_mb_prompt_posted_with_urllib_reads_a_413_naming_the_limit(cluster):
    body = json.dumps({"prompt": "w5 " * (10_000_000 // 3), "max_tokens": 2}).encode()
    assert len(body) > 10_000_000
    req = urllib.request.Request(
        f"http://{cluster.http_address}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:  # not a broken pipe or a reset
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 413
    out = json.loads(e.value.read())
    assert out["error"]["param"] == "body" and "max_request_bytes" in out["error"]["message"]
    assert_serving(cluster)


def test_a_body_declared_past_what_is_dropped_is_answered_at_once(cluster):
    conn = http.client.HTTPConnection(cluster.http_address, timeout=30)
    try:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(1 << 30))  # 1 GiB, never sent
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 413 and resp.getheader("connection") == "close"
        assert "max_request_bytes" in json.loads(resp.read())["error"]["message"]
    finally:
        conn.close()
    assert_serving(cluster)


# ---- seeds ------------------------------------------------------------------------------


def test_fork_seeds_wrap_in_int64_the_same_on_the_router_and_the_worker():
    wire = pb.SamplingParams(seed=TOP_SEED, n=2)
    for i in range(2):
        router_seed = sequence_sampling(wire, i).seed  # would overflow the int64 field
        assert router_seed == SamplingParams(seed=TOP_SEED, n=2).for_sequence(i).seed
    assert sequence_sampling(wire, 1).seed == -(2**63)


@pytest.mark.parametrize("stream", [False, True])
def test_n2_with_the_top_seed_is_served_over_http(cluster, stream):
    body = {"prompt": "w5 w6", "n": 2, "seed": TOP_SEED, "temperature": 1.0, "max_tokens": 4}
    if not stream:
        status, out = completion(cluster, **body)
        assert status == 200, out
        assert sorted(c["index"] for c in out["choices"]) == [0, 1]
        assert all(c["finish_reason"] for c in out["choices"])
        return
    conn, resp = open_stream(cluster.http_address, "/v1/completions", {**body, "stream": True})
    try:
        assert resp.status == 200
        events = list(sse_events(resp))
    finally:
        conn.close()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    finished = {c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]}
    assert finished == {0, 1}


def test_n2_with_the_top_seed_is_served_over_grpc(cluster):
    with Client(cluster.address) as client:
        chunks = list(
            client.stream(token_ids=[5, 6], n=2, seed=TOP_SEED, temperature=1.0, max_tokens=4)
        )
    assert {c.index for c in chunks if c.finish_reason} == {0, 1}
