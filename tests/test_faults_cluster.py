"""A cluster whose KV transfers are delayed, dropped, corrupted and cut (the "faults"
transport): every request is sent around again and finishes with its exact greedy output, or,
once its migrations are used up, fails cleanly with the cause; never a hang, every block back."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kv_transfer import transport_faults as faults
from kv_transfer.transport_faults import FaultPolicy
from pdserve.client import AsyncClient
from pdserve.cluster.local import ClusterSpec, LocalCluster
from router.pool import WorkerHandle
from tests.cluster_utils import assert_all_blocks_free, generate_concurrently, worker_statuses
from tests.conftest import tiny_llama_dir
from tests.test_disagg import engine_reference, mixed_prompts
from tests.transport_params import transport_params

NEW_TOKENS = 16
# Within this every request has finished or failed; a hang fails the test instead of it.
BOUND_S = 120


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("faults"), num_kv_heads=2, seed=6)
    return path


def _cluster(tiny_model, monkeypatch, policy: FaultPolicy, inner: str = "grpc") -> LocalCluster:
    # The decode worker's "faults" server publishes the policy in its endpoint.
    monkeypatch.setenv(faults.POLICY_ENV, policy.encode())
    monkeypatch.setenv(faults.INNER_ENV, inner)
    spec = ClusterSpec(
        model=str(tiny_model),
        num_prefill=2,
        kv_transport="faults",
        num_blocks=512,
        max_model_len=256,
    )
    return LocalCluster(spec)


def _requests(prompts):
    return [{"token_ids": p, "max_tokens": NEW_TOKENS, "ignore_eos": True} for p in prompts]


async def _bounded(cluster, prompts):
    return await asyncio.wait_for(
        asyncio.to_thread(generate_concurrently, cluster, _requests(prompts)), BOUND_S
    )


@pytest.mark.parametrize("inner", transport_params(["grpc", "nixl", "shm"]))
def test_faulty_transfers_are_sent_again_and_outputs_stay_exact(tiny_model, monkeypatch, inner):
    policy = FaultPolicy(
        seed=7, delay_p=0.3, delay_s=0.02, drop_p=0.1, corrupt_p=0.1, disconnect_p=0.05
    )
    before = dict(faults.injected)
    # A failed transfer takes its prefill worker out of routing for a while (a second, or the
    # breaker's cooldown); with both out, prompts are prefilled on the decode worker and
    # nothing crosses the faulty link. Keep them in routing so every attempt meets the link.
    marked = []
    monkeypatch.setattr(WorkerHandle, "mark_failed", lambda self, *a: marked.append(self))
    with _cluster(tiny_model, monkeypatch, policy, inner) as cluster:
        # Half of all transfers fail here; no request may run out of migrations or attempts
        # for it (the giving-up path is the next test's).
        cluster.router.flow.cfg.max_migrations = 100
        cluster.router.flow.cfg.max_attempts = 100
        (decode_before,) = [s for s in worker_statuses(cluster) if s.role == "decode"]

        kinds = ("delay", "drop", "corrupt", "corrupt_header", "disconnect")
        # The draws are seeded per link, but which frame meets which draw depends on how the
        # concurrent streams interleave: go again (at most 4 rounds) until every kind was met.
        # Each round sends new prompts (up to 5 blocks: several frames), so each round's KV is
        # transferred afresh rather than found in a cache.
        for round_number in range(4):
            prompts = [p[:70] for p in mixed_prompts(24, seed=51 + round_number)]
            reference = engine_reference(tiny_model, prompts, new_tokens=NEW_TOKENS)
            outs = asyncio.run(_bounded(cluster, prompts))
            assert [o.token_ids for o in outs] == reference
            assert [o.finish_reason for o in outs] == ["length"] * len(prompts)
            got = {k: faults.injected[k] - before.get(k, 0) for k in faults.injected}
            if all(got.get(k, 0) > 0 for k in kinds):
                break
        assert all(got.get(k, 0) > 0 for k in kinds), got
        (decode_after,) = [s for s in worker_statuses(cluster) if s.role == "decode"]
        assert decode_after.frames_rejected > decode_before.frames_rejected  # caught there
        assert cluster.router.metrics.migrations._value.get() >= 1
        assert {w.role for w in marked} == {"prefill"}  # each failed attempt was counted
        assert_all_blocks_free(cluster)


def test_a_request_out_of_migrations_fails_cleanly_with_the_cause(tiny_model, monkeypatch):
    """Every frame corrupted: the first attempt's transfer fails on one prefill worker, the
    migration's on the other, and with max_migrations = 1 the client gets UNAVAILABLE
    naming the KV transfer, after the first token it already had. Nothing is left behind."""
    (prompt,) = [p[:40] for p in mixed_prompts(1, seed=52)]
    with _cluster(tiny_model, monkeypatch, FaultPolicy(seed=1, corrupt_p=1.0)) as cluster:
        cluster.router.flow.cfg.max_migrations = 1

        async def stream_until_error():
            client = AsyncClient(cluster.address)
            tokens = []
            try:
                async for chunk in client.stream(**_requests([prompt])[0]):
                    tokens.extend(chunk.token_ids)
            except grpc.aio.AioRpcError as e:
                return tokens, e
            finally:
                await client.close()
            return tokens, None

        tokens, error = asyncio.run(asyncio.wait_for(stream_until_error(), BOUND_S))
        assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
        assert "KV transfer failed" in error.details() and "migrations" in error.details()
        assert 1 <= len(tokens) < NEW_TOKENS
        assert_all_blocks_free(cluster)
