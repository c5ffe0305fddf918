"""Disaggregated serving over the shm KV transport with worker processes on this node: the
decode worker's cache in shared memory, the prefill workers copying into its leased blocks.
Greedy outputs equal the single-process engine's token for token (chunked prefill, so a
chunk's partial last block is copied again by the next), every block free after, no commit
refused, and the decode worker's cache file gone once the cluster stopped."""

from __future__ import annotations

import os

import pytest

from engine.shared_kv_cache import NAME, SHM_DIR
from pdserve.cluster.local import ClusterSpec, LocalCluster
from tests.cluster_utils import assert_all_blocks_free, generate_concurrently, worker_statuses
from tests.test_disagg import NEW_TOKENS, engine_reference, mixed_prompts


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.conftest import tiny_llama_dir

    path, _ = tiny_llama_dir(
        tmp_path_factory.mktemp("shm"), num_heads=4, num_kv_heads=2, layers=3, seed=3
    )
    return path


def _cache_files() -> set[str]:
    return {name for name in os.listdir(SHM_DIR) if NAME.fullmatch(name)}


@pytest.mark.parametrize("num_decode", [1, 2])
def test_shm_between_worker_processes_matches_engine(tiny_model, num_decode):
    prompts = mixed_prompts(12, seed=4)
    ref = engine_reference(tiny_model, prompts)
    spec = ClusterSpec(
        model=str(tiny_model),
        num_prefill=2,
        num_decode=num_decode,
        kv_transport="shm",
        num_blocks=512,
        max_model_len=256,
        max_num_batched_tokens=32,
        prefill_chunk_size=16,
        separate_processes=True,
        threads_per_worker=1,
    )
    before = _cache_files()
    with LocalCluster(spec) as cluster:
        ours = _cache_files() - before  # each decode worker's cache (other tests' may come)
        assert len(ours) >= num_decode
        asked = {"max_tokens": NEW_TOKENS, "ignore_eos": True, "include_timings": True}
        requests = [{"token_ids": p, **asked} for p in prompts]
        outs = generate_concurrently(cluster, requests)
        assert_all_blocks_free(cluster)
        statuses = worker_statuses(cluster)
    assert [o.token_ids for o in outs] == ref
    assert all(o.timings.kv_bytes > 0 for o in outs)  # the KV crossed, none prefilled locally
    decode = [s for s in statuses if s.role == "decode"]
    assert len(decode) == num_decode and all(s.frames_rejected == 0 for s in decode)
    assert not ours & _cache_files()  # each decode worker removed its file as it stopped
