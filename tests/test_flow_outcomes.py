"""How each attempt of a request ends decides what the router does next
(router/flow/lifecycle.py): an engine error of the request is an error to its client (gRPC INTERNAL, HTTP 500, an SSE
error event), never retried and never a finish "abort"; a transport fault, a lost worker, a
preemption or a broken transfer go around again with exact greedy output; a lease the decode
worker lost before the attach goes around again instead of a 503. On every path the router's
load counters on the workers come back to zero and every KV block comes back."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import msgpack
import pytest

from engine.errors import InvalidRequestError
from kv_transfer.errors import FrameError
from pdserve.client import AsyncClient
from pdserve.cluster.local import ClusterSpec, LocalCluster
from router.flow.types import AttemptOutcome, ended_by
from router.pool import WorkerHandle
from tests.cluster_utils import assert_all_blocks_free
from tests.conftest import tiny_llama_dir
from tests.flow_faults import ENGINE_ERROR, TRANSPORT_INTERNAL, Script, WorkerFaults
from tests.http_utils import open_stream, post, sse_events
from tests.test_disagg import engine_reference, mixed_prompts

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("outcomes"), num_kv_heads=2, seed=13)
    return path


@pytest.fixture(scope="module")
def faults():
    with pytest.MonkeyPatch.context() as mp:
        f = WorkerFaults()
        f.install(mp)  # before any cluster of this module starts
        yield f


def _spec(tiny_model, **kw) -> ClusterSpec:
    return ClusterSpec(model=str(tiny_model), num_blocks=256, max_model_len=256, **kw)


@pytest.fixture(scope="module")
def cluster(tiny_model, faults):
    with LocalCluster(_spec(tiny_model, http_port=0)) as c:
        yield c


@pytest.fixture(scope="module")
def prompts(tiny_model):
    prompts = [p[:30] for p in mixed_prompts(3, seed=41)]
    return prompts, engine_reference(tiny_model, prompts, new_tokens=NEW_TOKENS)


async def _stream(address, request_id, prompt, max_tokens=NEW_TOKENS, leave_after=None):
    """(tokens, finish reason, AioRpcError or None); ``leave_after``: hang up after that many
    tokens."""
    client = AsyncClient(address)
    tokens, reason = [], ""
    kw = {"token_ids": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    try:
        async for chunk in client.stream(request_id=request_id, **kw):
            tokens += chunk.token_ids
            reason = chunk.finish_reason or reason
            if leave_after is not None and len(tokens) >= leave_after:
                break
    except grpc.aio.AioRpcError as e:
        return tokens, reason, e
    finally:
        await client.close()
    return tokens, reason, None


def _run(cluster, *requests):
    async def all_of():
        return await asyncio.gather(*(_stream(cluster.address, *r) for r in requests))

    return asyncio.run(all_of())


def _handles(cluster) -> list[WorkerHandle]:
    router = cluster.router
    return [*router.prefill.workers.values(), *router.decode.workers.values()]


def assert_no_load_left(cluster, timeout: float = 5.0) -> None:
    """Every worker's in-flight counters at the router are back to zero (an attempt's cleanup
    may end just after its client's stream)."""
    deadline = time.monotonic() + timeout
    while True:
        left = [(w.address, w.inflight_requests, w.inflight_tokens) for w in _handles(cluster)]
        if all(n == 0 and t == 0 for _, n, t in left):
            return
        assert time.monotonic() < deadline, f"load left on workers: {left}"
        time.sleep(0.02)


def _migrations(cluster) -> float:
    return cluster.router.metrics.migrations._value.get()


def _of(calls: list[str], request_id: str) -> list[str]:
    return [c for c in calls if c.split("#")[0] == request_id]


def test_an_engine_error_mid_decode_fails_only_its_request_with_internal(cluster, faults, prompts):
    prompts, reference = prompts
    faults.reset(Script(matches=lambda rid: rid.startswith("bad"), decode="engine_error"))
    bad, ok1, ok2 = _run(cluster, ("bad", prompts[0]), ("ok-1", prompts[1]), ("ok-2", prompts[2]))
    tokens, reason, error = bad
    assert error is not None and error.code() == grpc.StatusCode.INTERNAL
    assert error.details() == ENGINE_ERROR and reason != "abort"
    assert 1 <= len(tokens) < NEW_TOKENS and tokens == reference[0][: len(tokens)]
    assert _of(faults.decode_calls, "bad") == ["bad"]  # not retried, not migrated
    assert [ok1[:2], ok2[:2]] == [(reference[1], "length"), (reference[2], "length")]
    assert_no_load_left(cluster)
    assert_all_blocks_free(cluster)


def test_an_engine_error_in_prefill_fails_its_request_with_internal(cluster, faults, prompts):
    prompts, reference = prompts
    faults.reset(Script(matches=lambda rid: rid == "bad-prefill", prefill_engine_error=True))
    (tokens, _, error), ok = _run(cluster, ("bad-prefill", prompts[0]), ("ok", prompts[1]))
    assert error is not None and error.code() == grpc.StatusCode.INTERNAL
    assert error.details() == ENGINE_ERROR and tokens == []
    assert _of(faults.prefill_calls, "bad-prefill") == ["bad-prefill"]
    assert _of(faults.decode_calls, "bad-prefill") == []
    assert ok[:2] == (reference[1], "length")
    assert_no_load_left(cluster)
    assert_all_blocks_free(cluster)


def test_a_transport_internal_mid_decode_migrates_with_exact_output(cluster, faults, prompts):
    """grpc's own INTERNAL (a stream reset) is not the engine's: the request goes on."""
    prompts, reference = prompts
    faults.reset(Script(matches=lambda rid: rid.startswith("reset"), decode="transport_internal"))
    before = _migrations(cluster)
    ((tokens, reason, error),) = _run(cluster, ("reset", prompts[0]))
    assert error is None and (tokens, reason) == (reference[0], "length")
    assert faults.fired == ["decode"] and _of(faults.decode_calls, "reset") == ["reset", "reset#1"]
    assert _migrations(cluster) == before + 1
    assert_no_load_left(cluster)
    assert_all_blocks_free(cluster)


def test_an_engine_error_over_http_is_a_500_error_body_or_an_sse_error_event(
    cluster, faults, prompts
):
    prompts, _ = prompts
    body = {"prompt": prompts[0], "max_tokens": NEW_TOKENS, "ignore_eos": True}
    faults.reset(Script(matches=lambda rid: True, decode="engine_error"))
    status, answer = post(cluster.http_address, "/v1/completions", body)
    assert status == 500, answer
    error = answer["error"]
    assert (error["type"], error["code"], error["message"]) == (
        "internal_error",
        "engine_error",
        ENGINE_ERROR,
    )

    faults.reset(Script(matches=lambda rid: True, decode="engine_error"))
    conn, resp = open_stream(cluster.http_address, "/v1/completions", {**body, "stream": True})
    try:
        assert resp.status == 200  # the stream had begun: the error comes as its last event
        events = [json.loads(e) for e in sse_events(resp)]
    finally:
        conn.close()
    assert events[-1]["error"]["message"] == ENGINE_ERROR
    assert events[-1]["error"]["type"] == "internal_error"
    reasons = [c.get("finish_reason") for e in events[:-1] for c in e["choices"]]
    assert reasons and set(reasons) == {None}  # tokens went out, and no "abort" finish
    assert_no_load_left(cluster)
    assert_all_blocks_free(cluster)


def test_attempt_outcome_of_a_worker_status():
    """The classification the retry loop decides on, status by status."""
    w = WorkerHandle("127.0.0.1:1", "decode", None, None)

    def rpc_error(code, details):
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)

    internal = grpc.StatusCode.INTERNAL
    assert ended_by(w, rpc_error(internal, ENGINE_ERROR)).outcome is AttemptOutcome.FAILED
    lost = ended_by(w, rpc_error(internal, TRANSPORT_INTERNAL), on_lease=True)
    assert lost.outcome is AttemptOutcome.WORKER_LOST
    for code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED):
        gone = ended_by(w, rpc_error(code, "lease expired"), on_lease=True)
        assert gone.outcome is AttemptOutcome.LEASE_EXPIRED
    # A Decode on a lease refused by the worker's stream budget: reserve again (and answer 429
    # once no worker takes it), never a 503.
    full = ended_by(w, rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "streams"), on_lease=True)
    assert full.outcome is AttemptOutcome.LEASE_REFUSED
    # Without a lease NOT_FOUND is the request's own: raised as is. So is a bad argument, as
    # the request's InvalidRequestError (a 400 naming the parameter the worker named).
    with pytest.raises(grpc.aio.AioRpcError):
        ended_by(w, rpc_error(grpc.StatusCode.NOT_FOUND, "no"))
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    for details, param, reason in (
        ("guided_regex: does not compile: x", "guided_regex", "does not compile: x"),
        ("no such thing", "request", "no such thing"),
        ("a b: c", "request", "a b: c"),
    ):
        with pytest.raises(InvalidRequestError) as err:
            ended_by(w, rpc_error(invalid, details))
        assert (err.value.param, err.value.reason) == (param, reason)


def _reject_the_next_commit(cluster) -> threading.Event:
    """The decode worker refuses the next commit frame (its transfer fails after the first
    token); returns an event set once it did."""
    receiver = cluster.decode_workers[0].receiver
    accept, rejected = receiver.accept, threading.Event()

    def reject_commit(header, payload):
        if not rejected.is_set() and msgpack.unpackb(bytes(header)).get("kind") == "commit":
            rejected.set()
            receiver.accept = accept
            raise FrameError("injected: the commit was lost")
        return accept(header, payload)

    receiver.accept = reject_commit
    return rejected


PATHS = ["finish", "preempted", "worker_lost", "transfer_failed", "engine_error", "client_cancel"]


@pytest.mark.parametrize("path", PATHS)
def test_each_path_gives_the_load_counters_back(cluster, faults, prompts, path):
    prompts, reference = prompts
    rid = f"load-{path}"
    decode = path if path in ("preempted", "worker_lost", "engine_error") else None
    faults.reset(Script(matches=lambda r: r.startswith(rid), decode=decode))
    rejected = _reject_the_next_commit(cluster) if path == "transfer_failed" else None
    served = [w.served_requests for w in _handles(cluster)]
    max_tokens, leave_after = (200, 3) if path == "client_cancel" else (NEW_TOKENS, None)
    ((tokens, reason, error),) = _run(cluster, (rid, prompts[0], max_tokens, leave_after))
    if path == "engine_error":
        assert error is not None and error.code() == grpc.StatusCode.INTERNAL
    elif path == "client_cancel":
        assert error is None and tokens[:3] == reference[0][:3] and reason == ""
    else:
        assert error is None and (tokens, reason) == (reference[0], "length")
    assert faults.fired == (["decode"] if decode else [])
    assert rejected is None or rejected.is_set()
    assert [w.served_requests for w in _handles(cluster)] != served  # the counters moved
    assert_no_load_left(cluster)
    assert_all_blocks_free(cluster)


def test_a_lease_expired_before_the_attach_goes_around_again(tiny_model, faults):
    """The decode worker's lease lives 1 s; the Decode call reaches it 2 s after the prefill:
    the lease is gone (NOT_FOUND), and the request is reserved and prefilled again instead of
    failing with 503. No worker is blamed (not a migration)."""
    (prompt,) = [p[:30] for p in mixed_prompts(1, seed=42)]
    (reference,) = engine_reference(tiny_model, [prompt], new_tokens=NEW_TOKENS)
    faults.reset(Script(matches=lambda rid: rid == "late", decode_delay_s=2.0))
    with LocalCluster(_spec(tiny_model, lease_ttl_s=1.0)) as cluster:
        ((tokens, reason, error),) = _run(cluster, ("late", prompt))
        assert error is None and (tokens, reason) == (reference, "length")
        assert faults.fired == ["decode_delay"]
        assert _of(faults.decode_calls, "late") == ["late", "late#1"]
        assert _of(faults.prefill_calls, "late") == ["late", "late#1"]  # prefilled again
        assert _migrations(cluster) == 0
        assert all(w.consecutive_failures == 0 for w in _handles(cluster))
        assert_no_load_left(cluster)
        assert_all_blocks_free(cluster)


def test_the_scripted_fault_lands_mid_decode_however_the_tokens_were_chunked():
    """A slow consumer gets tokens coalesced: a first chunk that already holds every token and
    the finish is cut to the tokens before the fault, without the finish (else the request
    would end normally and the fault never be mid-decode)."""
    from protos import pdserve_pb2 as pb
    from tests.flow_faults import _first_tokens

    whole = pb.TokenChunk(token_ids=[5, 6, 7, 8], finish_reason="length")
    cut = _first_tokens(whole, 2)
    assert list(cut.token_ids) == [5, 6] and cut.finish_reason == ""
    assert _first_tokens(pb.TokenChunk(token_ids=[5]), 2) == pb.TokenChunk(token_ids=[5])
    short = pb.TokenChunk(token_ids=[5], finish_reason="stop")  # ended before the fault: kept
    assert _first_tokens(short, 2) == short
