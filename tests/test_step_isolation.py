"""A request that fails inside a step fails alone (issue 19): its sampling, its output
bookkeeping, or a forward that fails whenever it is in the batch (found by re-running halves
of the batch). It ends FINISHED_ERROR with the cause; the others in its batch get exactly the
output of a run without it (greedy, seeded sampling, penalties, logprobs); every block comes
back; the engine goes on serving. A step that fails for every request alone is the worker's
failure ("worker error: ...")."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest

from engine.request import RequestStatus, SamplingParams
from tests.conftest import tiny_llama_dir

BAD = "bad"
FAIL_AT = 2  # the bad request fails when it has this many output tokens
ORDINARY = [
    ("greedy", [5, 9, 17, 33], SamplingParams(max_tokens=8, ignore_eos=True)),
    (
        "seeded",
        [40, 41, 42],
        SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.9, top_p=0.9, seed=3),
    ),
    (
        "logprobs",
        [7] * 9,
        SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3, repetition_penalty=1.3),
    ),
    (
        "penalized",
        [100, 3, 64, 12, 90],
        SamplingParams(
            max_tokens=8, ignore_eos=True, temperature=1.0, top_k=20, seed=11, presence_penalty=0.5
        ),
    ),
]
BAD_REQUEST = (BAD, [20, 21, 22, 23, 24, 25], SamplingParams(max_tokens=8, ignore_eos=True))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("step-isolation"), seed=5)
    return path


def run_requests(engine, requests):
    """Add ``requests`` (id, prompt, sampling) together and step until all finish; returns
    ({id: Request}, {id: [RequestOutput]})."""
    for rid, prompt, sampling in requests:
        engine.add_request(prompt, sampling, rid)
    outputs = defaultdict(list)
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return {rid: engine.requests.pop(rid) for rid, _, _ in requests}, outputs


@pytest.fixture(scope="module")
def reference(tiny):
    """The ordinary requests run without the bad one."""
    from tests.conftest import EngineFactory

    factory = EngineFactory()
    reqs, _ = run_requests(factory(tiny), ORDINARY)
    factory.check_no_leaks()
    return {rid: (r.output_token_ids, r.output_logprobs) for rid, r in reqs.items()}


def assert_ordinary_exact(reqs, outputs, reference) -> None:
    for rid, _, _ in ORDINARY:
        assert (reqs[rid].output_token_ids, reqs[rid].output_logprobs) == reference[rid], rid
        assert reqs[rid].status is RequestStatus.FINISHED_LENGTH
        assert [o.finish_reason for o in outputs[rid]][-1] == "length"
        assert all(o.error is None for o in outputs[rid])


def assert_failed_alone(reqs, outputs, prefix: str, cause: str) -> None:
    bad = reqs[BAD]
    assert bad.status is RequestStatus.FINISHED_ERROR and bad.block_table == []
    assert bad.error.startswith(prefix) and cause in bad.error
    last = outputs[BAD][-1]
    assert last.finished and last.finish_reason == "error" and last.error == bad.error
    assert last.new_token_ids == []  # the failed step gave it no token


def assert_serves_again(engine, reference) -> None:
    rid, prompt, sampling = ORDINARY[1]
    reqs, _ = run_requests(engine, [(rid, prompt, sampling)])
    assert (reqs[rid].output_token_ids, reqs[rid].output_logprobs) == reference[rid]


def fail_bad_at(name: str):
    """An exception for the bad request, raised by ``check(request)`` at its FAIL_AT-th token."""

    def check(req) -> None:
        if req.request_id == BAD and len(req.output_token_ids) == FAIL_AT:
            raise IndexError(f"{name} broke on the bad request")

    return check


def test_a_request_whose_sampling_raises_fails_alone(tiny, make_engine, reference):
    engine = make_engine(tiny)
    original = engine.sampler._apply_min_tokens
    check = fail_bad_at("a logits processor")

    def processor(logits, requests):  # raises for the bad row, in the batch and alone
        for r in requests:
            check(r)
        return original(logits, requests)

    engine.sampler._apply_min_tokens = processor
    reqs, outputs = run_requests(engine, [*ORDINARY[:2], BAD_REQUEST, *ORDINARY[2:]])
    assert_failed_alone(reqs, outputs, "engine error: IndexError", "a logits processor broke")
    assert len(reqs[BAD].output_token_ids) == FAIL_AT
    assert_ordinary_exact(reqs, outputs, reference)
    assert engine.step_loop.num_request_errors == 1
    assert_serves_again(engine, reference)


def test_a_request_whose_output_bookkeeping_raises_fails_alone(tiny, make_engine, reference):
    """Detokenizing / stop strings run per request after the update: a failure there is the
    request's own too (it had its token; its blocks are freed once)."""
    engine = make_engine(tiny)
    original = engine._apply_stop_strings
    check = fail_bad_at("detokenizing")

    def stop_strings(req, delta):
        check(req)
        return original(req, delta)

    engine._apply_stop_strings = stop_strings
    reqs, outputs = run_requests(engine, [BAD_REQUEST, *ORDINARY])
    assert_failed_alone(reqs, outputs, "engine error: IndexError", "detokenizing broke")
    assert_ordinary_exact(reqs, outputs, reference)
    assert_serves_again(engine, reference)


class CountingForward:
    """The model runner's forward, recording each batch, raising when ``fails(batch)``."""

    def __init__(self, engine, fails):
        self.original = engine.runner.execute
        self.fails = fails
        self.batches: list[list[str]] = []
        self.raised: list[bool] = []  # per batch
        engine.runner.execute = self

    def __call__(self, batch, after_layer=None):
        self.batches.append([s.request.request_id for s in batch])
        self.raised.append(self.fails(batch))
        if self.raised[-1]:
            raise RuntimeError("index 999 is out of bounds for the block table")
        return self.original(batch, after_layer)


def test_a_forward_that_fails_with_one_request_is_isolated_by_bisection(
    tiny, make_engine, reference
):
    engine = make_engine(tiny)
    check = fail_bad_at("forward")

    def fails(batch) -> bool:
        try:
            for s in batch:
                check(s.request)
        except IndexError:
            return True
        return False

    forward = CountingForward(engine, fails)
    reqs, outputs = run_requests(engine, [*ORDINARY[:3], BAD_REQUEST, ORDINARY[3]])
    assert_failed_alone(reqs, outputs, "engine error: RuntimeError", "out of bounds")
    assert_ordinary_exact(reqs, outputs, reference)
    # The failing step: the whole batch, then at most 2 * ceil(log2(5)) re-runs of parts.
    first = forward.raised.index(True)
    assert len(forward.batches[first]) == 5
    rerun = forward.batches[first + 1 : first + 1 + 2 * math.ceil(math.log2(5))]
    assert [BAD] in rerun
    # every other request ran once more in that step (and got its token once)
    ok = [rid for b, r in zip(rerun, forward.raised[first + 1 :]) if not r for rid in b]
    assert sorted(ok) == sorted(rid for rid, _, _ in ORDINARY)
    assert forward.raised[first + 1 + len(rerun) :].count(True) == 0
    assert engine.step_loop.num_worker_errors == 0
    assert_serves_again(engine, reference)


def test_a_forward_that_fails_for_a_batch_size_fails_nobody(tiny, make_engine, reference):
    """Not one request's fault (as an out-of-memory on the whole batch): the halves run, and
    every request gets its exact output."""
    engine = make_engine(tiny)
    failed_once = []

    def fails(batch) -> bool:
        if len(batch) == 4 and all(len(s.request.output_token_ids) == 3 for s in batch):
            failed_once.append(True)
            return len(failed_once) == 1
        return False

    CountingForward(engine, fails)
    reqs, outputs = run_requests(engine, ORDINARY)
    assert failed_once
    assert_ordinary_exact(reqs, outputs, reference)
    assert engine.step_loop.num_request_errors == 0


def test_a_forward_that_fails_for_every_request_is_a_worker_error(tiny, make_engine, reference):
    engine = make_engine(tiny)
    broken = []
    forward = CountingForward(engine, lambda batch: bool(broken))
    for rid, prompt, sampling in ORDINARY:
        engine.add_request(prompt, sampling, rid)
    engine.step()  # the prefills run
    broken.append(True)
    before = len(forward.batches)
    outputs = engine.step()
    assert len(forward.batches) - before <= 1 + 2 * math.ceil(math.log2(4))
    assert sorted(o.request_id for o in outputs) == sorted(rid for rid, _, _ in ORDINARY)
    for out in outputs:
        assert out.finished and out.finish_reason == "error"
        assert out.error.startswith("worker error: RuntimeError") and "out of bounds" in out.error
    assert engine.step_loop.num_worker_errors == 1 and not engine.has_unfinished()
    assert engine.step_loop.num_request_errors == 0  # the worker's failure, not theirs
    assert engine.blocks.num_free == engine.blocks.num_total
    # Alone, with the last forward failed too: the worker's failure, not the request's.
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3), "alone")
    (out,) = engine.step()
    assert out.finish_reason == "error" and out.error.startswith("worker error:")
    broken.clear()
    assert_serves_again(engine, reference)
    # Alone right after forwards that ran (a worker that just broke): still the worker's, so
    # the router moves the request instead of failing it.
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3), "alone-2")
    broken.append(True)
    (out,) = engine.step()
    assert out.finish_reason == "error" and out.error.startswith("worker error:")
    for rid in ("alone", "alone-2"):
        assert engine.requests.pop(rid).status is RequestStatus.FINISHED_ERROR


class CulpritExecutor:
    """A forward that raises whenever one of ``culprits`` is in the batch; 9 for every row."""

    def __init__(self, culprits: set[str]):
        self.culprits = culprits
        self.runs: list[list[str]] = []

    def run(self, plan, after_layer, done):
        ids = [s.request.request_id for s in plan.scheduled]
        self.runs.append(ids)
        if self.culprits & set(ids):
            raise RuntimeError(f"bad rows {sorted(self.culprits & set(ids))}")
        done([9] * sum(s.samples for s in plan.scheduled))


@pytest.mark.parametrize(
    "batch, culprits",
    [(8, {0}), (8, {3}), (8, {7}), (5, {4}), (2, {1}), (3, {0, 2}), (16, {5, 12})],
)
def test_bisection_finds_every_culprit_within_its_bound(batch, culprits):
    """At most 2 * ceil(log2(batch)) re-runs a step; a culprit it did not reach stays in the
    batch and is found by a later step. Every other request gets each token once."""
    from engine.block_manager import BlockManager
    from engine.config import SchedulerConfig
    from engine.request import Request
    from engine.scheduler import Scheduler
    from engine.step import StepHooks, StepLoop

    sched = Scheduler(SchedulerConfig(), BlockManager(64, 4), 64)
    reqs = [Request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=2)) for i in range(batch)]
    for r in reqs:
        sched.add(r)
    executor = CulpritExecutor({f"r{i}" for i in culprits})
    loop = StepLoop(sched, executor, StepHooks())
    while True:
        before = len(executor.runs)
        if not loop.step():
            break
        failed_first = bool(executor.culprits & set(executor.runs[before]))
        reruns = len(executor.runs) - before - 1
        assert reruns <= (
            2 * math.ceil(math.log2(len(executor.runs[before]))) if failed_first else 0
        )
    for i, r in enumerate(reqs):
        if i in culprits:
            assert r.status is RequestStatus.FINISHED_ERROR and "bad rows" in r.error
            assert r.error.startswith("engine error: RuntimeError")
        else:
            assert r.status is RequestStatus.FINISHED_LENGTH and r.output_token_ids == [9, 9]
    assert loop.num_request_errors == len(culprits) and loop.num_worker_errors == 0
    assert sched.blocks.num_free == sched.blocks.num_total
