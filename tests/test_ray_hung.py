"""Under Ray, a worker that stays hung is replaced (issue 46): one whose engine is stuck (its
forward sleeps forever: the watchdog answers Status UNAVAILABLE, the router marks it
unhealthy, the controller replaces it after ``unreachable_after_s``), and one whose whole
process is frozen by SIGSTOP (its actor stops answering the controller). Requests keep their
exact greedy output throughout. Slow: a Ray cluster and replacements (about 2 min)."""

from __future__ import annotations

import os
import signal

import pytest
import ray

from pdserve.cluster.ray_controller import ACTOR_STATUS_TIMEOUT_S, NAMESPACE
from pdserve.cluster.ray_launcher import launch
from tests.conftest import tiny_llama_dir
from tests.ray_utils import (
    engine_reference,
    generate,
    init_local_ray,
    make_prompts,
    tiny_config,
    wait_for,
)

pytestmark = pytest.mark.slow

LIVENESS = {"first_token_timeout_s": 6.0, "first_token_s_per_token": 0.001, "token_timeout_s": 3.0}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("ray-hung"), num_kv_heads=2, layers=2, seed=3)
    return path


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(6)


@pytest.fixture(scope="module")
def reference(tiny_model, prompts):
    return engine_reference(tiny_model, prompts)


@pytest.fixture(scope="module")
def cluster(tiny_model):
    init_local_ray()
    config = tiny_config(
        tiny_model,
        pools={"decode": {"num_cpus": 0, "threads": 1, "replicas": 2, "min": 1, "max": 3}},
        router=LIVENESS,
        step_stall_timeout_s=2.0,
    )
    try:
        with launch(config, progress=False) as c:
            yield c
    finally:
        ray.shutdown()


def _ready_decode(st: dict) -> list[str]:
    return [w["id"] for w in st["pools"]["decode"]["workers"] if w["state"] == "ready"]


def _replaced(cluster, victim: str):
    def done():
        st = cluster.status()
        ready = _ready_decode(st)
        return len(ready) == 2 and victim not in ready and st

    return done


def test_a_worker_whose_engine_stays_hung_is_replaced(cluster, prompts, reference):
    victim = min(_ready_decode(cluster.status()))
    actor = ray.get_actor(f"pdserve-{victim}", namespace=NAMESPACE)
    # Its next forward sleeps "forever" (an hour), as one stuck in a kernel would.
    hang = type("Hang", (), {"run": lambda self, *a: __import__("time").sleep(3600)})
    ray.get(
        actor.__ray_call__.remote(
            lambda a: setattr(a.running.worker.step_loop, "executor", hang())
        ),
        timeout=30,
    )
    outs = generate(cluster.grpc_address, prompts)  # some land on it, hang, and migrate
    assert [o.token_ids for o in outs] == reference
    st = wait_for(_replaced(cluster, victim), 90, "a replacement for the hung worker")
    assert any(victim in e and "is dead" in e for e in st["events"])
    outs = generate(cluster.grpc_address, prompts)
    assert [o.token_ids for o in outs] == reference


def test_a_worker_frozen_by_sigstop_is_replaced(cluster, prompts, reference):
    victim = min(_ready_decode(cluster.status()))
    actor = ray.get_actor(f"pdserve-{victim}", namespace=NAMESPACE)
    pid = ray.get(actor.__ray_call__.remote(lambda a: __import__("os").getpid()), timeout=30)
    os.kill(pid, signal.SIGSTOP)
    try:
        outs = generate(cluster.grpc_address, prompts)
        assert [o.token_ids for o in outs] == reference
        st = wait_for(
            _replaced(cluster, victim), ACTOR_STATUS_TIMEOUT_S + 60, "a replacement (SIGSTOP)"
        )
        assert any(victim in e and "is dead" in e for e in st["events"])
    finally:
        try:
            os.kill(pid, signal.SIGCONT)  # if the controller's kill has not reached it yet
        except ProcessLookupError:
            pass
    outs = generate(cluster.grpc_address, prompts)
    assert [o.token_ids for o in outs] == reference
