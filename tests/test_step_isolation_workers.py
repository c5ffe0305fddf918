"""The worker side of an engine error (issue 19; the A<->B contract on the coordination board):
a request that fails inside a step ends its own Decode stream with INTERNAL "engine error:
<cause>" while the others in its batch stream to their normal, exact end; a step that fails for
every request ends the streams with UNAVAILABLE "worker error: ..." (the router moves those).
Every block comes back, and the worker goes on serving."""

from __future__ import annotations

import threading

import grpc
import pytest

from decode_worker.server import serve_decode_worker
from decode_worker.worker import DecodeWorker
from engine.request import SamplingParams
from engine.scheduler import SchedulerOutput
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router.flow.types import lease_destination
from tests.conftest import tiny_llama_dir

BAD = "bad"
MAX_TOKENS = 8
ORDINARY = {
    "greedy-a": ([5, 9, 17, 33], {}),
    "seeded": ([40, 41, 42], {"temperature": 0.9, "top_p": 0.9, "seed": 3}),
    "greedy-b": ([7] * 9, {}),
    "penalized": ([100, 3, 64, 12, 90], {"temperature": 1.0, "seed": 11, "presence_penalty": 0.5}),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("isolation-workers"), seed=5)
    return path


@pytest.fixture(scope="module")
def reference(tiny):
    """The ordinary requests on the colocated engine, without the bad one."""
    from tests.conftest import EngineFactory

    factory = EngineFactory()
    engine = factory(tiny, num_blocks=64)
    for rid, (prompt, extra) in ORDINARY.items():
        engine.add_request(prompt, SamplingParams(MAX_TOKENS, ignore_eos=True, **extra), rid)
    while engine.has_unfinished():
        engine.step()
    factory.check_no_leaks()
    return {rid: engine.requests.pop(rid).output_token_ids for rid in ORDINARY}


@pytest.fixture
def decode_worker(tiny, make_engine):
    worker = DecodeWorker(make_engine(tiny, num_blocks=64))
    server, address, _ = serve_decode_worker(worker)  # warmed up: its own steps are done
    channel = grpc.insecure_channel(address)
    try:
        yield worker, pb_grpc.DecodeWorkerStub(channel)
    finally:
        channel.close()
        server.stop(grace=None)
        worker.stop()


def hold_until_all_queued(worker: DecodeWorker, n: int) -> None:
    """Plan nothing until ``n`` requests wait, so that they run as one batch."""
    schedule = worker.scheduler.schedule
    started = []

    def held():
        if not started and len(worker.scheduler.waiting) < n:
            return SchedulerOutput()
        started.append(True)
        return schedule()

    worker.scheduler.schedule = held


def decode_all(stub, requests: dict) -> dict:
    """Every request's Decode stream at once (no lease: prefilled on the worker, in one batch);
    returns {id: (tokens, finish reason) or the grpc.RpcError it ended with}."""
    results = {}

    def call(rid, prompt, extra):
        sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **extra)
        req = pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling)
        tokens, reason = [], None
        try:
            for chunk in stub.Decode(req, timeout=60):
                tokens += chunk.token_ids
                reason = chunk.finish_reason or reason
            results[rid] = (tokens, reason)
        except grpc.RpcError as e:
            results[rid] = e

    threads = [threading.Thread(target=call, args=(rid, *args)) for rid, args in requests.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return results


def assert_all_free(worker: DecodeWorker) -> None:
    status = worker.status()
    assert status["num_free_blocks"] == status["num_total_blocks"]
    assert status["num_running"] == status["num_waiting"] == 0 and not worker._streams


def test_a_request_failing_in_the_decode_workers_step_ends_its_stream_internal(
    decode_worker, reference
):
    worker, stub = decode_worker
    original = worker.engine.sampler._apply_min_tokens

    def processor(logits, requests):  # a per-request failure at the bad one's 3rd token
        if any(r.request_id == BAD and len(r.output_token_ids) == 2 for r in requests):
            raise IndexError("index 4096 is out of bounds for dimension 1 with size 128")
        return original(logits, requests)

    worker.engine.sampler._apply_min_tokens = processor
    hold_until_all_queued(worker, len(ORDINARY) + 1)
    results = decode_all(stub, {**ORDINARY, BAD: ([20, 21, 22, 23], {})})
    error = results.pop(BAD)
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.INTERNAL
    assert error.details().startswith("engine error: IndexError: index 4096")
    assert results == {rid: (reference[rid], "length") for rid in ORDINARY}
    assert worker.step_loop.num_request_errors == 1
    assert_all_free(worker)
    # the worker goes on serving
    again = decode_all(stub, {"greedy-a": ORDINARY["greedy-a"]})
    assert again == {"greedy-a": (reference["greedy-a"], "length")}
    assert_all_free(worker)


def test_a_step_failing_for_everyone_ends_the_streams_unavailable(decode_worker, reference):
    worker, stub = decode_worker
    forward = worker.engine.runner.execute
    broken = threading.Event()

    def execute(batch, after_layer=None):
        if broken.is_set():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if all(len(s.request.output_token_ids) == 2 for s in batch):
            broken.set()  # from the third token on, every forward fails
        return forward(batch, after_layer)

    worker.engine.runner.execute = execute
    hold_until_all_queued(worker, len(ORDINARY))
    results = decode_all(stub, ORDINARY)
    for rid in ORDINARY:
        error = results[rid]
        assert isinstance(error, grpc.RpcError), rid
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert error.details().startswith("worker error: RuntimeError: CUDA error")
    assert worker.step_loop.num_worker_errors == 1
    assert_all_free(worker)
    worker.engine.runner.execute = forward
    again = decode_all(stub, {"seeded": ORDINARY["seeded"]})
    assert again == {"seeded": (reference["seeded"], "length")}
    assert_all_free(worker)


def _prefill_directly(cluster, request_id: str, prompt: list[int]) -> grpc.RpcError | None:
    """A Prefill sent straight to the prefill worker toward a real lease on the decode worker
    (which is released after); returns the error it ended with, None if it finished."""
    decode = pb_grpc.DecodeWorkerStub(grpc.insecure_channel(cluster.decode_addresses[0]))
    prefill = pb_grpc.PrefillWorkerStub(grpc.insecure_channel(cluster.prefill_addresses[0]))
    lease = decode.Reserve(pb.ReserveRequest(request_id=request_id, num_tokens=16))
    dest = lease_destination(lease)
    req = pb.PrefillRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=MAX_TOKENS),
        destination=dest,
    )
    try:
        list(prefill.Prefill(req, timeout=30))
    except grpc.RpcError as e:
        return e
    finally:
        decode.Release(pb.ReleaseRequest(lease_id=lease.lease_id))
    return None


def _fail_the_bad_prefill(worker, where: str) -> list[list[str]]:
    """Make ``worker`` raise for BAD in its sampling, or in a forward that ran every layer (and
    sent each to the decode worker) first; returns the batches of the forwards that raised."""
    failed: list[list[str]] = []
    cause = "index 4096 is out of bounds for dimension 1 with size 128"
    if where == "sampler":
        original = worker.engine.sampler._apply_min_tokens

        def processor(logits, requests):
            if any(r.request_id == BAD for r in requests):
                failed.append([r.request_id for r in requests])
                raise IndexError(cause)
            return original(logits, requests)

        worker.engine.sampler._apply_min_tokens = processor
        return failed
    forward = worker.engine.runner.execute

    def execute(batch, after_layer=None):
        logits = forward(batch, after_layer)
        if any(s.request.request_id == BAD for s in batch):
            failed.append([s.request.request_id for s in batch])
            raise IndexError(cause)
        return logits

    worker.engine.runner.execute = execute
    return failed


@pytest.mark.parametrize("where", ["sampler", "forward"])
def test_a_request_failing_in_the_prefill_workers_step_ends_its_call_internal(
    tiny, reference, where
):
    """The prefill worker's side: the bad prefill's call ends INTERNAL "engine error:", while
    ordinary prompts through the router, prefilled in the same batch, finish exactly: after a
    failed forward their KV is computed and sent again, and the decode worker takes it."""
    import asyncio

    from pdserve.client import AsyncClient
    from pdserve.cluster.local import ClusterSpec, LocalCluster
    from tests.cluster_utils import assert_all_blocks_free

    spec = ClusterSpec(
        model=str(tiny), num_blocks=128, max_model_len=64, local_prefill_max_tokens=0
    )
    with LocalCluster(spec) as cluster:
        worker = cluster.prefill_workers[0]
        failed = _fail_the_bad_prefill(worker, where)
        hold_until_all_queued(worker, len(ORDINARY) + 1)

        async def run():
            client = AsyncClient(cluster.address)
            ordinary = [
                client.generate(token_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True, **extra)
                for p, extra in ORDINARY.values()
            ]
            bad = asyncio.to_thread(_prefill_directly, cluster, BAD, [20, 21, 22, 23])
            try:
                return await asyncio.gather(bad, *ordinary)
            finally:
                await client.close()

        error, *outs = asyncio.run(run())
        assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.INTERNAL
        assert error.details().startswith("engine error: IndexError: index 4096")
        assert len(failed[0]) == len(ORDINARY) + 1  # the bad one failed the whole batch first
        assert [o.finish_reason for o in outs] == ["length"] * len(ORDINARY)
        assert [o.token_ids for o in outs] == [reference[rid] for rid in ORDINARY]
        assert worker.step_loop.num_request_errors == 1
        assert_all_blocks_free(cluster)


def test_a_failing_sequence_of_an_n_request_ends_its_whole_call(decode_worker, reference):
    """One Decode call carries all n sequences: one failing ends the call INTERNAL, and its
    sibling sequences finish too, their shared KV blocks coming back once each."""
    worker, stub = decode_worker
    original = worker.engine.sampler._apply_min_tokens

    def processor(logits, requests):
        if any(r.request_id == "multi#n1" and len(r.output_token_ids) == 2 for r in requests):
            raise IndexError("a broken logits processor")
        return original(logits, requests)

    worker.engine.sampler._apply_min_tokens = processor
    hold_until_all_queued(worker, 2)
    multi = ([40, 41, 42] * 7, {"n": 3, "temperature": 1.0, "seed": 5})  # shares full blocks
    results = decode_all(stub, {"multi": multi, "greedy-a": ORDINARY["greedy-a"]})
    error = results["multi"]
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.INTERNAL
    assert error.details() == "engine error: IndexError: a broken logits processor"
    assert results["greedy-a"] == (reference["greedy-a"], "length")
    assert_all_free(worker)
