"""Reference ops: slow, plain torch, written to be obviously correct.

Every fast path (the Triton kernels and the torch CPU path in ``ops``) is tested against these.
"""

from __future__ import annotations

import torch

from kernels import kv_fp8, kv_int8
from kernels.metadata import AttentionMetadata


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, kvh, d] into the caches [blocks, block_size, kvh, d] in place."""
    block_size = k_cache.shape[1]
    if kv_int8.is_int8(k_cache):
        key, value = kv_int8.quantize(key), kv_int8.quantize(value)
    if kv_fp8.is_fp8(k_cache):
        key, value = kv_fp8.quantize(key), kv_fp8.quantize(value)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        k_cache[block, offset] = key[t]
        v_cache[block, offset] = value[t]


def gather_seq_kv(cache: torch.Tensor, block_table: list[int], seq_len: int) -> torch.Tensor:
    """Positions 0..seq_len-1 of one sequence as [seq_len, kvh, d]."""
    block_size = cache.shape[1]
    rows = [cache[block_table[pos // block_size], pos % block_size] for pos in range(seq_len)]
    return torch.stack(rows)


def paged_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of query [T, h, d] over the paged cache; returns [T, h, d]."""
    num_heads = query.shape[1]
    group = num_heads // k_cache.shape[2]
    out = torch.empty_like(query)
    starts = meta.query_start_loc.tolist()
    tables = meta.block_tables.tolist()
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        keys = _as_float(gather_seq_kv(k_cache, tables[i], seq_len))
        values = _as_float(gather_seq_kv(v_cache, tables[i], seq_len))
        for j in range(q_len):
            t = starts[i] + j
            pos = seq_len - q_len + j
            for hq in range(num_heads):
                hk = hq // group
                scores = keys[: pos + 1, hk] @ query[t, hq].float() * scale
                probs = torch.softmax(scores, dim=0)
                out[t, hq] = (probs @ values[: pos + 1, hk]).to(query.dtype)
    return out


def _as_float(rows: torch.Tensor) -> torch.Tensor:
    return kv_fp8.dequantize(rows) if kv_fp8.is_fp8(rows) else kv_int8.as_float(rows)
