"""Disaggregated serving over the nixl KV transport with worker processes: greedy outputs
equal the single-process engine's token for token (1P1D and 1P2D, chunked prefill so a
chunk's partial last block is written again by the next), every block free after."""

from __future__ import annotations

import pytest

from pdserve.cluster.local import ClusterSpec
from tests.test_disagg import engine_reference, mixed_prompts, run_cluster
from tests.transport_params import requires_transport

pytestmark = requires_transport("nixl")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.conftest import tiny_llama_dir

    path, _ = tiny_llama_dir(
        tmp_path_factory.mktemp("nixl"), num_heads=4, num_kv_heads=2, layers=3, seed=3
    )
    return path


@pytest.mark.parametrize("num_decode", [1, 2])  # 1P2D under Ray: tests/test_ray_multinode.py
def test_nixl_between_worker_processes_matches_engine(tiny_model, num_decode):
    prompts = mixed_prompts(12, seed=4)
    ref = engine_reference(tiny_model, prompts)
    spec = ClusterSpec(
        model=str(tiny_model),
        num_decode=num_decode,
        kv_transport="nixl",
        num_blocks=512,
        max_model_len=256,
        max_num_batched_tokens=32,
        prefill_chunk_size=16,
        separate_processes=True,
        threads_per_worker=1,
    )
    outs, statuses = run_cluster(spec, prompts)  # every block free is checked there
    assert [o.token_ids for o in outs] == ref
    assert all(o.timings.kv_bytes > 0 for o in outs)  # the KV crossed, none prefilled locally
    decode = [s for s in statuses if s.role == "decode"]
    assert len(decode) == num_decode and all(s.frames_rejected == 0 for s in decode)
