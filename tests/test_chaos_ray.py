"""Chaos through Ray: kill -9 a decode worker's actor process while every stream is running.
Each stream continues on the other decode worker (migration) and finishes with the greedy output
of an undisturbed run; the controller replaces the dead actor and the pool is back to its size.
And a worker that stays up but whose every step fails is taken out by the router's circuit
breaker and replaced by the controller."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import ray

from pdserve.client import AsyncClient
from pdserve.cluster.ray_controller import NAMESPACE, ROUTER_NAME
from pdserve.cluster.ray_launcher import launch
from tests.conftest import tiny_llama_dir
from tests.ray_utils import (
    SteadyStream,
    engine_reference,
    generate,
    init_local_ray,
    make_prompts,
    tiny_config,
    wait_for,
)

NEW_TOKENS = 96
DECODE_WORKERS = 2


@pytest.fixture(scope="module")
def ray_address():
    yield init_local_ray()
    ray.shutdown()


async def _stream_all(address, prompts, on_progress):
    client = AsyncClient(address)
    outs: list[list[int]] = [[] for _ in prompts]
    reasons = [""] * len(prompts)

    async def one(i, prompt):
        kw = {"token_ids": prompt, "max_tokens": NEW_TOKENS, "ignore_eos": True}
        async for chunk in client.stream(**kw):
            outs[i].extend(chunk.token_ids)
            reasons[i] = chunk.finish_reason or reasons[i]
            on_progress([len(o) for o in outs])

    try:
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        await client.close()
    return outs, reasons


def _ready_decode(st: dict) -> list[dict]:
    return [w for w in st["pools"]["decode"]["workers"] if w["state"] == "ready"]


@pytest.mark.slow
def test_kill_9_of_a_decode_actor_mid_stream_loses_no_stream(ray_address, tmp_path):
    model, _ = tiny_llama_dir(tmp_path, num_kv_heads=2, layers=2, seed=13)
    prompts = make_prompts(6, seed=17)
    reference = engine_reference(model, prompts, max_tokens=NEW_TOKENS)
    cfg = tiny_config(model, pools={"decode": {"replicas": DECODE_WORKERS}})
    with launch(cfg, progress=False) as cluster:
        wait_for(lambda: len(_ready_decode(cluster.status())) == DECODE_WORKERS, 60, "2 decoders")
        victim_row = min(_ready_decode(cluster.status()), key=lambda w: w["id"])
        victim, victim_address = victim_row["id"], victim_row["address"]
        actor = ray.get_actor(f"pdserve-{victim}", namespace=NAMESPACE)
        pid = ray.get(actor.ready.remote(), timeout=60)["pid"]
        router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
        killed_at: list[list[int]] = []

        def kill_while_the_victim_streams(counts):
            # Streams start staggered on a loaded machine (one may finish before another
            # starts), so the kill waits until every stream was routed and then goes in only
            # while the router counts streams in flight on the victim.
            if killed_at or min(counts) < 1:
                return
            inflight = ray.get(router.inflight_on.remote("decode", victim_address), timeout=30)
            if inflight >= 1:
                os.kill(pid, signal.SIGKILL)  # the actor's process, as a crash would end it
                killed_at.append(list(counts))

        outs, reasons = asyncio.run(
            _stream_all(cluster.grpc_address, prompts, kill_while_the_victim_streams)
        )
        assert killed_at, "the victim had no stream in flight once every stream had started"
        assert min(killed_at[0]) < NEW_TOKENS  # killed while streams ran, some on the victim
        assert reasons == ["length"] * len(prompts)
        assert outs == reference

        def replaced():
            st = cluster.status()
            ids = {w["id"] for w in _ready_decode(st)}
            return len(ids) == DECODE_WORKERS and victim not in ids and st

        st = wait_for(replaced, 90, "a replacement for the killed decode actor")
        assert st["pools"]["decode"]["target"] == DECODE_WORKERS
        assert any(victim in e and "is dead" in e for e in st["events"]), st["events"][-5:]
        outs = generate(cluster.grpc_address, prompts, max_tokens=NEW_TOKENS)
        assert [o.token_ids for o in outs] == reference


def _break_steps(actor) -> None:
    """Runs inside a worker actor: every forward from now on raises."""

    def fail(*args, **kwargs):
        raise RuntimeError("injected: this worker's steps fail")

    actor.worker.engine.runner.execute = fail


def _prefill_ids(st: dict) -> set[str]:
    return {w["id"] for w in st["pools"]["prefill"]["workers"] if w["state"] == "ready"}


@pytest.mark.slow
def test_a_worker_whose_steps_keep_failing_is_replaced(ray_address, tmp_path):
    """The prefill actor answers its Status and the controller, but every prefill fails: the
    router's breaker takes it out of routing (requests go on, prefilled by the decode worker),
    its probes fail too, and the controller replaces it; the stream never sees an error."""
    model, _ = tiny_llama_dir(tmp_path, num_kv_heads=2, layers=2, seed=14)
    prompts = make_prompts(8, seed=19)
    reference = engine_reference(model, prompts)
    with launch(tiny_config(model), progress=False) as cluster:
        (victim,) = _prefill_ids(cluster.status())
        actor = ray.get_actor(f"pdserve-{victim}", namespace=NAMESPACE)
        ray.get(actor.__ray_call__.remote(_break_steps), timeout=60)
        with SteadyStream(cluster.grpc_address, prompts, reference) as stream:

            def replaced():
                st = cluster.status()
                ids = _prefill_ids(st)
                return len(ids) == 1 and victim not in ids and st

            st = wait_for(replaced, 120, "the failing prefill worker to be replaced")
            (fresh,) = _prefill_ids(st)

            def fresh_serves():
                rows = cluster.status()["pools"]["prefill"]["workers"]
                return any(w["id"] == fresh and w["served_requests"] > 0 for w in rows)

            wait_for(fresh_serves, 30, "the replacement to take prefills")
        assert not stream.failures, stream.failures[:3]
        assert stream.completed > 0
        assert any(victim in e and "attempts failed" in e for e in st["events"]), st["events"]
