"""OpenTelemetry tracing (--otlp-traces-endpoint): one trace per request across the router and
both workers (worker processes, 1P2D), exported to a test OTLP receiver on 127.0.0.1; a migrated
request shows both attempts; an HTTP client's traceparent is honoured; without the extra the
product imports and runs."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys

import httpx
import pytest

from pdserve.client import AsyncClient, Client
from pdserve.cluster.local import ClusterSpec, LocalCluster
from tests.cluster_utils import assert_all_blocks_free
from tests.conftest import tiny_llama_dir

# Spans leave each process within 0.1 s (the batch processor's default is 5 s).
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
PROMPT = list(range(3, 43))  # 40 tokens: 3 chunks of prefill_chunk_size 16
SERVICES = {"pdserve-router", "pdserve-prefill", "pdserve-decode"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("tracing"), num_kv_heads=2, seed=7)
    return path


@pytest.fixture(scope="module")
def receiver():
    for module in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.grpc"):
        pytest.importorskip(module, reason="needs pip install 'pdserve[tracing]'")
    from tests.otlp_receiver import OtlpReceiver  # opentelemetry-proto's collector service

    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def fast_export():
    """The router runs in this process: its batch processor reads the variable at start."""
    old = {k: os.environ.get(k) for k in FAST_EXPORT}
    os.environ.update(FAST_EXPORT)
    yield
    for k, v in old.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _spec(model, receiver, num_decode: int) -> ClusterSpec:
    return ClusterSpec(
        model=str(model),
        separate_processes=True,
        threads_per_worker=1,
        num_decode=num_decode,
        num_blocks=256,
        max_model_len=512,
        prefill_chunk_size=16,
        http_port=0,
        otlp_traces_endpoint=receiver.endpoint,
        extra_env=FAST_EXPORT,
    )


@pytest.fixture(scope="module")
def traced_cluster(tiny_model, receiver, fast_export):
    """1P2D worker processes (two decode workers: one may be lost, see the migration test,
    which runs last); each test checks its own blocks."""
    with LocalCluster(_spec(tiny_model, receiver, num_decode=2)) as cluster:
        yield cluster


def _root(spans, request_id: str):
    roots = [
        s
        for s in spans
        if s.name == "llm_request" and s.attributes.get("gen_ai.request.id") == request_id
    ]
    return roots[0] if roots else None


WORKER_SPANS = (("pdserve-prefill", "prefill"), ("pdserve-decode", "decode"))


def _complete_trace(receiver, request_id: str, *wanted: tuple[str, str]):
    """The request's trace once its root and the ``wanted`` (service, name) spans are in (a
    worker's call span ends after its children, the router's request span after the rest)."""

    def ready(spans) -> bool:
        root = _root(spans, request_id)
        have = {(s.service, s.name) for s in spans if root and s.trace_id == root.trace_id}
        return root is not None and set(wanted) <= have

    root = _root(receiver.wait_for(ready), request_id)
    return root, receiver.trace(root.trace_id)


def _one(spans, service: str, name: str):
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, f"{service} {name}: {len(found)} spans"
    return found[0]


def test_one_request_is_one_trace_across_router_and_both_workers(traced_cluster, receiver):
    out = Client(traced_cluster.address).generate(
        token_ids=PROMPT, max_tokens=12, ignore_eos=True, request_id="traced-one"
    )
    assert len(out.token_ids) == 12
    root, spans = _complete_trace(receiver, "traced-one", *WORKER_SPANS)
    assert {s.service for s in spans} == SERVICES  # router, prefill worker, decode worker
    by_id = {s.span_id: s for s in spans}
    assert root.parent_id == "" and root.service == "pdserve-router"
    for s in spans:  # nested: every span but the root hangs off another span of this trace
        assert s is root or s.parent_id in by_id, f"{s.service} {s.name} has no parent here"
    router = [s for s in spans if s.service == "pdserve-router"]
    attempt = _one(router, "pdserve-router", "attempt")
    assert attempt.parent_id == root.span_id
    assert attempt.attributes["pdserve.attempt.outcome"] == "finished"
    assert _one(router, "pdserve-router", "admission").parent_id == root.span_id
    for name in ("reserve", "prefill", "decode"):
        assert _one(router, "pdserve-router", name).parent_id == attempt.span_id
    # The workers' spans are children of the router's calls (traceparent over gRPC).
    prefill = _one(spans, "pdserve-prefill", "prefill")
    assert prefill.parent_id == _one(router, "pdserve-router", "prefill").span_id
    decode = _one(spans, "pdserve-decode", "decode")
    assert decode.parent_id == _one(router, "pdserve-router", "decode").span_id
    chunks = [s for s in spans if s.name == "prefill.chunk"]
    assert len(chunks) == 3 and all(s.parent_id == prefill.span_id for s in chunks)
    assert sorted(s.attributes["pdserve.chunk.tokens"] for s in chunks) == [8, 16, 16]
    transfer = _one(spans, "pdserve-prefill", "kv_transfer")
    assert transfer.parent_id == prefill.span_id
    assert transfer.attributes["pdserve.kv.bytes"] > 0
    assert transfer.attributes["pdserve.kv.transport"] == "grpc"
    for name in ("decode.queue", "decode.run", "decode.kv_wait"):
        assert _one(spans, "pdserve-decode", name).parent_id == decode.span_id
    assert root.attributes["gen_ai.usage.completion_tokens"] == 12
    assert root.attributes["pdserve.kv.bytes"] == transfer.attributes["pdserve.kv.bytes"]
    assert not any(s.error for s in spans)
    assert_all_blocks_free(traced_cluster)


def test_an_http_traceparent_is_the_request_spans_parent(traced_cluster, receiver):
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    body = {"prompt": PROMPT, "max_tokens": 4}
    headers = {"traceparent": f"00-{trace_id}-{parent_id}-01"}
    url = f"http://{traced_cluster.http_address}/v1/completions"
    assert httpx.post(url, json=body, headers=headers, timeout=60).status_code == 200

    def ready(spans) -> bool:  # the workers' spans and the router's request span, which
        have = {(s.service, s.name) for s in spans if s.trace_id == trace_id}  # ends last
        return {*WORKER_SPANS, ("pdserve-router", "llm_request")} <= have

    receiver.wait_for(ready)
    spans = receiver.trace(trace_id)
    root = _one(spans, "pdserve-router", "llm_request")
    assert root.parent_id == parent_id  # the client's span is the request span's parent
    assert {s.service for s in spans} == SERVICES
    assert_all_blocks_free(traced_cluster)


def test_a_worker_makes_no_span_for_an_untraced_caller(traced_cluster, receiver):
    """A Decode straight to a traced decode worker without a traceparent (a router tracing
    nothing) makes no stray trace; the worker exports in order, so once a later traced
    request's decode spans are in, the untraced call's would be too."""
    from protos import pdserve_pb2 as pb
    from protos import pdserve_pb2_grpc as pb_grpc
    from tests.cluster_utils import _worker_channel

    address = traced_cluster.decode_addresses[0]
    with _worker_channel(traced_cluster, address) as channel:
        request = pb.DecodeRequest(
            request_id="untraced-direct",
            prompt_token_ids=PROMPT,
            sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True),
        )
        chunks = list(pb_grpc.DecodeWorkerStub(channel).Decode(request, timeout=60))
    assert sum(len(c.token_ids) for c in chunks) == 4
    workers = []
    while address not in workers:  # a traced request decoded on the same worker, later
        assert len(workers) < 8, f"no request routed to {address} in 8: {workers}"
        request_id = f"traced-after-{len(workers)}"
        Client(traced_cluster.address).generate(
            token_ids=PROMPT, max_tokens=2, request_id=request_id
        )
        _, spans = _complete_trace(receiver, request_id, WORKER_SPANS[1])
        workers.append(_one(spans, "pdserve-router", "attempt").attributes["pdserve.decode.worker"])
    ids = {s.attributes.get("gen_ai.request.id") for s in receiver.spans}
    assert "untraced-direct" not in ids
    assert_all_blocks_free(traced_cluster)


def test_a_migrated_request_shows_both_attempts(traced_cluster, receiver):
    cluster = traced_cluster  # its last test: one of its decode workers is killed here
    router = cluster.servers.router
    killed: list[str] = []

    def kill_its_decode_worker() -> None:
        for i, address in enumerate(cluster.decode_addresses):
            if router.inflight_on("decode", address):
                cluster._procs[cluster.spec.num_prefill + i].send_signal(signal.SIGKILL)
                killed.append(address)
                return

    async def stream() -> list[int]:
        client, out = AsyncClient(cluster.address), []
        try:
            kw = {"token_ids": PROMPT, "max_tokens": 200, "ignore_eos": True}
            async for chunk in client.stream(request_id="traced-migrated", **kw):
                out.extend(chunk.token_ids)
                if len(out) >= 4 and not killed:
                    kill_its_decode_worker()
        finally:
            await client.close()
        return out

    out = asyncio.run(stream())
    assert killed and len(out) == 200  # one unbroken stream despite the kill
    root, spans = _complete_trace(receiver, "traced-migrated", WORKER_SPANS[1])
    attempts = sorted(
        (s for s in spans if s.name == "attempt"),
        key=lambda s: s.attributes["pdserve.attempt.number"],
    )
    assert [s.parent_id for s in attempts] == [root.span_id] * 2  # siblings
    first, second = attempts
    assert first.attributes["pdserve.decode.worker"] == killed[0]
    assert first.attributes["pdserve.attempt.outcome"] in ("worker lost", "hung")
    assert first.error and not second.error
    assert second.attributes["pdserve.attempt.outcome"] == "finished"
    assert second.attributes["pdserve.decode.worker"] != killed[0]
    assert root.attributes["pdserve.migrations"] == 1
    # The survivor's decode span hangs under the second attempt's decode call.
    decode = _one(spans, "pdserve-decode", "decode")
    call = next(s for s in spans if s.span_id == decode.parent_id)
    assert call.parent_id == second.span_id
    assert_all_blocks_free(cluster, dead=set(killed))


def test_tracing_flags_reach_every_process(tiny_model):
    pytest.importorskip("opentelemetry.sdk", reason="the config refuses an endpoint without it")
    from pdserve.config import validate_config
    from pdserve.serve_args import add_serve_arguments, apply_serve_args
    from pdserve.settings import settings_from_config

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--otlp-traces-endpoint", "http://10.0.0.9:4317"])
    cfg = apply_serve_args(validate_config({"model": str(tiny_model)}), args)
    s = settings_from_config(cfg, "127.0.0.1")
    assert s.router.otlp_traces_endpoint == "http://10.0.0.9:4317"
    assert s.prefill.server.otlp_traces_endpoint == "http://10.0.0.9:4317"
    assert s.decode.server.otlp_traces_endpoint == "http://10.0.0.9:4317"
    from pdserve.cluster.workers import worker_args
    from prefill_worker.launch import prefill_parser, prefill_settings_from_args

    back = prefill_settings_from_args(
        prefill_parser().parse_args(worker_args("prefill", s.prefill))
    )
    assert back.server.otlp_traces_endpoint == "http://10.0.0.9:4317"
    assert validate_config({}).otlp_traces_endpoint is None  # off by default


# Run with the extra's modules unimportable, as on an install without it (opentelemetry-api
# stays: FastAPI itself requires it).
WITHOUT_OTEL = """
import sys
EXTRA = ("opentelemetry.sdk", "opentelemetry.exporter")
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.startswith(EXTRA):
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Block())
import router.app, router.core, router.http.routes, pdserve.cli, pdserve.serve_args
import prefill_worker.server, decode_worker.server
from grpc_plumbing.tracing import TracingUnavailable, start_tracing
from pdserve.config import ConfigError, validate_config
assert start_tracing(None, "x") is None
try:
    start_tracing("127.0.0.1:4317", "x")
except TracingUnavailable as e:
    assert "pdserve[tracing]" in str(e), e
else:
    raise AssertionError("started without OpenTelemetry")
try:
    validate_config({"otlp_traces_endpoint": "127.0.0.1:4317"})
except ConfigError as e:
    assert "otlp_traces_endpoint" in str(e) and "pdserve[tracing]" in str(e), e
else:
    raise AssertionError("the config took an endpoint without OpenTelemetry")
assert not any(m.startswith(EXTRA) for m in sys.modules)
print("OK")
"""


def test_without_the_extra_the_product_imports_and_an_endpoint_is_refused():
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_OTEL],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stderr[-2000:]
