"""The one engine step (engine/step.py): hook order, what runs under the lock, a deferred
executor (the simulator's), and the workers and the colocated engine running it."""

from __future__ import annotations

import threading

import pytest

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.request import Request, RequestStatus, SamplingParams
from engine.scheduler import Scheduler
from engine.step import StepHooks, StepLoop
from protos import pdserve_pb2 as pb
from tests.conftest import tiny_llama_dir


def scheduler(num_blocks=8, block_size=4, requeue_preempted=True) -> Scheduler:
    blocks = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(), blocks, 64, requeue_preempted)


def lock_is_free(lock) -> bool:
    """Whether another thread could take ``lock`` now (an RPC thread admitting a request)."""
    got = []

    def probe():
        got.append(lock.acquire(blocking=False))
        if got[0]:
            lock.release()

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return got[0]


class RecordingHooks(StepHooks):
    def __init__(self, lock):
        self.lock = lock
        self.calls: list[tuple[str, bool]] = []  # (hook, whether the lock was free)
        self.planned = []
        self.updated = []

    def before_schedule(self):
        self.calls.append(("before_schedule", lock_is_free(self.lock)))

    def on_planned(self, plan):
        self.calls.append(("on_planned", lock_is_free(self.lock)))
        self.planned.append(plan)

    def layer_callback(self, plan):
        self.calls.append(("layer_callback", lock_is_free(self.lock)))

    def on_updated(self, updated):
        self.calls.append(("on_updated", lock_is_free(self.lock)))
        self.updated.append(list(updated))


class FixedTokens:
    """An executor that samples ``token`` for every sequence, at once or when told."""

    def __init__(self, hooks: RecordingHooks, token: int = 9, deferred: bool = False):
        self.hooks, self.token, self.deferred = hooks, token, deferred
        self.pending = []

    def run(self, plan, after_layer, done):
        self.hooks.calls.append(("run", lock_is_free(self.hooks.lock)))
        tokens = [self.token] * sum(s.samples for s in plan.scheduled)
        if self.deferred:
            self.pending.append((done, tokens))
        else:
            done(tokens)


def test_planning_and_update_hold_the_lock_and_the_forward_does_not():
    lock = threading.RLock()
    hooks = RecordingHooks(lock)
    sched = scheduler()
    loop = StepLoop(sched, FixedTokens(hooks), hooks, lock)
    req = Request("a", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    sched.add(req)
    assert loop.step()
    assert hooks.calls == [
        ("before_schedule", False),
        ("on_planned", False),
        ("layer_callback", True),
        ("run", True),
        ("on_updated", False),
    ]
    assert hooks.updated == [[req]] and req.output_token_ids == [9]
    assert loop.step() and req.status is RequestStatus.FINISHED_LENGTH
    assert not loop.step()  # nothing left: no forward
    assert [c for c, _ in hooks.calls].count("run") == 2
    assert sched.blocks.num_free == sched.blocks.num_total


def test_an_empty_plan_still_reports_its_preemptions_and_runs_no_forward():
    """A request that cannot grow preempts itself: nothing is scheduled, but the decode
    worker must still hear of the preemption to end its stream."""
    lock = threading.RLock()
    hooks = RecordingHooks(lock)
    sched = scheduler(num_blocks=2, block_size=4, requeue_preempted=False)
    loop = StepLoop(sched, FixedTokens(hooks), hooks, lock)
    req = Request("a", list(range(3, 11)), SamplingParams(max_tokens=5, ignore_eos=True))
    sched.add(req)
    assert loop.step()  # the prompt fills both blocks; its first token needs a third
    assert not loop.step()
    assert hooks.planned[-1].preempted == [req] and hooks.planned[-1].is_empty
    assert [c for c, _ in hooks.calls].count("run") == 1
    assert req.status is RequestStatus.PREEMPTED and not sched.has_unfinished
    assert sched.blocks.num_free == sched.blocks.num_total


def test_a_deferred_executor_updates_only_when_its_tokens_arrive():
    """The simulator's executor returns at once and hands the tokens back on its clock."""
    hooks = RecordingHooks(threading.RLock())
    sched = scheduler()
    executor = FixedTokens(hooks, token=4, deferred=True)
    loop = StepLoop(sched, executor, hooks)
    req = Request("a", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add(req)
    assert loop.step()
    assert req.output_token_ids == [] and hooks.updated == []
    done, tokens = executor.pending.pop()
    done(tokens)
    assert req.output_token_ids == [4] and hooks.updated == [[req]]
    sched.finish(req, RequestStatus.FINISHED_ABORTED)


@pytest.mark.parametrize("check_stop", [True, False])
def test_check_stop_decides_whether_the_update_ends_requests(check_stop):
    hooks = RecordingHooks(threading.RLock())
    hooks.check_stop = check_stop
    sched = scheduler()
    loop = StepLoop(sched, FixedTokens(hooks), hooks)
    req = Request("a", [5, 6, 7], SamplingParams(max_tokens=1, ignore_eos=True))
    sched.add(req)
    assert loop.step()
    assert req.is_finished is check_stop
    if not check_stop:  # a prefill worker's request: it leaves the batch keeping its blocks
        sched.blocks.free(sched.detach(req))
    assert sched.blocks.num_free == sched.blocks.num_total


@pytest.fixture
def tiny_path(tmp_path):
    path, _ = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2)
    return path


def test_a_reservation_during_the_decode_workers_forward_does_not_wait_for_it(
    tiny_path, make_engine
):
    from decode_worker.worker import DecodeWorker

    worker = DecodeWorker(make_engine(tiny_path, block_size=16, num_blocks=64))
    forward = worker.engine.runner.execute
    leases = []

    def forward_with_a_reservation(batch, after_layer=None):
        rpc = threading.Thread(target=lambda: leases.append(worker.reserve("b", 20)), daemon=True)
        rpc.start()
        rpc.join(10)  # blocks for good if the step held loop.lock around the forward
        return forward(batch, after_layer)

    worker.engine.runner.execute = forward_with_a_reservation
    stream = worker.submit_local("a", [5, 6, 7], [], pb.SamplingParams(max_tokens=1))
    assert worker.step_loop.step()
    assert len(leases) == 1 and worker.release(leases[0].lease_id)
    token = stream.items.get_nowait()
    assert token[0] == 0 and isinstance(token[1], int)
    assert stream.items.get_nowait()[1] == "length"
    assert worker.blocks.num_free == worker.blocks.num_total


def test_the_colocated_engine_steps_through_its_step_loop(tiny_path, make_engine):
    """LLMEngine.step is the shared step: an injected executor replaces its forward, and the
    engine's own update (outputs, max_tokens, freed blocks) follows."""
    engine = make_engine(tiny_path, block_size=16, num_blocks=64)
    hooks = RecordingHooks(threading.RLock())
    engine.step_loop.executor = FixedTokens(hooks, token=11)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), "x")
    outs = [o for _ in range(3) for o in engine.step()]
    assert [o.new_token_ids for o in outs] == [[11]] * 3
    assert [o.finished for o in outs] == [False, False, True]
    assert [c for c, _ in hooks.calls] == ["run"] * 3
    assert engine.step() == [] and not engine.has_unfinished()
