"""The int8 KV cache: one fp32 scale per token and KV head, stored inside the cache row.

An int8 cache is ``[num_blocks, block_size, num_kv_heads, head_dim + 4]`` int8: a token's head
is its ``head_dim`` codes, q = round(x / scale) in -127..127 with scale = max |x| / 127, then the
scale's 4 bytes. Keeping the scale in the row keeps every block-wise path unchanged: block
copies, forks, and the KV transfer, whose frames carry a cache's blocks as they are (dtype
int8, shape ending in head_dim + 4), scales included. A token of SmolLM2-135M is 12,240 bytes
of KV instead of 46,080 (3.8x fewer).

``quantize`` is the format's definition: the fused C++ decoder layers write their rows with
``quantize_kv_row`` (kernels/csrc/paged_decode_int8_cpu.cpp), which computes the same bytes (the
same max, an IEEE division, round half to even), so a cache written by either path reads the
same everywhere (tests/test_cpu_stack.py checks it byte for byte).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one fp32 per token and head


def is_int8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def row_width(head_dim: int) -> int:
    """The last dimension of an int8 cache."""
    return head_dim + SCALE_BYTES


def head_dim_of(cache: torch.Tensor) -> int:
    return cache.shape[-1] - SCALE_BYTES if is_int8(cache) else cache.shape[-1]


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] float -> [..., head_dim + 4] int8 rows (codes, then the scale's bytes)."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30) / 127.0
    codes = torch.round(x / scale).clamp(-127, 127).to(torch.int8)
    return torch.cat([codes, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize(rows: torch.Tensor) -> torch.Tensor:
    """[..., head_dim + 4] int8 rows -> [..., head_dim] fp32."""
    codes = rows[..., :-SCALE_BYTES].float()
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return codes * scale


def as_float(cache_rows: torch.Tensor) -> torch.Tensor:
    """Gathered cache rows as fp32, whatever the cache dtype."""
    return dequantize(cache_rows) if is_int8(cache_rows) else cache_rows.float()
