"""Disaggregated serving with both workers' models on CUDA (``-m gpu``): KV blocks gathered
from the prefill worker's GPU cache, shipped, and scattered into the decode worker's GPU cache;
outputs equal to the CPU engine's, every block back."""

from __future__ import annotations

import pytest
import torch

from kernels import ops
from pdserve.cluster.local import ClusterSpec, LocalCluster
from tests.cluster_utils import assert_all_blocks_free, generate_concurrently
from tests.test_disagg import NEW_TOKENS, engine_reference, mixed_prompts, tiny_model  # noqa: F401

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not ops.TRITON_AVAILABLE, reason="Triton is not installed"),
]


def _generate(cluster: LocalCluster, prompts):
    requests = [dict(token_ids=p, max_tokens=NEW_TOKENS, ignore_eos=True) for p in prompts]
    outs = generate_concurrently(cluster, requests)
    assert_all_blocks_free(cluster)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("transport", ["grpc", "local"])
def test_1p1d_on_cuda_matches_cpu_engine(tiny_model, transport):  # noqa: F811
    prompts = mixed_prompts(16, seed=4)
    spec = ClusterSpec(
        model=str(tiny_model),
        kv_transport=transport,
        num_blocks=512,
        max_model_len=256,
        device="cuda",
        dtype="fp32",  # equal to the CPU engine's tokens: the same precision
    )
    with LocalCluster(spec) as cluster:
        workers = cluster.prefill_workers + cluster.decode_workers
        assert all(w.engine.runner.kv_caches[0][0].is_cuda for w in workers)
        assert _generate(cluster, prompts) == engine_reference(tiny_model, prompts)


def test_separate_worker_processes_pick_the_gpu_on_auto(tiny_model):  # noqa: F811
    prompts = mixed_prompts(8, seed=5)
    spec = ClusterSpec(
        model=str(tiny_model),
        num_blocks=512,
        max_model_len=256,
        device="auto",
        dtype="fp32",
        separate_processes=True,
    )
    free_before = torch.cuda.mem_get_info()[0]
    with LocalCluster(spec) as cluster:
        # Device-wide free memory: each worker process holds a CUDA context (hundreds of MiB
        # each) only if it put its model on the GPU.
        taken_mib = (free_before - torch.cuda.mem_get_info()[0]) / 2**20
        assert taken_mib > 256, f"worker processes took {taken_mib:.0f} MiB of GPU memory"
        assert _generate(cluster, prompts) == engine_reference(tiny_model, prompts)
