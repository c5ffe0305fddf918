"""Read a checkpoint's config and load its weights into ``LlamaModel``."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine import prefill_gemm as prefill_precision
from engine.config import (
    ModelConfig,
    check_activations,
    check_device_name,
    check_int8_prefill,
    check_load_format,
    check_prefill_gemm,
    resolve_dtype,
)
from engine.errors import ModelNotFoundError
from engine.model import LlamaModel
from engine.model_files import EMBEDDED_GGUF, EMBEDDED_MODEL, embedded_gguf_path, resolve_model_dir
from engine.tensor_parallel import TPShard, read_hf_shard

__all__ = [
    "EMBEDDED_GGUF",
    "EMBEDDED_MODEL",
    "embedded_gguf_path",
    "load_config",
    "load_model",
    "resolve_device",
    "resolve_model_dir",
]


def load_config(model_dir: Path) -> ModelConfig:
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelNotFoundError(f"cannot read {model_dir / 'config.json'}: {e}") from e
    return ModelConfig.from_hf_dict(raw)


def resolve_device(device: str) -> str:
    """ "auto" -> "cuda" where a GPU is visible (a Ray actor sees only the GPUs it asked for),
    else "cpu". "cuda:N" names one GPU."""
    kind = check_device_name(device).partition(":")[0]
    if kind == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: no CUDA device is visible to this process")
    return device


def load_model(
    model_dir: Path,
    cfg: ModelConfig,
    max_positions: int | None = None,
    device: str = "cpu",
    weights: str = "fp32",
    weight_group: int = 32,
    prefill_gemm: str = "auto",
    activations: str = "int8",
    load_format: str = "auto",
    shard: TPShard | None = None,
    dtype: str = "auto",
) -> LlamaModel:
    """Weights on ``device``, stored as ``weights`` (fp32 | bf16 | int8 | q4, quantized at load
    from fp32; kernels/quant.py); on the CPU also pre-packed for oneDNN and the C++ layers.
    ``prefill_gemm`` (fp32 | bf16 | int8 | auto): the precision of prefill's many-row matmuls
    (engine/prefill_gemm.py; auto keeps fp32 weights fp32). ``activations`` (int8 | fp32): how
    int8 / q4 weights multiply a decode step's rows on CPU (engine.config.ACTIVATIONS).
    ``load_format`` "dummy": random weights of ``cfg``'s shape, made on ``device`` (no files).
    ``shard``: one rank of tensor parallelism (engine/tensor_parallel.py): only its slices are
    read (dummy: made whole one tensor at a time and cut, the same values as TP=1), and its
    decoder layers run per layer (the fused C++ stack has no place for the all-reduces).
    ``dtype`` (engine.config.DTYPES; auto: bf16 on CUDA): a bf16 model casts every float
    weight and buffer after quantizing from fp32, and runs its activations and float KV cache
    in bf16; it has no CPU packing or prefill-GEMM copies (those are fp32 machinery)."""
    check_prefill_gemm(prefill_gemm)
    check_activations(activations)
    check_int8_prefill(prefill_gemm, weights, activations)
    device = resolve_device(device)
    if check_load_format(load_format) == "dummy":
        model = dummy_model(cfg, max_positions, device, shard=shard)
    else:
        model = _checkpoint_model(model_dir, cfg, max_positions, shard).float().eval().to(device)
    model.quantize_weights(weights, weight_group, activations)
    if resolve_dtype(dtype, device) == "bf16":
        return model.to(torch.bfloat16)
    gemm = prefill_precision.choose(prefill_gemm, weights, device)
    model.use_prefill_gemm(gemm, prefill_precision.attention_bf16(gemm, weights))
    if model.embed_tokens.weight.device.type == "cpu":
        model.pack_weights_for_cpu(fused_layers=shard is None or shard.size == 1)
    return model


def _checkpoint_model(
    model_dir: Path, cfg: ModelConfig, max_positions: int | None, shard: TPShard | None = None
) -> LlamaModel:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no .safetensors weights in {model_dir}")
    hf: dict[str, torch.Tensor] = {}
    if shard is not None and shard.size > 1:
        hf = read_hf_shard(files, cfg, shard)
        cfg = shard.local_config(cfg)
    else:
        for f in files:
            hf.update(load_file(str(f)))
    with torch.device("meta"):
        model = LlamaModel(cfg, max_positions)
    model.load_state_dict(fuse_hf_state_dict(hf, cfg), assign=True, strict=False)
    _real_buffers(model, cfg, max_positions)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    _check_loaded(model)
    return model


def dummy_model(
    cfg: ModelConfig,
    max_positions: int | None,
    device: str,
    seed: int = 0,
    shard: TPShard | None = None,
) -> LlamaModel:
    """Random fp32 weights of ``cfg``'s shape, allocated on ``device`` at once (an 8B model
    never passes through host memory): projections and embeddings N(0, 0.02), as Hugging Face
    initialises Llama, and norms 1, so activations keep a trained model's scale and a step
    costs what it would. A ``shard`` makes each whole tensor in turn and keeps its slice."""
    local = cfg if shard is None else shard.local_config(cfg)
    with torch.device("meta"):
        whole = LlamaModel(cfg, max_positions)
        model = LlamaModel(local, max_positions) if shard is not None else whole
    model = model.to_empty(device=device).eval()
    if cfg.tie_word_embeddings:  # to_empty gives each module its own tensor: tie them again
        model.lm_head.weight = model.embed_tokens.weight
    gen = torch.Generator(device=device).manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in whole.named_parameters():  # a tied head is listed once
            t = params[name] if shard is None else torch.empty(p.shape, device=device)
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            elif name.endswith("bias"):
                t.zero_()
            else:
                t.normal_(0.0, 0.02, generator=gen)
            if shard is not None:
                params[name].copy_(shard.shard_fused(name, t, cfg))
    _real_buffers(model, local, max_positions)
    return model.to(device)


def _real_buffers(model: LlamaModel, cfg: ModelConfig, max_positions: int | None) -> None:
    # Buffers (RoPE tables) were created on meta: rebuild them for real.
    model.rope = type(model.rope)(
        cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta
    )


def fuse_hf_state_dict(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Map Hugging Face Llama names to ours, concatenating Q/K/V and gate/up."""
    out = {
        "embed_tokens.weight": hf["model.embed_tokens.weight"],
        "norm.weight": hf["model.norm.weight"],
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = hf["lm_head.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[f"layers.{i}.self_attn.qkv_proj.weight"] = torch.cat(
            [hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"]]
        )
        if cfg.qkv_bias:
            out[f"layers.{i}.self_attn.qkv_proj.bias"] = torch.cat(
                [hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"]]
            )
        out[f"layers.{i}.self_attn.o_proj.weight"] = hf[a + "o_proj.weight"]
        out[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(
            [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]
        )
        out[f"layers.{i}.mlp.down_proj.weight"] = hf[p + "mlp.down_proj.weight"]
        out[f"layers.{i}.input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        out[f"layers.{i}.post_attention_layernorm.weight"] = hf[
            p + "post_attention_layernorm.weight"
        ]
    return {k: v.float().contiguous() for k, v in out.items()}


def _check_loaded(model: LlamaModel) -> None:
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelNotFoundError(f"checkpoint lacks weights: {missing[:5]}")
