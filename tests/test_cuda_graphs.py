"""Decode steps under CUDA graphs (engine/cuda_graphs.py): the bucket choice and the padding
of a batch into its bucket on CPU; with ``-m gpu``, an engine replaying captured graphs gives
transformers' greedy tokens at batch sizes that fill and that pad their buckets."""

from __future__ import annotations

import pytest
import torch

from engine.cuda_graphs import BATCH_BUCKETS, _Bucket, bucket_for, buckets_for, graphs_enabled
from engine.request import SamplingParams
from kernels import ops
from kernels.metadata import AttentionMetadata
from tests.conftest import tiny_llama_dir
from tests.greedy import assert_same_greedy, hf_greedy


def test_a_batch_runs_in_the_smallest_bucket_that_holds_it() -> None:
    buckets = [1, 2, 4, 8, 16]
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 4, 5, 9, 16)] == [1, 2, 4, 4, 8, 16, 16]
    assert bucket_for(17, buckets) is None  # past the largest: eager
    assert bucket_for(3, [8, 1, 4]) == 4  # order does not matter
    with pytest.raises(ValueError):
        bucket_for(0, buckets)


def test_captured_buckets_stop_at_the_first_that_holds_max_num_seqs() -> None:
    assert buckets_for(1) == [1]
    assert buckets_for(5) == [1, 2, 4, 8]
    assert buckets_for(64) == [b for b in BATCH_BUCKETS if b <= 64]
    assert buckets_for(10**6) == list(BATCH_BUCKETS)  # every bucket; larger batches eager
    with pytest.raises(ValueError):
        buckets_for(0)


def test_graphs_are_cuda_only_and_opt_in(monkeypatch) -> None:
    monkeypatch.delenv("PDSERVE_CUDA_GRAPHS", raising=False)
    assert not graphs_enabled("cuda") and not graphs_enabled("cpu")
    monkeypatch.setenv("PDSERVE_CUDA_GRAPHS", "1")
    assert graphs_enabled("cuda") and graphs_enabled("cuda:1") and not graphs_enabled("cpu")


def test_a_short_batch_is_padded_with_rows_that_write_no_kv() -> None:
    bucket = _Bucket(4, max_model_len=64, block_size=16, device="cpu")
    assert bucket.meta.block_tables.shape == (4, 4) and bucket.meta.seq_lens_cpu == [64] * 4
    bucket.meta.slot_mapping.fill_(7)  # leftovers of an earlier, fuller batch
    bucket.input_ids.fill_(9)
    meta = AttentionMetadata.build([1, 1], [20, 33], [[5, 6], [1, 2, 3]], 16)
    bucket.load(torch.tensor([11, 12]), torch.tensor([19, 32]), meta)
    assert bucket.input_ids.tolist() == [11, 12, 0, 0]
    assert bucket.positions.tolist() == [19, 32, 0, 0]
    assert bucket.meta.seq_lens.tolist() == [20, 33, 1, 1]
    assert bucket.meta.slot_mapping.tolist() == [6 * 16 + 3, 3 * 16 + 0, -1, -1]
    assert bucket.meta.block_tables[:, :3].tolist() == [[5, 6, 0], [1, 2, 3], [0, 0, 0], [0, 0, 0]]
    assert bucket.meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(not ops.TRITON_AVAILABLE, reason="Triton is not installed")
@pytest.mark.parametrize("num_prompts", [1, 3], ids=["bucket1", "padded-to-4"])
def test_graph_replayed_decode_matches_transformers(
    tmp_path, make_engine, monkeypatch, num_prompts
) -> None:
    monkeypatch.setenv("PDSERVE_CUDA_GRAPHS", "1")
    path, hf_model = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2, seed=7)
    engine = make_engine(path, block_size=16, num_blocks=256, device="cuda")
    assert engine.runner.graphs is not None
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (5, 17, 33)]
    prompts = prompts[:num_prompts]
    params = SamplingParams(max_tokens=16, min_tokens=16)
    outs = engine.generate(prompts, params)
    captured = [s for s, b in engine.runner.graphs.buckets.items() if b.graph is not None]
    assert captured, "no decode step ran under a graph"
    for prompt, req in zip(prompts, outs):
        expected = hf_greedy(hf_model, prompt, 16)
        assert_same_greedy(hf_model, prompt, req.output_token_ids, expected)


def test_int8_caches_are_never_replayed() -> None:
    """The torch path reads int8 caches with the host's context lengths, which a graph would
    freeze at max_model_len: such steps stay eager."""
    from engine.cuda_graphs import DecodeGraphs

    class Model:
        embed_tokens = torch.nn.Embedding(4, 2)

    meta = AttentionMetadata.build([1], [5], [[0]], 16)
    float_kv = [(torch.zeros(2, 16, 1, 8), torch.zeros(2, 16, 1, 8))]
    int8_kv = [(torch.zeros(2, 16, 1, 12, dtype=torch.int8),) * 2]
    assert DecodeGraphs(Model(), float_kv, 64, 16, [1, 2]).can_run(meta) == ops.TRITON_AVAILABLE
    assert not DecodeGraphs(Model(), int8_kv, 64, 16, [1, 2]).can_run(meta)
    assert not DecodeGraphs(Model(), float_kv, 64, 16, [1, 2]).can_run(meta, lambda i: None)
    long_meta = AttentionMetadata.build([1], [65], [[0, 1, 2, 3, 4]], 16)
    assert not DecodeGraphs(Model(), float_kv, 64, 16, [1, 2]).can_run(long_meta)
