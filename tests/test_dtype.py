"""The model's float dtype: ``auto`` resolves to bf16 on CUDA and fp32 on the CPU; the setting
reaches the loader from the CLI flags and the cluster config; a bf16 model (on the CPU here,
on CUDA with ``-m gpu``) keeps its weights, activations and float KV cache in bf16 and its
logits agree with transformers' bf16 forward within BF16_LOGIT_TOLERANCE."""

from __future__ import annotations

import argparse

import pytest
import torch

from engine.args import add_engine_args, engine_args, engine_settings_from_args
from engine.config import CacheConfig, resolve_dtype
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from engine.settings import EngineSettings
from kernels import ops
from kernels.metadata import AttentionMetadata
from tests.conftest import tiny_llama_dir

# Max abs difference of our bf16 logits from transformers' bf16 ones on the tiny models
# (logits up to ~12; a bf16 step there is 0.06): measured 0.07-0.11, where either bf16
# forward differs from the fp32 one by up to 0.8. Order of the ops (fused projections, the
# paged attention's accumulation) is the only difference left.
BF16_LOGIT_TOLERANCE = 0.25


def test_auto_is_bf16_on_cuda_and_fp32_on_the_cpu() -> None:
    assert resolve_dtype("auto", "cuda") == "bf16"
    assert resolve_dtype("auto", "cuda:1") == "bf16"
    assert resolve_dtype("auto", "cpu") == "fp32"
    assert resolve_dtype("fp32", "cuda") == "fp32"  # an explicit dtype wins everywhere
    assert resolve_dtype("bf16", "cpu") == "bf16"
    with pytest.raises(ValueError, match="dtype 'fp16'"):
        resolve_dtype("fp16", "cuda")


def test_dtype_flag_round_trips_through_the_engine_args() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_settings_from_args(parser.parse_args([])).dtype == "auto"
    s = engine_settings_from_args(parser.parse_args(["--dtype", "bf16"]))
    assert s.dtype == "bf16"
    assert engine_settings_from_args(parser.parse_args(engine_args(s))) == s
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "fp16"])


def test_cluster_config_dtype_reaches_both_pools() -> None:
    # Imported here: the GPU run collects this module on images without the serving deps.
    from pdserve.config import ClusterConfig
    from pdserve.settings import settings_from_config

    assert ClusterConfig().dtype == "auto"
    s = settings_from_config(ClusterConfig(dtype="bf16"), "127.0.0.1", "/m")
    assert s.prefill.engine.dtype == "bf16" and s.decode.engine.dtype == "bf16"
    with pytest.raises(ValueError):
        ClusterConfig(dtype="fp16")


def _bf16_engine(path, device: str, dtype: str) -> LLMEngine:
    cache = CacheConfig(block_size=16, num_blocks=64)
    return LLMEngine.from_model_path(path, cache=cache, progress=False, device=device, dtype=dtype)


def _max_logit_error(engine: LLMEngine, hf_bf16, prompts) -> float:
    model, device = engine.runner.model, engine.runner.model.embed_tokens.weight.device
    worst = 0.0
    for prompt in prompts:
        n = len(prompt)
        kv = model.allocate_kv_cache(8, 16)
        meta = AttentionMetadata.build([n], [n], [list(range(8))], 16, device)
        ids = torch.tensor(prompt, device=device)
        logits = model.compute_logits(model(ids, torch.arange(n, device=device), meta, kv))
        assert logits.dtype == torch.float32
        with torch.inference_mode():
            expected = hf_bf16(ids.cpu()[None]).logits[0].float()
        worst = max(worst, (logits.cpu() - expected).abs().max().item())
    return worst


def _check_bf16_engine(tmp_path, device: str, dtype: str) -> None:
    from transformers import LlamaForCausalLM

    path, _ = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2, seed=5)
    engine = _bf16_engine(path, device, dtype)
    model = engine.runner.model
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    hf_bf16 = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (5, 17, 40)]
    assert _max_logit_error(engine, hf_bf16, prompts) <= BF16_LOGIT_TOLERANCE
    out = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [len(r.output_token_ids) for r in out] == [8, 8, 8]
    assert engine.blocks.num_free == engine.blocks.num_total


def test_bf16_engine_on_cpu_matches_transformers_bf16(tmp_path) -> None:
    _check_bf16_engine(tmp_path, "cpu", "bf16")


def test_fp32_stays_the_cpu_default(tmp_path) -> None:
    path, _ = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2, seed=5)
    engine = _bf16_engine(path, "cpu", "auto")
    assert engine.runner.model.embed_tokens.weight.dtype == torch.float32
    assert engine.runner.kv_caches[0][0].dtype == torch.float32
    assert EngineSettings().dtype == "auto"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(not ops.TRITON_AVAILABLE, reason="Triton is not installed")
def test_cuda_defaults_to_bf16_and_matches_transformers_bf16(tmp_path) -> None:
    _check_bf16_engine(tmp_path, "cuda", "auto")
