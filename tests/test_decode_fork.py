"""n > 1 on the decode worker: the forks share the prompt's full KV blocks by reference count,
each gets its own copy of the partial last block, and every block is free afterwards."""

from __future__ import annotations

import pytest
import torch

from decode_worker.worker import DecodeWorker
from engine.block_manager import BlockManager
from protos import pdserve_pb2 as pb
from tests.conftest import tiny_llama_dir


def test_block_manager_fork_shares_full_blocks_and_copies_the_partial_one():
    blocks = BlockManager(8, 4)
    table = blocks.allocate(3)  # 10 tokens: two full blocks and a partial one
    fork, fresh = blocks.fork(table, 10)
    assert fork[:2] == table[:2] and fork[2] == fresh and fresh not in table
    assert [blocks.ref_count(b) for b in table] == [2, 2, 1]
    blocks.free(table)
    blocks.free(fork)
    assert blocks.num_free == blocks.num_total
    full_only, none = blocks.fork(blocks.allocate(2), 8)
    assert none is None and len(full_only) == 2


@pytest.fixture
def worker(tmp_path, make_engine):
    path, _ = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2)
    return DecodeWorker(make_engine(path, block_size=16, num_blocks=64))


def test_attach_with_forks_holds_the_prompt_once(worker):
    prompt = list(range(3, 43))  # 40 tokens + the first: KV for 40 = 2 full blocks + 8 tokens
    lease = worker.reserve("r", len(prompt) + 1)
    k_cache = worker.engine.runner.kv_caches[0][0]
    k_cache[lease.block_ids[2]] = torch.randn_like(k_cache[0])  # the partial block's "KV"
    lease.committed.set()  # as if every frame had arrived
    sampling = pb.SamplingParams(max_tokens=4, n=4, temperature=1.0, seed=7)
    stream = worker.attach("r", lease.lease_id, prompt, [50], sampling, [51, 52, 53])
    seqs = stream.seqs
    assert [s.output_token_ids for s in seqs] == [[50], [51], [52], [53]]
    assert [s.sampling.seed for s in seqs] == [7, 8, 9, 10] and all(s.sampling.n == 1 for s in seqs)
    full = seqs[0].block_table[:2]
    assert all(s.block_table[:2] == full for s in seqs)
    assert [worker.blocks.ref_count(b) for b in full] == [4, 4]
    partials = {s.block_table[2] for s in seqs}
    assert len(partials) == 4  # each its own copy
    for s in seqs[1:]:
        assert torch.equal(k_cache[s.block_table[2]], k_cache[seqs[0].block_table[2]])
    assert worker.blocks.num_total - worker.blocks.num_free == 3 + 3  # not 4 x 3
    worker.abort("r")
    with worker.loop.lock:
        worker._apply_aborts()
    ends = [stream.items.get_nowait() for _ in range(4)]
    assert sorted(i for i, _, _ in ends) == [0, 1, 2, 3]
    assert worker.blocks.num_free == worker.blocks.num_total


def test_forks_preempted_for_lack_of_blocks_finish_alone_with_the_same_tokens(tmp_path):
    """A decode pool too small for four growing sequences: forks are preempted (or find no
    block) and go around again on their own; seeded by (seed + i, position), each ends with
    the tokens it would have had alone."""
    from pdserve.cluster.local import ClusterSpec, LocalCluster
    from tests.cluster_utils import assert_all_blocks_free, generate_concurrently

    path, _ = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2, seed=4)
    spec = ClusterSpec(model=str(path), num_blocks=64, decode_num_blocks=8, max_model_len=128)
    kw = {"token_ids": list(range(3, 23)), "max_tokens": 40, "temperature": 1.0, "ignore_eos": True}
    with LocalCluster(spec) as cluster:
        import grpc

        from protos import pdserve_pb2 as pb
        from protos import pdserve_pb2_grpc as pb_grpc

        with grpc.insecure_channel(cluster.address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            req = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=kw["token_ids"]),
                sampling=pb.SamplingParams(
                    max_tokens=40, temperature=1.0, seed=5, n=4, ignore_eos=True
                ),
            )
            tokens: list[list[int]] = [[], [], [], []]
            last = None
            for msg in stub.Generate(req, timeout=120):
                tokens[msg.index] += msg.token_ids
                last = msg
        # One at a time: each fits the pool alone.
        alone = [generate_concurrently(cluster, [{**kw, "seed": 5 + i}])[0] for i in range(4)]
        assert tokens == [a.token_ids for a in alone]
        assert last.usage.completion_tokens == 160
        assert_all_blocks_free(cluster)
        preemptions = sum(s.num_preemptions for s in _decode_statuses(cluster))
        assert preemptions > 0, "the pool was meant to be too small"


def _decode_statuses(cluster):
    from tests.cluster_utils import worker_statuses

    return [s for s in worker_statuses(cluster) if s.role == "decode"]


def test_a_request_that_ends_before_it_forks_ends_every_sequence(worker):
    """Colocated n > 1 aborted (or preempted) before its first token: the forks never made
    end too, so the stream closes and the router can run them alone."""
    sampling = pb.SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=1)
    stream = worker.submit_local("q", [5, 6, 7], [], sampling)
    worker.abort("q")
    with worker.loop.lock:
        worker._apply_aborts()
    ends = [stream.items.get_nowait() for _ in range(3)]
    assert [(i, reason) for i, reason, _ in ends] == [
        (0, "abort"),
        (1, "preempted"),
        (2, "preempted"),
    ]
    assert stream.items.empty() and worker.blocks.num_free == worker.blocks.num_total


def test_a_stop_string_ends_its_sequence_on_the_decode_worker(worker):
    """n > 1: the worker ends each sequence at the token that completes a stop string, rather
    than running it to max_tokens (the router cannot cancel one sequence of a stream)."""
    from engine.request import SamplingParams

    prompt = [5, 6, 7]
    [ref] = worker.engine.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))
    out = ref.output_token_ids
    j = next(j for j in range(2, 10) if out[j] >= 3 and out[j] not in out[:j])
    sampling = pb.SamplingParams(max_tokens=10, n=2, ignore_eos=True, stop=[f"w{out[j]}"])
    worker.start()
    try:
        stream = worker.submit_local("s", prompt, [], sampling)
        tokens, reasons = {0: [], 1: []}, {}
        while len(reasons) < 2:
            i, item, _ = stream.items.get(timeout=30)
            if isinstance(item, str):
                reasons[i] = item
            else:
                tokens[i].append(item)
    finally:
        worker.stop()
    assert reasons == {0: "stop", 1: "stop"}
    assert tokens == {0: out[: j + 1], 1: out[: j + 1]}
    assert worker.blocks.num_free == worker.blocks.num_total
