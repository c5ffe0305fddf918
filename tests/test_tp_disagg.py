"""Disaggregated serving between tensor-parallel workers of different degrees (issue 49):
prefill TP=a ships to decode TP=b through the router, each prefill rank's KV heads in frames
of their own (kv_transfer/frame.py ``heads``), each written into the decode ranks that hold
them. Greedy outputs equal the single-process engine's token for token; every block is free
after (the block bookkeeping is rank 0's, the same block ids on every rank); the KV bytes each
request moved are exactly the bytes of its prompt's blocks for the model's KV heads, once: no
rank ships another rank's heads, and replicated heads travel once."""

from __future__ import annotations

import math
import os

import pytest
import torch

from pdserve.cluster.local import ClusterSpec, LocalCluster
from tests.cluster_utils import assert_all_blocks_free, generate_concurrently, worker_statuses
from tests.test_disagg import NEW_TOKENS, engine_reference

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 3, 4, 4, 16, 16


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.conftest import tiny_llama_dir

    path, _ = tiny_llama_dir(
        tmp_path_factory.mktemp("tp"), num_heads=HEADS, num_kv_heads=KV_HEADS, layers=LAYERS, seed=5
    )
    return path


def distinct_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that share no first block (so no prefix cache hit changes what moves)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(5, 70, (n,), generator=g)]
    return [
        [3 + i, *torch.randint(3, 128, (k - 1,), generator=g).tolist()]
        for i, k in enumerate(lengths)
    ]


@pytest.fixture(scope="module")
def two_kv_heads(tmp_path_factory):
    from tests.conftest import tiny_llama_dir

    path, _ = tiny_llama_dir(
        tmp_path_factory.mktemp("tp-rep"), num_heads=HEADS, num_kv_heads=2, layers=LAYERS, seed=6
    )
    return path


def prompt_kv_bytes(prompt_len: int, kv_heads: int = KV_HEADS) -> int:
    """K and V of every layer, for every block the prompt fills, every KV head, fp32."""
    blocks = math.ceil(prompt_len / BLOCK)
    return 2 * LAYERS * blocks * BLOCK * kv_heads * HEAD_DIM * 4


def run_tp_cluster(model, prefill_tp, decode_tp, transport, prompts, chunk=256):
    """``chunk``: the prefill chunk; the default holds every prompt whole, so each block
    moves once."""
    pools = {
        "prefill": {"threads": 1, "tensor_parallel_size": prefill_tp},
        "decode": {"threads": 1, "tensor_parallel_size": decode_tp},
    }
    spec = ClusterSpec(
        model=str(model),
        num_blocks=256,
        max_model_len=256,
        max_num_batched_tokens=max(chunk, 48),
        prefill_chunk_size=chunk,
        kv_transport=transport,
        pools=pools,
    )
    with LocalCluster(spec) as cluster:
        asked = {"max_tokens": NEW_TOKENS, "ignore_eos": True, "include_timings": True}
        outs = generate_concurrently(cluster, [{"token_ids": p, **asked} for p in prompts])
        assert_all_blocks_free(cluster)
        statuses = worker_statuses(cluster)
    return outs, statuses


@pytest.mark.parametrize("transport", ["grpc", "torch_dist"])
@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2), (4, 2)])
def test_prefill_and_decode_at_different_degrees_are_token_exact(
    tiny_model, prefill_tp, decode_tp, transport
):
    prompts = distinct_prompts(6, seed=prefill_tp * 10 + decode_tp)
    ref = engine_reference(tiny_model, prompts)
    outs, statuses = run_tp_cluster(tiny_model, prefill_tp, decode_tp, transport, prompts)
    assert [o.token_ids for o in outs] == ref
    assert [o.timings.kv_bytes for o in outs] == [prompt_kv_bytes(len(p)) for p in prompts]
    decode = [s for s in statuses if s.role == "decode"]
    assert all(s.frames_rejected == 0 for s in decode)
    sizes = {s.role: s.tensor_parallel.size or 1 for s in statuses}
    assert sizes == {"prefill": prefill_tp, "decode": decode_tp}


def test_chunked_prefill_between_degrees_sends_partial_blocks_again_and_stays_exact(tiny_model):
    """Chunks of 24 tokens: a chunk's partial last block is sent again, as each rank's
    slice, by the next chunk; the lease's coverage counts every head of every block."""
    prompts = distinct_prompts(6, seed=7)
    outs, statuses = run_tp_cluster(tiny_model, 4, 2, "grpc", prompts, chunk=24)
    assert [o.token_ids for o in outs] == engine_reference(tiny_model, prompts)
    assert sum(o.timings.kv_bytes for o in outs) > sum(prompt_kv_bytes(len(p)) for p in prompts)
    assert all(s.frames_rejected == 0 for s in statuses if s.role == "decode")


@pytest.mark.parametrize("transport", ["flight", "local"])
def test_replicated_kv_heads_travel_once(two_kv_heads, transport):
    """TP=4 on a model of 2 KV heads: each head lives on two ranks of either side (vLLM's
    placement). The prefill side sends each head from one of its holders, the decode side
    writes it into both of its holders: the bytes moved are the 2 heads' once."""
    prompts = distinct_prompts(5, seed=11)
    outs, statuses = run_tp_cluster(two_kv_heads, 4, 4, transport, prompts)
    assert [o.token_ids for o in outs] == engine_reference(two_kv_heads, prompts)
    assert [o.timings.kv_bytes for o in outs] == [prompt_kv_bytes(len(p), 2) for p in prompts]
    assert all(s.frames_rejected == 0 for s in statuses if s.role == "decode")


def _gone(pid: int) -> bool:
    """Exited (a zombie counts: its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_killed_rank_of_a_decode_worker_loses_no_stream(tiny_model):
    """kill -9 of one follower of a TP=4 decode worker while 6 greedy streams run: its
    worker's step fails, the worker turns NOT_SERVING, its streams migrate to the other
    decode worker and finish with the undisturbed tokens; its other ranks are torn down
    within 30 s (none is left in a collective), and the survivor's blocks are all free."""
    import asyncio
    import signal
    import time

    from tests.test_migration import NEW_TOKENS as new_tokens
    from tests.test_migration import _stream_all

    prompts = distinct_prompts(6, seed=13)
    reference = engine_reference(tiny_model, prompts, new_tokens=new_tokens)
    pools = {"prefill": {"threads": 1}, "decode": {"threads": 1, "tensor_parallel_size": 4}}
    spec = ClusterSpec(
        model=str(tiny_model), num_decode=2, num_blocks=256, max_model_len=256, pools=pools
    )
    with LocalCluster(spec) as cluster:
        victim = cluster.decode_addresses[0]
        ranks = worker_statuses(cluster)[spec.num_prefill]  # decode worker 0's
        pids = [r.pid for r in ranks.tensor_parallel.ranks if r.rank > 0]
        killed_at: list[list[int]] = []

        def kill_a_rank(counts):
            if not killed_at and min(counts) >= 4:
                killed_at.append(list(counts))
                os.kill(pids[1], signal.SIGKILL)

        outs, reasons = asyncio.run(_stream_all(cluster.address, prompts, kill_a_rank))
        assert killed_at and max(killed_at[0]) < new_tokens  # killed while they streamed
        assert outs == reference and reasons == ["length"] * len(prompts)
        assert cluster.servers.router.metrics.migrations._value.get() >= 1
        deadline = time.monotonic() + 30
        while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(_gone(p) for p in pids), "a rank of the broken worker is still running"
        assert_all_blocks_free(cluster, dead={victim})
