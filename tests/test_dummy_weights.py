"""``load_format: dummy``: random weights of a model's shape from its config.json alone, for
profiles and benchmarks of a model whose weights are not on this machine (vLLM's
``--load-format dummy``)."""

from __future__ import annotations

import json

import pytest
import torch

from engine.errors import ModelNotFoundError
from engine.llm_engine import build_engine
from engine.request import SamplingParams
from engine.settings import EngineSettings
from pdserve.cli import main
from pdserve.config import ConfigError, validate_config
from pdserve.planner.measure import FULL, GPU, QUICK, grid_for
from pdserve.planner.profile import load_profile
from tests.conftest import tiny_llama_dir

TINY_SHAPE = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


@pytest.fixture
def shape_dir(tmp_path):
    """A model folder holding config.json and nothing else."""
    path = tmp_path / "shape"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY_SHAPE))
    return path


def dummy_engine(path, **kw):
    return build_engine(
        EngineSettings(model=str(path), device="cpu", load_format="dummy", num_blocks=32, **kw)
    )


def test_dummy_weights_have_the_configs_shape_and_a_trained_models_scale(shape_dir):
    model = dummy_engine(shape_dir).runner.model
    assert model.embed_tokens.weight.shape == (256, 64)
    assert model.lm_head.weight is model.embed_tokens.weight  # tied, as config.json says
    assert len(model.layers) == 2
    qkv = model.layers[0].self_attn.qkv_proj.weight
    assert qkv.shape == ((4 + 2 + 2) * 16, 64)
    assert abs(qkv.std().item() - 0.02) < 0.002
    assert torch.equal(model.norm.weight, torch.ones(64))
    assert not any(p.is_meta for p in model.parameters())


def test_dummy_weights_are_seeded_and_decode_like_a_checkpoint(shape_dir):
    prompt = [[3, 4, 5, 6, 7]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first = dummy_engine(shape_dir).generate(prompt, params)[0].output_token_ids
    again = dummy_engine(shape_dir).generate(prompt, params)[0].output_token_ids
    assert first == again and len(first) == 6
    q4 = dummy_engine(shape_dir, weights="q4", kv_dtype="int8").generate(prompt, params)
    assert len(q4[0].output_token_ids) == 6  # quantized at load as a checkpoint's would be


def test_a_config_only_folder_needs_dummy(shape_dir):
    with pytest.raises(ModelNotFoundError, match="no .safetensors"):
        build_engine(EngineSettings(model=str(shape_dir), device="cpu", num_blocks=32))


def test_dummy_weights_of_a_checkpoints_shape_count_the_same_parameters(tmp_path):
    path, _ = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2)
    real = build_engine(EngineSettings(model=str(path), device="cpu", num_blocks=32))
    fake = build_engine(
        EngineSettings(model=str(path), device="cpu", num_blocks=32, load_format="dummy")
    )
    shapes = {n: p.shape for n, p in real.runner.model.named_parameters()}
    assert {n: p.shape for n, p in fake.runner.model.named_parameters()} == shapes


def test_the_config_names_a_bad_load_format():
    with pytest.raises(ConfigError, match="load_format"):
        validate_config({"load_format": "random"})
    assert validate_config({"load_format": "dummy"}).load_format == "dummy"


def test_a_worker_process_command_line_carries_the_load_format(shape_dir):
    """The local harness starts worker processes from engine_args: dummy must survive it (else
    a worker looks for weights the folder does not have)."""
    import argparse

    from engine.args import add_engine_args, engine_args, engine_settings_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    s = EngineSettings(model=str(shape_dir), load_format="dummy", tensor_parallel_size=2)
    assert engine_settings_from_args(parser.parse_args(engine_args(s))) == s


def test_profile_of_a_shape_without_weights(shape_dir, tmp_path):
    cfg = tmp_path / "shape.yaml"
    cfg.write_text(f"model: {shape_dir}\nmax_model_len: 256\nnum_blocks: 128\n")
    out = tmp_path / "profile.json"
    argv = ["profile", "--config", str(cfg), "--load-format", "dummy", "--out", str(out)]
    assert main([*argv, "--quick", "--no-progress"]) == 0
    prof = load_profile(out)
    assert prof.meta["model_shape"]["hidden_size"] == 64
    assert prof.engine.load_format == "dummy"
    assert prof.decode_seconds(4, 64) > 0


def test_each_device_profiles_its_own_grid():
    assert grid_for("cpu") is FULL and grid_for("cuda") is GPU and grid_for("cuda:1") is GPU
    assert grid_for("cuda", quick=True) is QUICK
    # A GPU serves longer prompts and bigger batches than the CPU grid reaches.
    assert max(GPU.prefill_tokens) > max(FULL.prefill_tokens)
    assert max(GPU.batches) > max(FULL.batches)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dummy_weights_are_made_on_the_gpu(shape_dir):
    engine = build_engine(
        EngineSettings(model=str(shape_dir), device="cuda", load_format="dummy", num_blocks=32)
    )
    assert engine.runner.model.embed_tokens.weight.is_cuda
    out = engine.generate([[3, 4, 5]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].output_token_ids) == 4
