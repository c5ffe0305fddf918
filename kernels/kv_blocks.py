"""Dispatch for the KV transfer's block copies: gather into a frame payload, scatter into a cache.

On CPU caches the C++ extension copies block by block with memcpy, and the gather computes
the payload's CRC-32C in the same pass (kv_blocks_cpu.cpp); elsewhere (CUDA caches, no
compiler) torch's index ops copy and the CRC is left to the caller (``None``). Both give the
same bytes.
"""

from __future__ import annotations

import torch

from kernels import cpu_extension, kv_fp8


def _extension_for(*tensors: torch.Tensor):
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return None
    return cpu_extension.load()


def gather_kv_blocks(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: list[int]
) -> tuple[torch.Tensor, int | None]:
    """``[2, n, block_size, ...]`` on CPU: K then V of ``block_ids``, one copy out of the cache;
    and the payload's CRC-32C when the copy computed it (CPU caches), else None."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=k_cache.device)
    shape, dtype = (2, len(block_ids), *k_cache.shape[1:]), k_cache.dtype
    ext = _extension_for(k_cache, v_cache)
    if ext is not None:
        out = torch.empty(shape, dtype=dtype)
        return out, ext.gather_kv_blocks(k_cache, v_cache, idx, out)
    out = torch.empty(shape, dtype=dtype, device=k_cache.device)
    raw = kv_fp8.as_bytes(out)  # torch's index ops lack float8: fp8 caches move as bytes
    torch.index_select(kv_fp8.as_bytes(k_cache), 0, idx, out=raw[0])
    torch.index_select(kv_fp8.as_bytes(v_cache), 0, idx, out=raw[1])
    return out.cpu(), None


def scatter_kv_blocks(
    kv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: list[int]
) -> None:
    """Write ``kv`` ``[2, n, block_size, ...]`` into the caches' ``block_ids``."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=k_cache.device)
    ext = _extension_for(kv, k_cache, v_cache)
    if ext is not None:
        ext.scatter_kv_blocks(kv, k_cache, v_cache, idx)
        return
    kv = kv_fp8.as_bytes(kv.to(k_cache.device))  # fp8 as bytes: no float8 index_copy_
    kv_fp8.as_bytes(k_cache).index_copy_(0, idx, kv[0])
    kv_fp8.as_bytes(v_cache).index_copy_(0, idx, kv[1])
