"""The engine on a CUDA device (``-m gpu``): the forward on the GPU, attention and KV writes
through the compiled Triton kernels, greedy output still equal to transformers' (on the CPU)."""

from __future__ import annotations

import pytest
import torch

from engine.request import SamplingParams
from kernels import ops
from tests.conftest import tiny_llama_dir
from tests.greedy import assert_same_greedy, hf_greedy
from tests.test_engine_greedy_tiny import boundary_lengths, random_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not ops.TRITON_AVAILABLE, reason="Triton is not installed"),
]

NEW_TOKENS = 20


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)], ids=["mha", "gqa3"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("chunk", [0, 16], ids=["whole", "chunk16"])
def test_cuda_greedy_matches_transformers(
    tmp_path, make_engine, heads, kv_heads, block_size, chunk
):
    path, hf_model = tiny_llama_dir(tmp_path, num_heads=heads, num_kv_heads=kv_heads)
    engine = make_engine(
        path,
        block_size=block_size,
        num_blocks=4096 // block_size,
        device="cuda",
        prefill_chunk_size=chunk,
    )
    assert engine.runner.kv_caches[0][0].is_cuda
    assert ops.kernel_backend(engine.runner.kv_caches[0][0].device) == "triton"
    prompts = random_prompts(boundary_lengths(block_size), hf_model.config.vocab_size)
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    for prompt, req in zip(prompts, engine.generate(prompts, params)):
        assert_same_greedy(
            hf_model, prompt, req.output_token_ids, hf_greedy(hf_model, prompt, NEW_TOKENS)
        )


def test_cuda_preemption_and_mixed_batches_keep_outputs(tmp_path, make_engine):
    """Few blocks and a small token budget: chunks share steps with decodes and sequences are
    preempted and recomputed on the GPU; outputs must not change."""
    path, hf_model = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2, seed=2)
    engine = make_engine(
        path, block_size=4, num_blocks=24, device="cuda", max_num_batched_tokens=24
    )
    prompts = random_prompts([20, 3, 20, 17], hf_model.config.vocab_size, seed=2)
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for prompt, req in zip(prompts, outs):
        assert_same_greedy(
            hf_model, prompt, req.output_token_ids, hf_greedy(hf_model, prompt, NEW_TOKENS)
        )


def test_cuda_seeded_sampling_matches_cpu(tmp_path, make_engine):
    """Random draws happen on the CPU from the GPU's logits: one seed, the same tokens on both
    devices (up to logits that differ in the last bits, which this tiny model's peaky
    distribution keeps from mattering)."""
    path, hf_model = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2, seed=3)
    prompts = random_prompts([9, 30], hf_model.config.vocab_size, seed=3)
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7)
    on_cpu = make_engine(path).generate(prompts, params)
    on_gpu = make_engine(path, device="cuda").generate(prompts, params)
    assert [r.output_token_ids for r in on_gpu] == [r.output_token_ids for r in on_cpu]
