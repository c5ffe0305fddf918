"""Llama-family decoder over a paged KV cache: one forward for prefill and decode alike.

Only the attention metadata tells a prefill chunk from a decode step. Q/K/V and gate/up
projections are fused into single matmuls (one weight read per layer instead of three/two).
The arithmetic order of every op mirrors ``transformers``' Llama so greedy outputs agree.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine import cpu_stack
from engine.config import ModelConfig
from engine.linear import SKINNY_MAX_ROWS, Linear
from kernels import kv_fp8, kv_int8
from kernels.metadata import AttentionMetadata
from kernels.ops import paged_attention, store_kv

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k_cache, v_cache)
LayerCallback = Callable[[int], None]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op: x * rsqrt(mean(x^2) + eps) * weight, as transformers computes it.
        return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once (same arithmetic as transformers)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] for a batch: looked up once per forward, used by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, rope_tables, meta: AttentionMetadata, kv, bf16=False) -> torch.Tensor:
        """``bf16``: the batch multiplies in bf16 (LlamaModel.gemm_dtype_for), attention too."""
        cfg = self.cfg
        q, k, v = self.qkv_proj(x).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        q, k = apply_rope(q, k, *rope_tables)
        k_cache, v_cache = kv
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta, self.scale, bf16=bf16)
        return self.o_proj(out.reshape(-1, cfg.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, rope_tables, meta, kv, bf16=False) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope_tables, meta, kv, bf16)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    cpu_stack = None  # the C++ decoder layers (engine/cpu_stack.py), set by pack_weights_for_cpu
    prefill_gemm = "fp32"  # many-row matmuls: fp32 | bf16 | int8 (use_prefill_gemm)
    prefill_attention_bf16 = False  # a many-row batch's attention GEMMs in bf16

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(
            cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: KVCache,
        layer_callback: LayerCallback | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm.

        ``layer_callback(i)`` runs right after layer i has written its KV for this batch: the
        prefill worker uses it to stream that layer's blocks while later layers compute.
        """
        h = self.embed_tokens(input_ids)
        rope_tables = self.rope.tables(positions)
        # The C++ layers take fp32 rows (int8 ones quantize inside the matmul): bf16 batches
        # run the Python layers.
        gemm = self.gemm_dtype_for(len(input_ids))
        bf16_attention = gemm != "fp32" and self.prefill_attention_bf16
        if self.cpu_stack is not None and gemm != "bf16" and cpu_stack.usable(kv_caches):
            h = cpu_stack.run_layers(
                self.cpu_stack, h, rope_tables, meta, kv_caches, self.layers[0].self_attn.scale,
                lambda i, q: paged_attention(
                    q, *kv_caches[i], meta, self.layers[i].self_attn.scale, bf16=bf16_attention
                ),
                layer_callback,
            )  # fmt: skip
            return self.norm(h)
        for i, layer in enumerate(self.layers):
            h = layer(h, rope_tables, meta, kv_caches[i], bf16_attention)
            if layer_callback is not None:
                layer_callback(i)
        return self.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # samplers and logprobs work in fp32

    def pack_weights_for_cpu(self, fused_layers: bool = True) -> int:
        """Pre-pack every linear weight for oneDNN (CPU fp32) and, with ``fused_layers``, run
        the decoder layers as one C++ call (engine/cpu_stack.py); returns how many weights
        were packed.

        The packed copies are extra memory; the plain weights stay (the tied LM head shares the
        embedding, and state dicts keep working)."""
        packed = sum(m.pack_for_cpu() for m in self.modules() if isinstance(m, Linear))
        self.cpu_stack = cpu_stack.build(self) if fused_layers else None
        return packed

    def use_prefill_gemm(self, kind: str, attention_bf16: bool | None = None) -> None:
        """Run matmuls of more than SKINNY_MAX_ROWS rows in ``kind`` (fp32 | bf16 | int8; an
        engine/prefill_gemm.py choice) from now on, their attention with bf16 GEMMs if
        ``attention_bf16`` (default: with bf16 projections only); bf16 keeps a bf16 copy of
        each weight in place of oneDNN's fp32 one, int8 runs the int8-activation kernels."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.set_prefill_gemm(kind)
        self.prefill_gemm = kind
        self.prefill_attention_bf16 = kind == "bf16" if attention_bf16 is None else attention_bf16
        if self.cpu_stack is not None:  # its row limit follows the kind
            self.cpu_stack = cpu_stack.build(self)

    def gemm_dtype_for(self, rows: int) -> str:
        """The precision a batch of ``rows`` tokens multiplies its weights in."""
        return self.prefill_gemm if rows > SKINNY_MAX_ROWS else "fp32"

    def quantize_weights(self, fmt: str, group: int = 32, activations: str = "int8") -> None:
        """Every projection and the LM head in ``fmt`` (kernels/quant.py); call before
        ``pack_weights_for_cpu``. With q4 the LM head (the tied embedding) takes int8, as the
        GGUF files keep their token embedding at 8 bits (Q8_0). ``activations``: how int8 /
        q4 weights multiply decode rows on CPU (engine.config.ACTIVATIONS)."""
        if fmt == "fp32":
            return
        for name, m in self.named_modules():
            if isinstance(m, Linear):
                m.quantize("int8" if fmt == "q4" and name == "lm_head" else fmt, group, activations)

    def weight_bytes_per_step(self) -> int:
        """Bytes of weights a decode step reads: every projection and the LM head as stored
        (embedding rows excluded)."""
        return sum(m.decode_bytes for m in self.modules() if isinstance(m, Linear))

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, dtype=None, kv_dtype: str = "fp32"
    ) -> KVCache:
        """K and V caches per layer; ``kv_dtype`` "int8" ("fp8") stores each token's head as
        int8 (float8_e4m3fn) codes plus its fp32 scale in one row (kernels/kv_int8.py,
        kernels/kv_fp8.py); "fp32": ``dtype``, by default the model's (bf16 for a bf16 model)."""
        head_dim = self.cfg.head_dim
        dtype = dtype or self.embed_tokens.weight.dtype
        if kv_dtype == "int8":
            dtype, head_dim = torch.int8, kv_int8.row_width(head_dim)
        if kv_dtype == "fp8":
            dtype, head_dim = kv_fp8.DTYPE, kv_fp8.row_width(head_dim)
        shape = (num_blocks, block_size, self.cfg.num_kv_heads, head_dim)
        device = self.embed_tokens.weight.device
        return [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(self.cfg.num_layers)
        ]
