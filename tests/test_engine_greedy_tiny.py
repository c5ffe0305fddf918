"""Greedy output equals transformers' on random tiny Llamas (MHA/GQA, block sizes 1/16/32), on
the CPU and, with ``-m gpu``, on CUDA (attention and KV writes through the Triton kernels)."""

from __future__ import annotations

import pytest
import torch

from engine.request import SamplingParams
from kernels import ops
from tests import cpu_variants
from tests.conftest import tiny_llama_dir
from tests.greedy import assert_same_greedy, hf_greedy

NEW_TOKENS = 20

ON_CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        pytest.mark.skipif(not ops.TRITON_AVAILABLE, reason="Triton is not installed"),
    ],
)
DEVICES = pytest.mark.parametrize("device", ["cpu", ON_CUDA])
cpu_variant = cpu_variants.cpu_variant  # fixture: each CPU kernel build, then the torch path


def boundary_lengths(block_size: int) -> list[int]:
    """Prompt lengths that end exactly on, and one past, a block boundary (plus a short one)."""
    return [block_size, block_size + 1, 2 * block_size, 2 * block_size + 1, 5]


def random_prompts(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 2)], ids=["mha", "gqa2", "gqa3"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("chunk", [0, 16], ids=["whole", "chunk16"])
@DEVICES
def test_tiny_greedy_matches_transformers(
    tmp_path, make_engine, heads, kv_heads, block_size, chunk, device
):
    path, hf_model = tiny_llama_dir(tmp_path, num_heads=heads, num_kv_heads=kv_heads)
    engine = make_engine(
        path,
        block_size=block_size,
        num_blocks=4096 // block_size,
        prefill_chunk_size=chunk,
        device=device,
    )
    assert engine.runner.kv_caches[0][0].device.type == device
    prompts = random_prompts(boundary_lengths(block_size), hf_model.config.vocab_size)
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = engine.generate(prompts, params)
    for prompt, req in zip(prompts, outs):
        assert_same_greedy(
            hf_model, prompt, req.output_token_ids, hf_greedy(hf_model, prompt, NEW_TOKENS)
        )


@pytest.mark.parametrize(
    "heads,kv_heads,block_size,chunk", [(4, 2, 16, 0), (6, 2, 32, 16)], ids=["gqa2", "gqa3-chunk16"]
)
def test_greedy_matches_transformers_with_every_cpu_kernel_variant(
    tmp_path, make_engine, cpu_variant, heads, kv_heads, block_size, chunk
):
    """Token-exact with the AVX-512 build, the AVX2 build and the torch path alike."""
    path, hf_model = tiny_llama_dir(tmp_path, num_heads=heads, num_kv_heads=kv_heads)
    engine = make_engine(
        path, block_size=block_size, num_blocks=4096 // block_size, prefill_chunk_size=chunk
    )
    assert (engine.runner.model.cpu_stack is None) == (cpu_variant == "torch")
    prompts = random_prompts(boundary_lengths(block_size), hf_model.config.vocab_size)
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    for prompt, req in zip(prompts, engine.generate(prompts, params)):
        assert_same_greedy(
            hf_model, prompt, req.output_token_ids, hf_greedy(hf_model, prompt, NEW_TOKENS)
        )


@DEVICES
def test_small_token_budget_mixes_prefill_chunks_with_decodes(tmp_path, make_engine, device):
    """A budget smaller than the prompts forces chunks of one prompt to share steps with
    decodes of another; outputs must not change."""
    path, hf_model = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2, seed=1)
    engine = make_engine(path, block_size=16, max_num_batched_tokens=24, device=device)
    prompts = random_prompts([3, 40, 70, 17], hf_model.config.vocab_size, seed=1)
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = engine.generate(prompts, params)
    for prompt, req in zip(prompts, outs):
        assert_same_greedy(
            hf_model, prompt, req.output_token_ids, hf_greedy(hf_model, prompt, NEW_TOKENS)
        )


@DEVICES
def test_preemption_by_recompute_keeps_outputs(tmp_path, make_engine, device):
    """Too few blocks for every sequence at once: some are preempted and recomputed."""
    path, hf_model = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2, seed=2)
    engine = make_engine(path, block_size=4, num_blocks=24, device=device)
    prompts = random_prompts([20, 20, 20, 20], hf_model.config.vocab_size, seed=2)
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for prompt, req in zip(prompts, outs):
        assert_same_greedy(
            hf_model, prompt, req.output_token_ids, hf_greedy(hf_model, prompt, NEW_TOKENS)
        )
