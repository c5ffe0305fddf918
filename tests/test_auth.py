"""Auth: the API key on HTTP (Bearer) and gRPC (metadata), on every route but /health, the
cluster token between router and workers, and gRPC server reflection (behind the key too).
"""

from __future__ import annotations

import asyncio

import grpc
import openai
import pytest
from google.protobuf.descriptor_pb2 import FileDescriptorProto
from google.protobuf.descriptor_pool import DescriptorPool
from google.protobuf.message_factory import GetMessageClass
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from grpc_plumbing.reflection import v1_message_classes
from pdserve.client import AsyncClient, Client
from pdserve.cluster.local import ClusterSpec, LocalCluster
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router.auth import bearer_ok
from tests.cluster_utils import assert_all_blocks_free
from tests.conftest import tiny_llama_dir
from tests.http_utils import get, post

KEY = "sk-test-key"
TOKEN = "cluster-secret"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("auth"), num_heads=4, num_kv_heads=2, seed=9)
    spec = ClusterSpec(
        model=str(path),
        num_blocks=256,
        max_model_len=128,
        http_port=0,
        api_key=KEY,
        cluster_token=TOKEN,
    )
    with LocalCluster(spec) as c:
        yield c
        assert_all_blocks_free(c)


def openai_client(cluster, key):
    return openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key=key, max_retries=0)


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_http_without_the_key_is_401(cluster, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for path, body in (("/v1/completions", {"prompt": "w5"}), ("/v1/chat/completions", {})):
        status, out = post(cluster.http_address, path, body, headers)
        assert status == 401 and out["error"]["code"] == "invalid_api_key"
    assert get(cluster.http_address, "/v1/models", headers)[0] == 401
    with openai_client(cluster, key or "x") as c, pytest.raises(openai.AuthenticationError):
        c.completions.create(model=cluster.router.cfg.model_name, prompt="w5", max_tokens=2)


def test_http_with_the_key_serves_through_token_guarded_workers(cluster):
    with openai_client(cluster, KEY) as c:
        out = c.chat.completions.create(
            model=cluster.router.cfg.model_name,
            max_tokens=4,
            messages=[{"role": "user", "content": "w5 w6"}],
        )
        assert out.usage.completion_tokens >= 1
        assert [m.id for m in c.models.list()] == [cluster.router.cfg.model_name]


def test_only_health_stays_open(cluster):
    """/metrics lists worker addresses and /docs the whole API: with a key set, they need it.
    The probes (/health, and /ping, vLLM's name for it) stay open."""
    assert get(cluster.http_address, "/health")[0] == 200
    assert get(cluster.http_address, "/ping")[0] == 200
    for path in ("/metrics", "/docs", "/openapi.json", "/redoc", "/version", "/no-such-route"):
        assert get(cluster.http_address, path)[0] == 401, path
    assert post(cluster.http_address, "/tokenize", {"prompt": "w5"})[0] == 401
    good = {"Authorization": f"Bearer {KEY}"}
    assert get(cluster.http_address, "/metrics", good)[0] == 200
    assert get(cluster.http_address, "/openapi.json", good)[0] == 200


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_grpc_without_the_key_is_unauthenticated(cluster, key):
    with Client(cluster.address, api_key=key) as client:
        for call in (lambda: client.generate(token_ids=[5], max_tokens=2), client.list_models):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert client.health().ready  # probes need no key


def test_grpc_with_the_key_sync_and_async(cluster):
    with Client(cluster.address, api_key=KEY) as client:
        out = client.generate(token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)
    assert len(out.token_ids) == 4 and out.finish_reason == "length"

    async def stream():
        client = AsyncClient(cluster.address, api_key=KEY)
        try:
            return [
                c async for c in client.stream(token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)
            ]
        finally:
            await client.close()

    chunks = asyncio.run(stream())
    assert [t for c in chunks for t in c.token_ids] == out.token_ids


class _WithKey(grpc.StreamStreamClientInterceptor):
    """Adds the API key to every call (what ``grpcurl -H 'authorization: Bearer KEY'`` does)."""

    def intercept_stream_stream(self, continuation, details, requests):
        md = [*(details.metadata or ()), ("authorization", f"Bearer {KEY}")]
        return continuation(details._replace(metadata=md), requests)


def test_grpc_reflection_needs_the_key(cluster):
    with grpc.insecure_channel(cluster.address) as channel:
        with pytest.raises(grpc.RpcError) as e:
            ProtoReflectionDescriptorDatabase(channel).get_services()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_works_through_reflection(cluster):
    """What grpcurl does: list services, fetch the schema, build messages, call Generate."""
    with grpc.insecure_channel(cluster.address) as plain:
        channel = grpc.intercept_channel(plain, _WithKey())
        db = ProtoReflectionDescriptorDatabase(channel)
        services = db.get_services()
        assert "pdserve.v1.Generation" in services
        assert "grpc.reflection.v1alpha.ServerReflection" in services
        method = (
            DescriptorPool(db)
            .FindServiceByName("pdserve.v1.Generation")
            .FindMethodByName("Generate")
        )
        request_cls, response_cls = (
            GetMessageClass(method.input_type),
            GetMessageClass(method.output_type),
        )
        call = channel.unary_stream(
            "/pdserve.v1.Generation/Generate",
            request_serializer=request_cls.SerializeToString,
            response_deserializer=response_cls.FromString,
        )
        request = request_cls(prompt="w5 w6", sampling={"max_tokens": 3, "ignore_eos": True})
        chunks = list(call(request, metadata=(("authorization", f"Bearer {KEY}"),)))
    assert sum(len(c.token_ids) for c in chunks) == 3 and chunks[-1].finish_reason == "length"


def test_a_reflection_v1_client_lists_the_services_and_fetches_the_schema(cluster):
    """Current grpcurl and grpc-java/go clients ask for grpc.reflection.v1 first."""
    request_cls, response_cls = v1_message_classes()
    assert request_cls.DESCRIPTOR.full_name == "grpc.reflection.v1.ServerReflectionRequest"
    with grpc.insecure_channel(cluster.address) as plain:
        call = grpc.intercept_channel(plain, _WithKey()).stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=request_cls.SerializeToString,
            response_deserializer=response_cls.FromString,
        )
        asked = ("pdserve.v1.Generation", "grpc.reflection.v1.ServerReflection")
        requests = [request_cls(list_services="")]
        requests += [request_cls(file_containing_symbol=s) for s in asked]
        listing, *schemas = list(call(iter(requests)))
    listed = {s.name for s in listing.list_services_response.service}
    assert {"pdserve.v1.Generation", "grpc.health.v1.Health"} <= listed
    assert {"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"} <= (
        listed
    )
    for symbol, response in zip(asked, schemas, strict=True):
        files = [
            FileDescriptorProto.FromString(b)
            for b in response.file_descriptor_response.file_descriptor_proto
        ]
        package, service = symbol.rsplit(".", 1)
        assert any(f.package == package and service in [s.name for s in f.service] for f in files)


@pytest.fixture(scope="module")
def worker_calls(cluster):
    """One call of each kind (unary, server-streaming, client-streaming) on each worker."""
    prefill_channel = grpc.insecure_channel(cluster.prefill_addresses[0])
    decode_channel = grpc.insecure_channel(cluster.decode_addresses[0])
    prefill = pb_grpc.PrefillWorkerStub(prefill_channel)
    decode = pb_grpc.DecodeWorkerStub(decode_channel)
    kv = pb_grpc.KvTransferStub(decode_channel)
    yield [
        lambda md: prefill.Status(pb.StatusRequest(), metadata=md, timeout=5),
        lambda md: decode.Release(pb.ReleaseRequest(lease_id="nope"), metadata=md, timeout=5),
        lambda md: decode.Status(pb.StatusRequest(), metadata=md, timeout=5),
        lambda md: list(prefill.Prefill(pb.PrefillRequest(request_id="x"), metadata=md, timeout=5)),
        lambda md: kv.PushFrames(iter([pb.KvFrame(header=b"x")]), metadata=md, timeout=5),
    ]
    prefill_channel.close()
    decode_channel.close()


@pytest.mark.parametrize("metadata", [None, (("x-pdserve-token", "wrong"),)])
def test_worker_calls_need_the_cluster_token(worker_calls, metadata):
    for call in worker_calls:
        with pytest.raises(grpc.RpcError) as e:
            call(metadata)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    good = (("x-pdserve-token", TOKEN),)
    assert worker_calls[0](good).role == "prefill"
    assert worker_calls[1](good).released is False


def test_bearer_check():
    assert bearer_ok("Bearer k1", "k1") and bearer_ok("bearer k1", "k1")
    assert not any(bearer_ok(h, "k1") for h in (None, "", "k1", "Bearer k2", "Basic k1", "Bearer"))
