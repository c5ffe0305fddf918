"""Disaggregated serving: router -> prefill worker -> KV transfer -> decode worker.

Greedy outputs must equal the single-process engine's, token for token, for every transport
and pool shape; every block on every worker must come back after every test.
"""

from __future__ import annotations

import threading

import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine, build_engine
from engine.request import SamplingParams
from engine.settings import EngineSettings
from pdserve.cluster.local import ClusterSpec, LocalCluster
from tests.cluster_utils import assert_all_blocks_free, generate_concurrently, worker_statuses
from tests.conftest import tiny_llama_dir

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path, _ = tiny_llama_dir(
        tmp_path_factory.mktemp("disagg"), num_heads=4, num_kv_heads=2, layers=3, seed=3
    )
    return path


def mixed_prompts(n: int, vocab: int = 128, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(1, 90, (n,), generator=g)]
    return [torch.randint(3, vocab, (n_,), generator=g).tolist() for n_ in lengths]


def engine_reference(model_path, prompts, block_size=16, new_tokens=NEW_TOKENS) -> list[list[int]]:
    engine = LLMEngine.from_model_path(
        model_path, cache=CacheConfig(block_size, 1024), scheduler=SchedulerConfig(), progress=False
    )
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    return [r.output_token_ids for r in engine.generate(prompts, params)]


def run_cluster(spec: ClusterSpec, prompts):
    with LocalCluster(spec) as cluster:
        outs = generate_concurrently(
            cluster,
            [
                dict(token_ids=p, max_tokens=NEW_TOKENS, ignore_eos=True, include_timings=True)
                for p in prompts
            ],
        )
        assert_all_blocks_free(cluster)
        statuses = worker_statuses(cluster)
    return outs, statuses


@pytest.mark.parametrize("transport", ["grpc", "flight", "torch_dist", "local"])
def test_1p1d_in_process_matches_engine(tiny_model, transport):
    prompts = mixed_prompts(16)
    ref = engine_reference(tiny_model, prompts)
    spec = ClusterSpec(
        model=str(tiny_model), kv_transport=transport, num_blocks=512, max_model_len=256
    )
    outs, _ = run_cluster(spec, prompts)
    assert [o.token_ids for o in outs] == ref
    assert all(o.finish_reason == "length" for o in outs)
    assert all(o.timings.kv_bytes > 0 for o in outs)


@pytest.mark.parametrize("transport", ["grpc", "flight", "torch_dist"])
def test_2p2d_separate_processes_match_engine(tiny_model, transport):
    prompts = mixed_prompts(16, seed=1)
    ref = engine_reference(tiny_model, prompts)
    spec = ClusterSpec(
        model=str(tiny_model),
        num_prefill=2,
        num_decode=2,
        kv_transport=transport,
        num_blocks=512,
        max_model_len=256,
        separate_processes=True,
        threads_per_worker=1,
    )
    outs, statuses = run_cluster(spec, prompts)
    assert [o.token_ids for o in outs] == ref
    # Both pools took traffic (16 concurrent requests over 2 + 2 workers).
    assert all(s.prefix_query_tokens > 0 for s in statuses if s.role == "prefill")


def test_chunked_prefill_with_small_budget_matches_engine(tiny_model):
    prompts = mixed_prompts(8, seed=2)
    ref = engine_reference(tiny_model, prompts)
    spec = ClusterSpec(
        model=str(tiny_model),
        num_blocks=512,
        max_model_len=256,
        max_num_batched_tokens=32,
        prefill_chunk_size=16,
    )
    outs, _ = run_cluster(spec, prompts)
    assert [o.token_ids for o in outs] == ref


def test_shared_system_prompt_hits_prefix_cache(tiny_model):
    g = torch.Generator().manual_seed(5)
    system = torch.randint(3, 128, (48,), generator=g).tolist()
    prompts = [system + torch.randint(3, 128, (5 + i,), generator=g).tolist() for i in range(8)]
    ref = engine_reference(tiny_model, prompts)
    spec = ClusterSpec(model=str(tiny_model), num_blocks=512, max_model_len=256)
    with LocalCluster(spec) as cluster:
        # One request first so the system prompt is cached, then the rest concurrently.
        first = generate_concurrently(
            cluster, [dict(token_ids=prompts[0], max_tokens=NEW_TOKENS, ignore_eos=True)]
        )
        rest = generate_concurrently(
            cluster,
            [dict(token_ids=p, max_tokens=NEW_TOKENS, ignore_eos=True) for p in prompts[1:]],
        )
        assert_all_blocks_free(cluster)
        prefill = [s for s in worker_statuses(cluster) if s.role == "prefill"][0]
    assert [o.token_ids for o in first + rest] == ref
    assert prefill.prefix_hit_tokens >= 7 * 48
    assert all(o.usage.cached_prompt_tokens == 48 for o in rest)


@pytest.mark.parametrize("transport", ["local", "grpc"])
def test_first_layer_arrives_before_last_layer_is_computed(tiny_model, transport):
    """Order of events, not timing: before the prefill worker starts the last layer of the last
    chunk, the decode worker has layer 0's frames. The callback of the layer before it holds the
    engine thread until they arrive; without layer-wise streaming nothing is sent before the
    forward returns, so that wait would time out and the order below would be wrong."""
    spec = ClusterSpec(
        model=str(tiny_model),
        kv_transport=transport,
        num_blocks=512,
        max_model_len=256,
        prefill_chunk_size=16,
    )
    prompt = list(range(3, 83))  # 80 tokens: 5 chunks of 16
    num_layers, num_chunks = 3, 5
    with LocalCluster(spec) as cluster:
        received_layer0 = threading.Event()
        order: list[str] = []
        cluster.decode_workers[0].receiver.on_event = lambda kind, lease, layer: (
            order.append(f"recv {kind} {layer}"),
            layer == 0 and received_layer0.set(),
        )
        calls = []
        in_flight = []

        def on_layer(layer, ids):
            calls.append(layer)
            in_flight.append(cluster.prefill_workers[0].status()["num_transfers"])
            order.append(f"computed chunk {len(calls) // num_layers} layer {layer}")
            if len(calls) == num_layers * num_chunks - 1:  # the last layer is still to come
                order.append(f"layer0 received: {received_layer0.wait(10)}")

        cluster.prefill_workers[0].on_layer_computed = on_layer
        [out] = generate_concurrently(
            cluster, [dict(token_ids=prompt, max_tokens=4, ignore_eos=True)]
        )
        assert_all_blocks_free(cluster)
    assert len(calls) == num_layers * num_chunks
    assert set(in_flight) == {1}  # the job shows in Status while it computes (drain waits on it)
    assert "layer0 received: True" in order, order
    first_recv = next(i for i, e in enumerate(order) if e.startswith("recv kv"))
    last_compute = max(i for i, e in enumerate(order) if e.startswith("computed"))
    assert first_recv < last_compute, order
    assert len(out.token_ids) == 4


@pytest.mark.parametrize("transport", ["grpc", "local"])
def test_int8_kv_cache_end_to_end_matches_the_int8_engine(tiny_model, transport):
    """``kv_dtype: int8`` from the cluster config reaches both pools: the prefill worker's int8
    blocks (codes and scales) cross the transfer into the decode worker's int8 cache, and the
    greedy output equals a colocated engine on an int8 cache, in fewer KV bytes."""
    prompts = mixed_prompts(8, seed=4)
    engine = build_engine(EngineSettings(str(tiny_model), num_blocks=1024, kv_dtype="int8"))
    assert engine.runner.kv_caches[0][0].dtype == torch.int8
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    ref = [r.output_token_ids for r in engine.generate(prompts, params)]
    fp32_spec = ClusterSpec(model=str(tiny_model), kv_transport=transport, num_blocks=512)
    int8_spec = ClusterSpec(
        model=str(tiny_model), kv_transport=transport, num_blocks=512, kv_dtype="int8"
    )
    fp32_outs, _ = run_cluster(fp32_spec, prompts)
    outs, _ = run_cluster(int8_spec, prompts)
    assert [o.token_ids for o in outs] == ref
    assert sum(o.timings.kv_bytes for o in outs) * 3 < sum(o.timings.kv_bytes for o in fp32_outs)
