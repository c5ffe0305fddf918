"""Frozen configuration dataclasses: the model's shape and the engine's knobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.errors import UnsupportedModelError
from engine.tensor_parallel import check_tensor_parallel

# model_type -> whether q/k/v projections carry a bias. All are Llama-shaped decoders:
# GQA attention, RoPE, RMSNorm, SwiGLU MLP.
SUPPORTED_MODEL_TYPES = {"llama": False, "mistral": False, "qwen2": True}


DEVICE_KINDS = ("auto", "cpu", "cuda")


def check_device_name(device: str) -> str:
    """Validate a device name (cpu, cuda, cuda:N, auto) without touching any device."""
    kind, sep, index = device.partition(":")
    if kind not in DEVICE_KINDS or (sep and (kind != "cuda" or not index.isdigit())):
        raise ValueError(f"device {device!r}: expected cpu, cuda, cuda:N or auto")
    return device


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """fp32 K and V of one token over every layer: what a transfer ships per token."""
        return 2 * self.num_layers * self.kv_size * 4

    def kv_bytes_per_token_as(self, kv_dtype: str) -> int:
        """K and V of one token over every layer in ``kv_dtype``: int8 and fp8 are head_dim
        codes plus a 4-byte scale per head (kernels/kv_int8.py, kernels/kv_fp8.py)."""
        if kv_dtype in ("int8", "fp8"):
            return 2 * self.num_layers * self.num_kv_heads * (self.head_dim + 4)
        return self.kv_bytes_per_token

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Validate a Hugging Face ``config.json`` dict and keep what the runtime needs."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} (architectures={cfg.get('architectures')}) is not "
                f"supported; supported: {sorted(SUPPORTED_MODEL_TYPES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(
                f"hidden_act {cfg['hidden_act']!r}: only 'silu' is supported"
            )
        rope = cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise UnsupportedModelError(f"rope_scaling type {rope_type!r} is not supported")
        if cfg.get("sliding_window") and cfg.get("use_sliding_window", model_type == "mistral"):
            if cfg["sliding_window"] < cfg.get("max_position_embeddings", 0):
                raise UnsupportedModelError("sliding-window attention is not supported")
        num_heads = cfg["num_attention_heads"]
        theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e4)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=cfg.get("attention_bias", SUPPORTED_MODEL_TYPES[model_type]),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 1024

    @property
    def num_slots(self) -> int:
        return self.block_size * self.num_blocks


@dataclass(frozen=True)
class SchedulerConfig:
    # Token budget of one forward: prefill chunks and decode tokens share it.
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    # A prompt longer than this is prefilled in several chunks; 0 = no chunking beyond budget.
    prefill_chunk_size: int = 0


WEIGHT_FORMATS = ("fp32", "bf16", "int8", "q4")  # kernels/quant.py
WEIGHT_GROUPS = (32, 64)  # q4 group sizes
KV_DTYPES = ("fp32", "int8", "fp8")
# The model's float dtype: its weights (fp32 ones; int8 / q4 dequantize to it), activations
# and a float KV cache (kv_dtype "fp32" then stores this dtype). auto: bf16 on CUDA (tensor
# cores, half the bytes every decode step reads), fp32 on the CPU, whose C++ layers, oneDNN
# packing and skinny kernels take fp32 (bf16 prompts there: prefill_gemm bf16).
DTYPES = ("auto", "fp32", "bf16")
# How int8 / q4 weights multiply a decode step's rows on CPU: int8 quantizes the rows in
# blocks of 32 and multiplies bytes (kernels/csrc/quant_dot_cpu.cpp, llama.cpp's way); fp32
# widens the weights in registers (exact to dequantize-then-matmul). Other weights: fp32.
ACTIVATIONS = ("int8", "fp32")
# The precision of prefill's many-row matmuls (engine/prefill_gemm.py): int8 runs int8 / q4
# weights' rows through decode's int8-activation kernel; auto is the fastest of bf16 and int8
# for quantized weights, on a CPU where it measures faster than fp32.
PREFILL_GEMMS = ("fp32", "bf16", "int8", "auto")
# Where weights come from: auto reads the checkpoint's files; dummy fills them at random from
# config.json alone (vLLM's --load-format dummy): profiles and benchmarks of a model's shape
# whose weights are not on this machine. Its tokens mean nothing.
LOAD_FORMATS = ("auto", "dummy")


def check_weights(weights: str, group: int = 32) -> str:
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights {weights!r}: expected one of {WEIGHT_FORMATS}")
    if group not in WEIGHT_GROUPS:
        raise ValueError(f"weight group {group}: expected one of {WEIGHT_GROUPS}")
    return weights


def check_activations(activations: str) -> str:
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations {activations!r}: expected one of {ACTIVATIONS}")
    return activations


def check_prefill_gemm(prefill_gemm: str) -> str:
    if prefill_gemm not in PREFILL_GEMMS:
        raise ValueError(f"prefill_gemm {prefill_gemm!r}: expected one of {PREFILL_GEMMS}")
    return prefill_gemm


def check_int8_prefill(prefill_gemm: str, weights: str, activations: str) -> None:
    """``prefill_gemm: int8`` multiplies with the int8-activation kernel of int8 / q4 weights."""
    if prefill_gemm == "int8" and (weights not in ("int8", "q4") or activations != "int8"):
        raise ValueError(
            "prefill_gemm 'int8' needs weights int8 or q4 with activations int8, "
            f"not weights {weights!r} with activations {activations!r}"
        )


def check_load_format(load_format: str) -> str:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r}: expected one of {LOAD_FORMATS}")
    return load_format


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {DTYPES}")
    return dtype


def resolve_dtype(dtype: str, device: str) -> str:
    """``dtype`` (auto | fp32 | bf16) for a model on ``device`` (a resolved device name:
    cpu, cuda, cuda:N): auto is bf16 on CUDA and fp32 elsewhere."""
    if check_dtype(dtype) != "auto":
        return dtype
    return "bf16" if check_device_name(device).partition(":")[0] == "cuda" else "fp32"


def check_kv_dtype(kv_dtype: str) -> str:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype {kv_dtype!r}: expected one of {KV_DTYPES}")
    return kv_dtype


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_model_len: int = 2048
    weights: str = "fp32"  # how the weights are stored: fp32 | bf16 | int8 | q4
    weight_group: int = 32  # q4: weights per scale along K
    kv_dtype: str = "fp32"  # the KV cache: fp32 | int8 | fp8 (a scale per token and head)
    prefill_gemm: str = "auto"  # prefill's many-row matmuls: fp32 | bf16 | int8 | auto
    activations: str = "int8"  # int8 / q4 weights' decode rows on CPU: int8 | fp32
    tensor_parallel_size: int = 1  # ranks the model is split over (engine/tensor_parallel.py)

    def __post_init__(self):
        check_weights(self.weights, self.weight_group)
        check_activations(self.activations)
        check_kv_dtype(self.kv_dtype)
        check_prefill_gemm(self.prefill_gemm)
        check_int8_prefill(self.prefill_gemm, self.weights, self.activations)
        check_tensor_parallel(self.model, self.tensor_parallel_size)
        if self.kv_dtype == "fp8" and self.model.head_dim % 4:  # each row's fp32 scale aligned
            raise ValueError(f"kv_dtype fp8 needs head_dim % 4 == 0, not {self.model.head_dim}")
