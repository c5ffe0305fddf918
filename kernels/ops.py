"""Dispatch: one function per paged-attention op.

``backend="auto"`` runs the Triton kernel on CUDA tensors when Triton is installed and the
torch path otherwise (the production path on CPU). ``"triton"`` and ``"torch"`` force one;
tests force ``"triton"`` on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_extension, kv_fp8, kv_int8
from kernels.metadata import AttentionMetadata

try:
    from kernels import triton_kernels
except ImportError:  # no Triton wheel on this platform: the torch paths still work
    triton_kernels = None

TRITON_AVAILABLE = triton_kernels is not None
BACKENDS = ("auto", "triton", "torch")


def kernel_backend(device: torch.device | str, backend: str = "auto") -> str:
    """Which implementation ``backend`` resolves to for tensors on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
    if backend == "triton" and not TRITON_AVAILABLE:
        raise RuntimeError("backend='triton' requested but Triton is not installed")
    if backend == "auto":
        is_cuda = torch.device(device).type == "cuda"
        return "triton" if is_cuda and TRITON_AVAILABLE else "torch"
    return backend


def _triton(x: torch.Tensor, cache: torch.Tensor, backend: str) -> bool:
    """Whether the Triton kernels run: they read float and fp8 caches, so int8 caches (the
    torch path dequantizes them) never go there."""
    chosen = kernel_backend(x.device, backend) == "triton"
    if chosen and kv_int8.is_int8(cache):
        if backend == "triton":
            raise ValueError("the Triton kernels read float KV caches, not int8")
        return False
    return chosen


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str = "auto",
) -> None:
    """Write key/value [T, kvh, d] into the paged caches at ``slot_mapping`` (-1 skips)."""
    if _triton(key, k_cache, backend):
        triton_kernels.store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
        return
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if kv_int8.is_int8(k_cache):  # rows of codes + scale (kernels/kv_int8.py)
        key, value = kv_int8.quantize(key), kv_int8.quantize(value)
    if kv_fp8.is_fp8(k_cache):  # the same rows in fp8 (kernels/kv_fp8.py)
        key, value = kv_fp8.quantize(key), kv_fp8.quantize(value)
    kv_heads, head_dim = k_cache.shape[2:]
    for cache, x in ((k_cache, key), (v_cache, value)):
        rows = kv_fp8.as_bytes(cache).view(-1, kv_heads, head_dim)  # no float8 index_copy_
        rows.index_copy_(0, slot_mapping, kv_fp8.as_bytes(x.to(cache.dtype)))


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    backend: str = "auto",
    bf16: bool = False,
) -> torch.Tensor:
    """Causal attention of query [T, h, d] over the paged cache, for any batch. ``bf16``: a
    bf16 prefill's batch (engine/model.py gemm_dtype_for): the CPU kernel's prompt GEMMs take
    bf16 operands; decode rows and other backends are unchanged."""
    if meta.is_decode_only:
        return decode_attention(query, k_cache, v_cache, meta, scale, backend=backend)
    return prefill_attention(query, k_cache, v_cache, meta, scale, backend=backend, bf16=bf16)


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    backend: str = "auto",
    bf16: bool = False,
) -> torch.Tensor:
    """Variable-length causal attention; each chunk also sees its sequence's cached prefix."""
    if _triton(query, k_cache, backend):
        return triton_kernels.prefill_attention_triton(query, k_cache, v_cache, meta, scale)
    return _prefill_torch(query, k_cache, v_cache, meta, scale, bf16)


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    backend: str = "auto",
) -> torch.Tensor:
    """One query token per sequence ([B, h, d]) attending to its whole cached context."""
    if _triton(query, k_cache, backend):
        return triton_kernels.decode_attention_triton(query, k_cache, v_cache, meta, scale)
    return _decode_torch(query, k_cache, v_cache, meta.block_tables, meta.seq_lens_cpu, scale)


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """Positions 0..length-1 (rounded up to whole blocks) of each table row: [b, n, kvh, d].

    Whole blocks are copied rather than single slots: far fewer, larger rows to index.
    """
    block_size, kv_heads, head_dim = cache.shape[1:]
    num_blocks = -(-length // block_size)
    blocks = block_tables[:, :num_blocks].reshape(-1).long()
    gathered = kv_fp8.as_bytes(cache).index_select(0, blocks).view(cache.dtype)
    return gathered.view(block_tables.shape[0], num_blocks * block_size, kv_heads, head_dim)


def _as_float(rows: torch.Tensor) -> torch.Tensor:
    """Gathered cache rows as fp32, whatever the cache dtype (fp32, int8 or fp8 rows)."""
    return kv_fp8.dequantize(rows) if kv_fp8.is_fp8(rows) else kv_int8.as_float(rows)


def _prefill_torch(query, k_cache, v_cache, meta, scale, bf16=False):
    """Per-sequence causal attention (the C++ kernel on CPU fp32, its GEMMs in bf16 with
    ``bf16``; else SDPA over gathered K/V); single-token rows of a mixed batch go batched
    through the decode path."""
    out = torch.empty_like(query)
    starts = meta.query_start_loc.tolist()
    decode_rows = [i for i, q_len in enumerate(meta.query_lens_cpu) if q_len == 1]
    if decode_rows:
        rows = torch.tensor(decode_rows, device=query.device)
        tokens = torch.tensor([starts[i] for i in decode_rows], device=query.device)
        seq_lens = [meta.seq_lens_cpu[i] for i in decode_rows]
        tables = meta.block_tables.index_select(0, rows)
        out[tokens] = _decode_torch(query[tokens], k_cache, v_cache, tables, seq_lens, scale)
    ext = _cpu_prefill_extension(query, k_cache)
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if q_len <= 1:
            continue
        rows = slice(starts[i], starts[i] + q_len)
        if ext is not None and q_len >= CPU_PREFILL_KERNEL_MIN_ROWS:
            out[rows] = ext.prefill_causal_attention(
                query[rows], k_cache, v_cache, meta.block_tables[i], seq_len, scale, bf16
            )
            continue
        table = meta.block_tables[i : i + 1]
        k = _as_float(_gather_blocks(k_cache, table, seq_len)[:, :seq_len]).transpose(1, 2)
        v = _as_float(_gather_blocks(v_cache, table, seq_len)[:, :seq_len]).transpose(1, 2)
        q = query[starts[i] : starts[i] + q_len].transpose(0, 1).unsqueeze(0)
        o = _sdpa_causal(q, k, v, scale)
        out[starts[i] : starts[i] + q_len] = o[0].transpose(0, 1)
    return out


# Sequences with at least this many query rows go to the CPU extension's causal kernel (GQA
# group stacked per KV head, two GEMMs per query tile): it was as fast as torch's flash
# attention or faster from 128 tokens on (not measured below). `pdserve bench attention` raises
# it to time torch's kernel on the same inputs.
CPU_PREFILL_KERNEL_MIN_ROWS = 2


def _sdpa_causal(q, k, v, scale):
    """SDPA with the causal diagonal aligned bottom-right: query j sits at S - Q + j."""
    q_len, seq_len = q.shape[2], k.shape[2]
    dtype = q.dtype
    q, k, v = q.float(), k.float(), v.float()
    gqa = q.shape[1] != k.shape[1]
    if q_len == seq_len:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device)
        mask = mask.tril(diagonal=seq_len - q_len)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o.to(dtype)


def _cpu_extension(query: torch.Tensor, k_cache: torch.Tensor):
    """The C++ decode kernel where it applies (CPU, fp32, contiguous cache), else None."""
    if query.device.type != "cpu" or query.dtype != torch.float32 or k_cache.dtype != torch.float32:
        return None
    if not k_cache.is_contiguous():
        return None
    return cpu_extension.load()


def _cpu_prefill_extension(query: torch.Tensor, k_cache: torch.Tensor):
    """The C++ prefill kernel where it applies: CPU, fp32 query, a contiguous fp32 or int8 cache
    (int8 rows are dequantized as the kernel gathers each sequence's keys and values)."""
    if kv_int8.is_int8(k_cache):
        return _cpu_extension_int8(query, k_cache)
    return _cpu_extension(query, k_cache)


def _cpu_extension_int8(query: torch.Tensor, k_cache: torch.Tensor):
    """The C++ int8 decode kernel where it applies (CPU, fp32 query, contiguous int8 cache)."""
    if query.device.type != "cpu" or query.dtype != torch.float32:
        return None
    if not kv_int8.is_int8(k_cache) or not k_cache.is_contiguous():
        return None
    return cpu_extension.load()


def _decode_torch(query, k_cache, v_cache, block_tables, seq_lens, scale):
    """Batched decode: SDPA over [B, padded_len] gathered keys, padding masked out.

    Padded positions read valid blocks (table padding is block 0) and are masked, so no
    per-sequence loop is needed. With one query token per sequence there is no causal mask,
    so the query heads sharing a KV head become that head's query rows: [B, kvh, group, d].
    That skips both the K/V repeat and SDPA's GQA path, which is slower on CPU.
    """
    batch, num_heads, head_dim = query.shape
    if batch == 0:
        return torch.empty_like(query)
    ext = _cpu_extension(query, k_cache)
    if ext is not None:
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        return ext.paged_decode_attention(query, k_cache, v_cache, block_tables.int(), lens, scale)
    ext = _cpu_extension_int8(query, k_cache)
    if ext is not None:  # int8 rows dequantized in registers
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        return ext.paged_decode_attention_int8(
            query, k_cache, v_cache, block_tables.int(), lens, scale
        )
    num_kv_heads = k_cache.shape[2]
    k = _as_float(_gather_blocks(k_cache, block_tables, max(seq_lens))).transpose(1, 2)
    v = _as_float(_gather_blocks(v_cache, block_tables, max(seq_lens))).transpose(1, 2)
    lens = torch.tensor(seq_lens, device=query.device)
    visible = torch.arange(k.shape[2], device=query.device)[None, :] < lens[:, None]
    q = query.float().reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None, None, :], scale=scale)
    return out.reshape(batch, num_heads, head_dim).to(query.dtype)
