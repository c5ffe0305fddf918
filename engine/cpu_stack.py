"""The decoder layers as one C++ call on CPU (fp32 activations; fp32 or int8 KV cache): the same
matmuls, minus the interpreter.

At small batch a decode step is a ~540 MB weight stream around ~120 matmuls; the ~35 small
tensor ops per layer around them cost ~12 ms a step in Python on this machine (20% of the
step). ``kernels/csrc/decoder_stack_cpu.cpp`` runs the same matmuls and fuses the small ops
(RMSNorm, RoPE + cache write, silu * up, residual adds), so hidden states agree with the
Python layers to float rounding (tests/test_cpu_stack.py); the GIL is released throughout.

Decode-only steps without a layer callback run every layer in one call; other batches (prefill
chunks, mixed batches, the prefill worker's per-layer streaming) call the C++ halves of each
layer around the Python attention dispatch.

With ``kv_dtype: int8`` the C++ layers write the cache's int8 rows themselves (the bytes
``kernels.kv_int8.quantize`` writes, so KV transfer frames and the Python layers read the same
cache) and decode attention reads them in registers: int8 KV saves step time, not only bytes.
"""

from __future__ import annotations

import torch

from engine.linear import ONEDNN_MIN_ROWS, SKINNY_MAX_ROWS
from kernels import cpu_extension


def build(model) -> object | None:
    """A C++ ``DecoderStack`` over the model's (already packed) weights, or None where the
    extension is unavailable or the weights are not CPU fp32."""
    weight = model.embed_tokens.weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    ext = cpu_extension.load()
    if ext is None:
        return None
    cfg = model.cfg
    # prefill_gemm int8: every batch's rows go to the int8-activation skinny kernels (where
    # every projection has one; the row limit is the stack's, not per projection).
    all_int8 = all(p.prefill_int8 for layer in model.layers for p in _projections(layer))
    max_skinny_rows = ANY_ROWS if model.prefill_gemm == "int8" and all_int8 else SKINNY_MAX_ROWS
    return ext.DecoderStack(
        [_layer_tuple(layer) for layer in model.layers],
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.rms_norm_eps,
        ONEDNN_MIN_ROWS,
        max_skinny_rows,
    )


ANY_ROWS = 2**62


def _linear_tuple(linear) -> tuple:
    bias = None if linear.bias is None else linear.bias.detach()
    return (linear.weight.detach(), bias, linear.packed, linear.skinny)


def _projections(layer) -> tuple:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _layer_tuple(layer) -> tuple:
    return (
        layer.input_layernorm.weight.detach(),
        layer.post_attention_layernorm.weight.detach(),
        *(_linear_tuple(p) for p in _projections(layer)),
    )


# The cache dtypes the C++ layers write: fp32 rows, or int8 rows with their scale
# (kernels/kv_int8.py; quantized as its store does, attended in registers).
CACHE_DTYPES = (torch.float32, torch.int8)


def usable(kv_caches) -> bool:
    """The C++ layers write contiguous CPU caches of one of ``CACHE_DTYPES``."""
    return all(
        c.device.type == "cpu" and c.dtype in CACHE_DTYPES and c.is_contiguous()
        for pair in kv_caches
        for c in pair
    )


def run_layers(stack, h, rope_tables, meta, kv_caches, scale, attention, layer_callback=None):
    """Every decoder layer through ``stack``; ``attention(i, q)`` attends for layer i when the
    batch is not a plain decode step."""
    cos, sin = rope_tables
    if meta.is_decode_only and layer_callback is None:
        k_caches = [k for k, _ in kv_caches]
        v_caches = [v for _, v in kv_caches]
        return stack.decode(
            h, cos, sin, k_caches, v_caches, meta.slot_mapping,
            meta.block_tables, meta.seq_lens, scale,
        )  # fmt: skip
    for i, (k_cache, v_cache) in enumerate(kv_caches):
        q = stack.attention_input(i, h, cos, sin, k_cache, v_cache, meta.slot_mapping)
        h = stack.attention_output_and_mlp(i, attention(i, q), h)
        if layer_callback is not None:
            layer_callback(i)
    return h
