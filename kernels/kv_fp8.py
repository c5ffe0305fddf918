"""The fp8 KV cache: float8_e4m3fn codes with one fp32 scale per token and KV head, stored
inside the cache row, in the int8 cache's layout (kernels/kv_int8.py).

An fp8 cache is ``[num_blocks, block_size, num_kv_heads, head_dim + 4]`` float8_e4m3fn: a
token's head is its ``head_dim`` codes, q = fp8(x / scale) with scale = max |x| / 448 (e4m3's
largest finite value), then the scale's 4 bytes. As with int8, the scale in the row keeps
block copies, forks and KV transfer frames (dtype "float8_e4m3fn", shape ending in
head_dim + 4) unchanged. e4m3 keeps 3 mantissa bits (relative error up to 2^-4) for entries
down to max|x| / 2^15 (subnormal steps below), where int8 keeps a uniform step of
max|x| / 127: fp8 is finer for a head's small entries and coarser for its largest. Same bytes as int8 (SmolLM2-135M: 12,240 a token, 3.8x fewer than
fp32).

torch lacks some ops for float8 (``index_copy_`` and ``torch.equal`` on CPU, 2.13): the
cache's writers index a uint8 view of it (``as_bytes``), which moves the same bytes.
The Triton kernels (CUDA) read the codes and the scales in place (``scales``); the torch
paths dequantize gathered rows (``dequantize``). On the CPU that torch path is the only one
(no C++ kernel reads fp8): fp8 works there, for tests and clusters that mix CPU and GPU
workers, but int8 (kernels/csrc/paged_decode_int8_cpu.cpp) is the CPU's fast quantized
cache. Needs head_dim % 4 == 0 so that each scale sits 4-byte aligned (engine.config checks).
"""

from __future__ import annotations

import torch

DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
SCALE_BYTES = 4  # one fp32 per token and head


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == DTYPE


def row_width(head_dim: int) -> int:
    """The last dimension of an fp8 cache."""
    return head_dim + SCALE_BYTES


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as uint8 (same storage), for the ops torch lacks for float8; other dtypes
    unchanged."""
    return t.view(torch.uint8) if is_fp8(t) else t


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] float -> [..., head_dim + 4] fp8 rows (codes, then the scale's bytes)."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    # Divided by a tensor, not the Python float: on CUDA torch multiplies by the scalar's
    # reciprocal instead (pytorch#191495), 1 ulp off the correctly rounded quotient the Triton
    # store computes (div_rn); an H200 read 6-9 bytes of the cache differing.
    scale = amax / torch.full_like(amax, FP8_MAX)
    codes = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(DTYPE)
    scale_bytes = scale.contiguous().view(torch.uint8)
    return torch.cat([codes.view(torch.uint8), scale_bytes], dim=-1).view(DTYPE)


def dequantize(rows: torch.Tensor) -> torch.Tensor:
    """[..., head_dim + 4] fp8 rows -> [..., head_dim] fp32."""
    codes = rows[..., :-SCALE_BYTES].float()
    scale = rows[..., -SCALE_BYTES:].clone().view(torch.uint8).view(torch.float32)
    return codes * scale


def scales(cache: torch.Tensor) -> torch.Tensor:
    """The fp32 scales of an fp8 cache, in place: a strided view [num_blocks, block_size,
    num_kv_heads] of the cache's own bytes (what the Triton kernels read and write)."""
    head_dim = cache.shape[-1] - SCALE_BYTES
    assert head_dim % 4 == 0 and cache.stride(-1) == 1, "fp8 caches need head_dim % 4 == 0"
    return cache.view(torch.uint8).view(torch.float32)[..., head_dim // 4]
