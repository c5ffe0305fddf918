"""A killed worker of a node group (share_cores, KV over the group's shared-memory pool) loses
no stream: its requests migrate to the other group, token-exact, and its partner prefill
worker takes the node's cores back once the dead decode worker stops publishing its need."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from engine.core_share import STALE_AFTER_S
from pdserve.cluster.local import LocalCluster
from tests.cluster_utils import assert_all_blocks_free, worker_statuses
from tests.test_disagg import engine_reference, mixed_prompts
from tests.test_migration import NEW_TOKENS, _decode_proc, _spec, _stream_all, tiny_model  # noqa: F401

# Decode's steps never have time to spare (a TPOT target of 1 ns): prefill borrows none of its
# cores, so group 0's prefill worker runs on 1 of the 2 while its partner decodes.
SHARED = {"enabled": True, "node_cores": 2, "tpot_target_s": 1e-9}


@pytest.mark.slow
def test_killing_a_shared_decode_worker_mid_stream_loses_no_stream(tiny_model):  # noqa: F811
    prompts = [p[:40] for p in mixed_prompts(6, seed=23)]
    reference = engine_reference(tiny_model, prompts, new_tokens=NEW_TOKENS)
    spec = _spec(tiny_model, num_prefill=2, kv_transport="shm", share_cores=SHARED)
    with LocalCluster(spec) as cluster:
        victim = _decode_proc(cluster, 0)
        killed_at: list[list[int]] = []
        shares: list[int] = []  # the prefill workers' threads while both decode workers stream

        def kill_once_all_stream(counts):
            if not killed_at and min(counts) >= 4:
                killed_at.append(list(counts))
                shares.extend(s.threads for s in worker_statuses(cluster) if s.role == "prefill")
                victim.send_signal(signal.SIGKILL)

        outs, reasons = asyncio.run(_stream_all(cluster.address, prompts, kill_once_all_stream))
        assert killed_at and max(killed_at[0]) < NEW_TOKENS  # killed while they streamed
        assert shares and shares[0] == 1, shares  # group 0's decode worker held a core
        assert reasons == ["length"] * len(prompts)
        assert outs == reference
        assert cluster.servers.router.metrics.migrations._value.get() >= 1
        dead = {cluster.decode_addresses[0]}
        assert_all_blocks_free(cluster, dead=dead)
        # Group 0's prefill worker: its partner publishes nothing now, so past the ledger's
        # staleness limit its next chunks run on both cores again.
        time.sleep(STALE_AFTER_S + 0.5)
        after = [p[:40] for p in mixed_prompts(4, seed=24)]
        outs, _ = asyncio.run(_stream_all(cluster.address, after, lambda counts: None))
        assert outs == engine_reference(tiny_model, after, new_tokens=NEW_TOKENS)
        partner = next(s for s in worker_statuses(cluster, dead) if s.role == "prefill")
        assert (partner.threads, partner.node_cores) == (2, 2)
