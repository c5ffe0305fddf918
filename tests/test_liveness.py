"""Hung is lost (issue 46): a worker whose engine stops stepping says so in its health and
Status, and the streams it held migrate as a dead worker's do, with exact greedy output.

Unit parts (no model): the engine thread's liveness, the keepalive options. The cluster part
runs in-process workers so that one decode worker's forward can be made to sleep "forever"
(until teardown releases it); deadlines and the watchdog's bound are set short here, the
defaults stay generous."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.loop import EngineThread
from grpc_plumbing.server import client_keepalive_options, server_keepalive_options
from pdserve.client import AsyncClient
from pdserve.cluster.local import ClusterSpec, LocalCluster
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router.flow.types import AttemptOutcome, FlowConfig
from tests.cluster_utils import assert_all_blocks_free
from tests.conftest import tiny_llama_dir
from tests.test_disagg import engine_reference, mixed_prompts

NEW_TOKENS = 48
# Short deadlines for the tests (defaults: 60 s + 0.01 s per prompt token, 20 s per token).
LIVENESS = {"first_token_timeout_s": 6.0, "first_token_s_per_token": 0.001, "token_timeout_s": 3.0}


async def stream_all(address, prompts, on_progress, new_tokens: int):
    """Stream every prompt greedily; ``on_progress(counts)`` runs after each chunk."""
    client = AsyncClient(address)
    counts = [0] * len(prompts)
    outs: list[list[int]] = [[] for _ in prompts]
    reasons: list[str] = [""] * len(prompts)

    async def one(i, prompt):
        kw = {"token_ids": prompt, "max_tokens": new_tokens, "ignore_eos": True}
        async for chunk in client.stream(**kw):
            outs[i].extend(chunk.token_ids)
            counts[i] = len(outs[i])
            reasons[i] = chunk.finish_reason or reasons[i]
            on_progress(counts)

    try:
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        await client.close()
    return outs, reasons


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


# ---- the engine thread's liveness ------------------------------------------------------------
def test_a_step_past_its_bound_is_a_stall_and_an_idle_engine_is_not():
    release, entered = threading.Event(), threading.Event()
    calls = []

    def step() -> bool:
        calls.append(1)
        if len(calls) == 3:  # the third step "hangs" until released
            entered.set()
            release.wait(10)
            return True
        return False

    loop = EngineThread(step, lambda e: None, "t-engine")
    loop.start()
    try:
        assert entered.wait(5)
        assert loop.problem(stall_timeout_s=5.0) is None  # running, within its bound
        time.sleep(0.3)
        assert "stalled" in loop.problem(stall_timeout_s=0.2)
        release.set()
        wait_for(lambda: loop.problem(0.2) is None, 5, "the step finished: live again")
        time.sleep(0.3)  # idle (steps return False): never a stall
        assert loop.problem(stall_timeout_s=0.2) is None
    finally:
        release.set()
        loop.stop()


def test_an_engine_thread_killed_by_its_error_handler_is_reported_dead():
    def step() -> bool:
        raise RuntimeError("bad batch")

    def on_error(error: BaseException) -> None:
        raise ValueError("the handler itself failed")

    loop = EngineThread(step, on_error, "t-dying")
    loop.start()
    wait_for(lambda: loop.problem(60.0) is not None, 5, "the dead thread is reported")
    assert "engine thread died: ValueError" in loop.problem(60.0)


def test_hung_migrates_like_a_lost_worker_and_budgets_scale_with_the_prompt():
    assert AttemptOutcome.HUNG.migrates and AttemptOutcome.WORKER_LOST.migrates
    cfg = FlowConfig(None, None, 16, 1.0, 0, 0.1)
    assert cfg.first_token_budget(0) == cfg.first_token_timeout_s == 60.0
    assert cfg.first_token_budget(2000) == pytest.approx(80.0)
    assert cfg.token_timeout_s >= 5.0  # generous: a slow CPU never trips it


def test_router_channels_ping_and_worker_servers_accept_the_pings():
    client = dict(client_keepalive_options())
    server = dict(server_keepalive_options())
    assert client["grpc.keepalive_time_ms"] > 0 and client["grpc.keepalive_timeout_ms"] > 0
    assert client["grpc.keepalive_permit_without_calls"] == 1
    # A server that allowed pings less often than the router sends them would GOAWAY.
    assert (
        server["grpc.http2.min_ping_interval_without_data_ms"] <= client["grpc.keepalive_time_ms"]
    )
    assert server["grpc.keepalive_permit_without_calls"] == 1
    assert server["grpc.http2.max_ping_strikes"] == 0


# ---- a forward that sleeps forever, in a live cluster ------------------------------------------
class HangingExecutor:
    """Runs the real executor until ``hang`` is set; then the next forward sleeps until
    ``release`` (teardown), as a forward stuck in a kernel would, forever."""

    def __init__(self, inner):
        self.inner = inner
        self.hang, self.release, self.hung = threading.Event(), threading.Event(), threading.Event()

    def run(self, plan, after_layer, done):
        if self.hang.is_set() and not self.release.is_set():
            self.hung.set()
            self.release.wait(120)
        self.inner.run(plan, after_layer, done)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("liveness"), num_kv_heads=2, seed=5)
    return path


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def _status_code(address: str):
    with grpc.insecure_channel(address) as channel:
        try:
            pb_grpc.DecodeWorkerStub(channel).Status(pb.StatusRequest(), timeout=5)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_a_forward_that_sleeps_forever_turns_health_off_and_its_streams_migrate(tiny_model):
    prompts = [p[:40] for p in mixed_prompts(6, seed=21)]
    reference = engine_reference(tiny_model, prompts, new_tokens=NEW_TOKENS)
    spec = ClusterSpec(
        model=str(tiny_model),
        num_decode=2,
        num_blocks=256,
        max_model_len=512,
        router=LIVENESS,
        step_stall_timeout_s=1.5,
    )
    with LocalCluster(spec) as cluster:
        victim = cluster.decode_workers[0]
        address = cluster.decode_addresses[0]
        hanging = HangingExecutor(victim.step_loop.executor)
        victim.step_loop.executor = hanging
        try:
            assert _health(address) == health_pb2.HealthCheckResponse.SERVING

            def hang_once_all_stream(counts):
                if min(counts) >= 4:
                    hanging.hang.set()

            t0 = time.monotonic()
            outs, reasons = asyncio.run(
                stream_all(cluster.address, prompts, hang_once_all_stream, NEW_TOKENS)
            )
            assert time.monotonic() - t0 < 90
            assert hanging.hung.is_set(), "the forward never hung"
            assert reasons == ["length"] * len(prompts)
            assert outs == reference
            assert cluster.router.metrics.migrations._value.get() >= 1
            # The watchdog: health NOT_SERVING, Status UNAVAILABLE, out of routing.
            not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
            wait_for(lambda: _health(address) == not_serving, 10, "health NOT_SERVING")
            assert _status_code(address) == grpc.StatusCode.UNAVAILABLE
            handle = cluster.router.decode.workers[address]
            wait_for(lambda: not handle.routable, 10, "the hung worker out of routing")
            assert cluster.router.ready  # the server stays healthy
        finally:
            hanging.release.set()
        # Released, the worker steps again: serving, and every block of every pool free.
        serving = health_pb2.HealthCheckResponse.SERVING
        wait_for(lambda: _health(address) == serving, 10, "serving again once released")
        assert_all_blocks_free(cluster)
