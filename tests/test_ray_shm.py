"""One KV pool on a node under Ray: a node group (share_cores: prefill worker i and decode worker
i in one placement group, pdserve/cluster/core_pairs.py) with KV over shm, the prefill worker
copying into the decode worker's cache in shared memory. Through the router: greedy outputs
token-exact, the KV crossed, every block free after, and no cache file left once the cluster
is down."""

from __future__ import annotations

import os

import pytest

from engine.shared_kv_cache import NAME, SHM_DIR, sweep_stale


def _cache_files() -> set[str]:
    return {name for name in os.listdir(SHM_DIR) if NAME.fullmatch(name)}


@pytest.mark.slow
def test_a_node_group_shares_one_kv_pool_under_ray(tmp_path):
    import ray

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

    model, _ = tiny_llama_dir(tmp_path, num_kv_heads=2, seed=7)
    prompts = make_prompts(6, seed=2)
    reference = engine_reference(model, prompts)
    before = _cache_files()
    init_local_ray()
    try:
        config = tiny_config(
            model, kv_transport="shm", share_cores={"enabled": True, "node_cores": 2}
        )
        with launch(config, progress=False) as cluster:
            ours = _cache_files() - before  # the decode worker's cache
            assert ours
            outs = generate(cluster.grpc_address, prompts)
            assert [o.token_ids for o in outs] == reference
            assert all(o.timings.kv_bytes > 0 for o in outs)  # through the shared cache

            def every_block_free() -> bool:  # as the workers' last status reports say
                rows = [w for p in cluster.status()["pools"].values() for w in p["workers"]]
                return all(w["kv_usage"] == 0 and not w["running"] for w in rows)

            wait_for(every_block_free, 10, "every block free")
            rows = [w for p in cluster.status()["pools"].values() for w in p["workers"]]
            assert len({w["node_id"] for w in rows}) == 1
    finally:
        ray.shutdown()
    sweep_stale()  # a worker Ray killed before its stop could not remove its own
    assert not ours & _cache_files()
