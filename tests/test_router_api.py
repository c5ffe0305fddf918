"""The router's gRPC API: validation with INVALID_ARGUMENT naming the field, models, health,
streaming, stop strings; the server keeps serving after bad input."""

from __future__ import annotations

import grpc
import pytest

from pdserve.client import Client
from pdserve.cluster.local import ClusterSpec, LocalCluster
from tests.cluster_utils import assert_all_blocks_free
from tests.conftest import tiny_llama_dir


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("router"), num_heads=4, num_kv_heads=2, seed=7)
    with LocalCluster(ClusterSpec(model=str(path), num_blocks=256, max_model_len=128)) as c:
        yield c
        assert_all_blocks_free(c)


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.address) as c:
        yield c


BAD_INPUTS = [
    (dict(token_ids=[5], max_tokens=0, temperature=-1.0), "temperature"),
    (dict(token_ids=[5], top_p=1.5), "top_p"),
    (dict(token_ids=[5], top_k=-1), "top_k"),
    (dict(token_ids=[5], max_tokens=10, min_tokens=20), "min_tokens"),
    (dict(token_ids=[]), "prompt"),
    (dict(token_ids=[5, 100000]), "prompt"),
    (dict(token_ids=[5] * 128), "prompt"),
    (dict(token_ids=[5] * 100, max_tokens=100), "max_tokens"),
    (dict(), "input"),
    (dict(messages=[]), "messages"),
    (dict(token_ids=[5], request_id="a#1"), "request_id"),
    (dict(token_ids=[5], request_id="x" * 257), "request_id"),
]


@pytest.mark.parametrize("kwargs,param", BAD_INPUTS, ids=[p for _, p in BAD_INPUTS])
def test_bad_input_is_invalid_argument_naming_the_parameter(client, kwargs, param):
    with pytest.raises(grpc.RpcError) as e:
        client.generate(**kwargs)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert param in e.value.details()
    # ... and the server keeps serving.
    assert client.generate(token_ids=[5, 6], max_tokens=2).finish_reason in ("stop", "length")


def test_unknown_model_is_not_found(client):
    with pytest.raises(grpc.RpcError) as e:
        client.generate(token_ids=[5], model="gpt-17")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_models_and_health(client):
    [model] = client.list_models()
    assert model.id == "smollm2" and model.max_model_len == 128
    health = client.health()
    assert health.ready and health.prefill_workers == 1 and health.decode_workers == 1


def test_text_prompt_streams_text_and_usage(client, cluster):
    chunks = list(client.stream("w5 w6 w7", max_tokens=6, ignore_eos=True))
    assert len(chunks) >= 2, "tokens are streamed, not sent at once"
    text = "".join(c.text for c in chunks)
    ids = [t for c in chunks for t in c.token_ids]
    assert text.split() == [f"w{i}" for i in ids]
    assert chunks[-1].usage.prompt_tokens == 3 and chunks[-1].usage.completion_tokens == 6


def test_stop_string_ends_the_request(client):
    free = client.generate(token_ids=[9, 10, 11], max_tokens=8, ignore_eos=True)
    words = free.text.split()
    stop = words[3]
    stopped = client.generate(token_ids=[9, 10, 11], max_tokens=8, ignore_eos=True, stop=[stop])
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text and free.text.startswith(stopped.text)


def test_max_tokens_one_finishes_on_the_first_token(client):
    out = client.generate(token_ids=[9, 10, 11], max_tokens=1, ignore_eos=True)
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_seeded_sampling_matches_between_requests(client):
    a = client.generate(token_ids=[9, 10], max_tokens=8, temperature=3.0, seed=42, ignore_eos=True)
    b = client.generate(token_ids=[9, 10], max_tokens=8, temperature=3.0, seed=42, ignore_eos=True)
    assert a.token_ids == b.token_ids


def test_a_request_id_already_in_flight_is_refused_and_the_first_goes_on(client):
    """Workers key aborts and leases by request id: a second live request under the same id is
    INVALID_ARGUMENT naming request_id, and the first one finishes untouched."""
    first = client.stream(token_ids=[5, 6, 7], max_tokens=40, ignore_eos=True, request_id="dup")
    head = next(first)  # the first request is live
    with pytest.raises(grpc.RpcError) as e:
        client.generate(token_ids=[5, 6], max_tokens=2, request_id="dup")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id" in e.value.details() and "already in flight" in e.value.details()
    rest = list(first)
    tokens = list(head.token_ids) + [t for c in rest for t in c.token_ids]
    assert len(tokens) == 40 and rest[-1].finish_reason == "length"
    # Once it finished, the id is free again.
    assert len(client.generate(token_ids=[5], max_tokens=3, request_id="dup").token_ids) == 3
