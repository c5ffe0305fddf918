"""Migration: a request whose worker dies mid-stream continues elsewhere, and its client sees
one unbroken stream with the same greedy tokens as an undisturbed run."""

from __future__ import annotations

import asyncio
import signal

import pytest

from pdserve.client import AsyncClient
from pdserve.cluster.local import ClusterSpec, LocalCluster
from tests.cluster_utils import assert_all_blocks_free
from tests.conftest import tiny_llama_dir
from tests.test_disagg import engine_reference, mixed_prompts

NEW_TOKENS = 160


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("migrate"), num_kv_heads=2, seed=5)
    return path


def _spec(tiny_model, **kw) -> ClusterSpec:
    fields = {"num_decode": 2, "num_blocks": 256, "max_model_len": 512, **kw}
    return ClusterSpec(
        model=str(tiny_model), separate_processes=True, threads_per_worker=1, **fields
    )


async def _stream_all(address, prompts, on_progress):
    """Stream every prompt; ``on_progress(counts)`` runs after each chunk."""
    client = AsyncClient(address)
    counts = [0] * len(prompts)
    outs: list[list[int]] = [[] for _ in prompts]
    reasons: list[str] = [""] * len(prompts)

    async def one(i, prompt):
        kw = {"token_ids": prompt, "max_tokens": NEW_TOKENS, "ignore_eos": True}
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


def _decode_proc(cluster: LocalCluster, index: int):
    return cluster._procs[cluster.spec.num_prefill + index]


@pytest.mark.slow
def test_killing_a_decode_worker_mid_stream_loses_no_stream(tiny_model):
    prompts = [p[:40] for p in mixed_prompts(6, seed=21)]
    reference = engine_reference(tiny_model, prompts, new_tokens=NEW_TOKENS)
    with LocalCluster(_spec(tiny_model)) as cluster:
        victim = _decode_proc(cluster, 0)
        killed_at: list[list[int]] = []

        def kill_once_all_stream(counts):
            if not killed_at and min(counts) >= 4:
                killed_at.append(list(counts))
                victim.send_signal(signal.SIGKILL)

        outs, reasons = asyncio.run(_stream_all(cluster.address, prompts, kill_once_all_stream))
        assert killed_at and max(killed_at[0]) < NEW_TOKENS  # killed while they streamed
        assert reasons == ["length"] * len(prompts)
        assert outs == reference
        router = cluster.servers.router
        migrated = router.metrics.migrations._value.get()
        assert migrated >= 1, "no request was on the killed worker"
        # The survivors hold no blocks of anyone: the migrated requests finished there.
        assert_all_blocks_free(cluster, dead={cluster.decode_addresses[0]})


def test_a_prefill_worker_lost_after_its_first_token_fails_the_attempt_at_once(tiny_model):
    """The first token is out, the KV commit is still on its way, and the prefill worker goes
    away: the decode worker would wait for the lease until its deadline (60 s here); the
    router sees the prefill call break and goes around again at once (the decode worker
    prefills it locally, the only prefill worker being gone), with the same tokens."""
    import threading
    import time

    import msgpack

    from kv_transfer.errors import FrameError

    prompts = [p[:40] for p in mixed_prompts(3, seed=22)]
    reference = engine_reference(tiny_model, prompts, new_tokens=NEW_TOKENS)
    spec = ClusterSpec(model=str(tiny_model), num_blocks=256, max_model_len=512, lease_ttl_s=60)
    with LocalCluster(spec) as cluster:
        receiver = cluster.decode_workers[0].receiver
        accept, prefill_server = receiver.accept, cluster.running[0].server
        commits_held = threading.Event()

        def slow_commits(header, payload):
            if msgpack.unpackb(bytes(header)).get("kind") == "commit":
                commits_held.set()
                time.sleep(2.0)  # the commit lags; meanwhile the prefill worker is lost
                raise FrameError("the commit was lost with its prefill worker")
            return accept(header, payload)

        receiver.accept = slow_commits

        def lose_prefill_once_tokens_flow(counts):
            if max(counts) >= 1 and commits_held.is_set() and receiver.accept is slow_commits:
                receiver.accept = accept
                prefill_server.stop(grace=0)

        started = time.monotonic()
        outs, reasons = asyncio.run(
            _stream_all(cluster.address, prompts, lose_prefill_once_tokens_flow)
        )
        assert time.monotonic() - started < 30  # not the lease's 60 s
        assert receiver.accept is accept
        assert outs == reference and reasons == ["length"] * len(prompts)
        assert cluster.servers.router.metrics.migrations._value.get() >= 1
        assert_all_blocks_free(cluster, dead=set(cluster.prefill_addresses))
