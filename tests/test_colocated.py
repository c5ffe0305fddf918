"""Colocated mode (decode workers prefill too) and the router's per-request choice to skip the
transfer for short prompts: outputs stay exact, blocks come back."""

from __future__ import annotations

import pytest

from pdserve.cluster.local import ClusterSpec, LocalCluster
from tests.cluster_utils import assert_all_blocks_free, generate_concurrently, worker_statuses
from tests.conftest import tiny_llama_dir
from tests.test_disagg import engine_reference, mixed_prompts

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path, _ = tiny_llama_dir(
        tmp_path_factory.mktemp("colocated"), num_heads=4, num_kv_heads=2, seed=21
    )
    return path


def _requests(prompts):
    return [
        dict(token_ids=p, max_tokens=NEW_TOKENS, ignore_eos=True, include_timings=True)
        for p in prompts
    ]


def test_colocated_pool_matches_engine(tiny_model):
    prompts = mixed_prompts(12, seed=21)
    ref = engine_reference(tiny_model, prompts)
    spec = ClusterSpec(
        model=str(tiny_model),
        num_prefill=0,
        num_decode=1,
        num_blocks=512,
        max_model_len=256,
        max_num_batched_tokens=48,
    )
    with LocalCluster(spec) as cluster:
        assert cluster.router.ready
        outs = generate_concurrently(cluster, _requests(prompts))
        assert_all_blocks_free(cluster)
    assert [o.token_ids for o in outs] == ref
    assert all(o.timings.kv_bytes == 0 for o in outs), "colocated requests move no KV"


def test_short_prompts_skip_the_transfer(tiny_model):
    prompts = [list(range(3, 3 + n)) for n in (4, 8, 40, 60)]
    ref = engine_reference(tiny_model, prompts)
    spec = ClusterSpec(
        model=str(tiny_model), num_blocks=512, max_model_len=256, local_prefill_max_tokens=16
    )
    with LocalCluster(spec) as cluster:
        outs = generate_concurrently(cluster, _requests(prompts))
        assert_all_blocks_free(cluster)
        prefill = [s for s in worker_statuses(cluster) if s.role == "prefill"][0]
    assert [o.token_ids for o in outs] == ref
    assert [o.timings.kv_bytes > 0 for o in outs] == [False, False, True, True]
    assert prefill.prefix_query_tokens == 40 + 60
