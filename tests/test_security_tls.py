"""TLS with self-signed certificates made here: the official openai client over HTTPS,
pdserve.client over TLS gRPC, mutual TLS between the router and the workers (and KV between
the workers), and plaintext to a TLS port failing cleanly while the server stays up."""

from __future__ import annotations

import http.client
import ssl
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from grpc_plumbing.auth import TOKEN_KEY
from grpc_plumbing.tls import ClusterTls, TlsFiles
from pdserve.client import Client
from pdserve.cluster.local import ClusterSpec, LocalCluster
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from tests.cluster_utils import assert_all_blocks_free
from tests.conftest import tiny_llama_dir
from tests.tls_utils import make_certs

KEY = "sk-tls-test"
TOKEN = "tls-cluster-token"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tls")
    return {"api": make_certs(root / "api", "api"), "cluster": make_certs(root / "cluster", "c")}


@pytest.fixture(scope="module", params=["grpc", "flight"])
def cluster(request, tmp_path_factory, certs):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("tlsm"), num_heads=4, num_kv_heads=2, seed=3)
    api, clu = certs["api"], certs["cluster"]
    spec = ClusterSpec(
        model=str(path),
        num_blocks=128,
        max_model_len=128,
        http_port=0,
        api_key=KEY,
        cluster_token=TOKEN,
        kv_transport=request.param,
        api_tls=TlsFiles(api.cert, api.key),
        cluster_tls=ClusterTls(clu.cert, clu.key, clu.ca, server_name="pdserve-cluster"),
    )
    with LocalCluster(spec) as c:
        yield c
        assert_all_blocks_free(c)


def worker_stub(address: str, cert, role: str, with_client_cert: bool = True):
    def read(path):
        return Path(path).read_bytes() if with_client_cert or path == cert.ca else None

    creds = grpc.ssl_channel_credentials(read(cert.ca), read(cert.key), read(cert.cert))
    channel = grpc.secure_channel(address, creds)
    cls = pb_grpc.PrefillWorkerStub if role == "prefill" else pb_grpc.DecodeWorkerStub
    return channel, cls(channel)


def test_openai_client_over_https(cluster, certs):
    http_client = httpx.Client(verify=ssl.create_default_context(cafile=certs["api"].ca))
    client = openai.OpenAI(
        base_url=f"https://{cluster.http_address}/v1",
        api_key=KEY,
        http_client=http_client,
        max_retries=0,
    )
    with client:
        out = client.chat.completions.create(
            model=cluster.router.cfg.model_name,
            max_tokens=4,
            messages=[{"role": "user", "content": "w5 w6"}],
        )
    assert out.usage.completion_tokens >= 1  # through mutual-TLS workers and TLS KV


def test_pdserve_client_over_tls_grpc(cluster, certs):
    with Client(cluster.address, api_key=KEY, ca=certs["api"].ca) as client:
        out = client.generate(token_ids=[5, 6, 7], max_tokens=3, ignore_eos=True)
        assert len(out.token_ids) == 3 and client.health().ready


def test_plaintext_to_the_tls_ports_fails_cleanly_and_the_servers_stay_up(cluster, certs):
    with Client(cluster.address, api_key=KEY) as plain:  # no TLS
        with pytest.raises(grpc.RpcError) as e:
            plain.health()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    host, port = cluster.http_address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
        conn.request("GET", "/health")
        conn.getresponse().read()
    conn.close()
    with Client(cluster.address, api_key=KEY, ca=certs["api"].ca) as client:
        assert client.health().ready  # still serving


def test_a_client_with_the_wrong_ca_is_refused(cluster, certs):
    with Client(cluster.address, api_key=KEY, ca=certs["cluster"].ca) as client:
        with pytest.raises(grpc.RpcError) as e:
            client.health()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_workers_need_a_cluster_client_certificate(cluster, certs):
    clu = certs["cluster"]
    md = ((TOKEN_KEY, TOKEN),)
    workers = [(cluster.prefill_addresses[0], "prefill"), (cluster.decode_addresses[0], "decode")]
    for address, role in workers:
        channel, stub = worker_stub(address, clu, role, with_client_cert=False)
        with channel, pytest.raises(grpc.RpcError) as e:
            stub.Status(pb.StatusRequest(), metadata=md, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        plain = grpc.insecure_channel(address)
        with plain, pytest.raises(grpc.RpcError):
            cls = pb_grpc.PrefillWorkerStub if role == "prefill" else pb_grpc.DecodeWorkerStub
            cls(plain).Status(pb.StatusRequest(), metadata=md, timeout=10)
        channel, stub = worker_stub(address, clu, role)
        with channel:
            assert stub.Status(pb.StatusRequest(), metadata=md, timeout=10).num_total_blocks > 0


def test_blocks_free_after_the_tls_requests(cluster, certs):
    assert_all_blocks_free(cluster)


def test_tls_files_that_cannot_be_read_are_named(tmp_path):
    with pytest.raises(ValueError, match="(cert|key): cannot read"):
        TlsFiles(str(tmp_path / "nope.pem"), str(tmp_path / "nope.key")).server_credentials()


def test_worker_processes_serve_mutual_tls_from_their_flags(tmp_path_factory, certs):
    """python -m prefill_worker / decode_worker with --cluster-tls-*: the same cluster, as
    separate processes (what a launcher outside Ray runs)."""
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("tlsp"), num_heads=4, num_kv_heads=2, seed=4)
    clu = certs["cluster"]
    spec = ClusterSpec(
        model=str(path),
        num_blocks=64,
        max_model_len=64,
        cluster_token=TOKEN,
        separate_processes=True,
        cluster_tls=ClusterTls(clu.cert, clu.key, clu.ca),
    )
    with LocalCluster(spec) as c, Client(c.address) as client:
        out = client.generate(token_ids=[5, 6, 7], max_tokens=3, ignore_eos=True)
        assert len(out.token_ids) == 3
        plain = grpc.insecure_channel(c.decode_addresses[0])
        with plain, pytest.raises(grpc.RpcError):
            pb_grpc.DecodeWorkerStub(plain).Status(
                pb.StatusRequest(), metadata=((TOKEN_KEY, TOKEN),), timeout=10
            )
        assert_all_blocks_free(c)


def test_mutual_tls_on_the_client_api_needs_a_client_certificate(tmp_path_factory, certs):
    """With client_ca the router's gRPC and HTTPS ports take only clients holding a
    certificate signed by it (a router without workers is enough: Health answers)."""
    import asyncio

    from router.app import start_router
    from router.security import ApiSecurity
    from router.settings import RouterSettings

    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("mtls"), num_heads=4, num_kv_heads=2, seed=6)
    api, client_cert = certs["api"], certs["cluster"]  # clients hold a cluster-CA certificate
    security = ApiSecurity(TlsFiles(api.cert, api.key, client_ca=client_cert.ca))

    async def run():
        servers = await start_router(
            RouterSettings(model_dir=str(path)), [], [], "127.0.0.1", 0, 0, KEY, security=security
        )
        try:
            return await asyncio.to_thread(check, servers.grpc_address, servers.http_address)
        finally:
            await servers.stop()

    def check(grpc_address, http_address):
        mine = {"ca": api.ca, "client_cert": client_cert.cert, "client_key": client_cert.key}
        with Client(grpc_address, api_key=KEY, **mine) as client:
            assert not client.health().ready  # answered: no workers yet
        with Client(grpc_address, api_key=KEY, ca=api.ca) as client:
            with pytest.raises(grpc.RpcError) as e:
                client.health()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        ctx = ssl.create_default_context(cafile=api.ca)
        with pytest.raises((httpx.HTTPError, ssl.SSLError, OSError)):
            httpx.get(f"https://{http_address}/health", verify=ctx, timeout=10)
        ctx.load_cert_chain(client_cert.cert, client_cert.key)
        assert (
            httpx.get(f"https://{http_address}/health", verify=ctx, timeout=10).status_code == 503
        )

    asyncio.run(run())
