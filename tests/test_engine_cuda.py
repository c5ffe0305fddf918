"""The engine on a CUDA device beyond greedy equality (that is in test_engine_greedy_tiny,
parametrized by device): seeded sampling gives the CPU's tokens."""

from __future__ import annotations

import pytest
import torch

from engine.request import SamplingParams
from kernels import ops
from tests.conftest import tiny_llama_dir
from tests.test_engine_greedy_tiny import random_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not ops.TRITON_AVAILABLE, reason="Triton is not installed"),
]


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
