"""Triton kernels: KV-cache store, prefill flash attention and decode attention over paged KV.

Shapes: T new tokens in a batch of B sequences, h query heads, kvh KV heads, d head dim,
caches [num_blocks, block_size, kvh, d]. Keys are looked up one by one through the block
table (block id = table[pos // block_size], row = pos % block_size), so a key tile need not
line up with a cache block and any block size works, including 1.

fp8 caches (kernels/kv_fp8.py: float8_e4m3fn codes, each token's head followed by its fp32
scale in the same row) are read and written in place: the codes through the cache itself, the
scales through a strided fp32 view of the same bytes (``kv_fp8.scales``).

Importing this module needs Triton; ``kernels.ops`` guards the import. Under
``TRITON_INTERPRET=1`` (set before this module is imported) the kernels run on CPU tensors.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import kv_fp8
from kernels.metadata import AttentionMetadata
from kernels.triton_decode import _decode_attention_kernel
from kernels.triton_decode_splitk import choose_num_splits, decode_attention_split_k
from kernels.triton_fp8 import fp8_codes, fp8_keys_and_values

LOG2E = 1.4426950408889634


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [T, kvh, d]
    value_ptr,  # [T, kvh, d]
    k_cache_ptr,  # [num_blocks, block_size, kvh, d]
    v_cache_ptr,  # [num_blocks, block_size, kvh, d]
    slot_mapping_ptr,  # [T] int64, -1 = skip
    k_scale_ptr,  # fp8 caches: [num_blocks, block_size, kvh] fp32 views into the caches' rows
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_sb,
    stride_ss,
    stride_sh,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,  # caches of float8_e4m3fn codes + a scale per token and head
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # padding token: nothing to cache
        return
    block = slot // block_size
    row = slot % block_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(
        key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
        mask=mask,
        other=0.0,
    )
    v = tl.load(
        value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
        mask=mask,
        other=0.0,
    )
    dst = block * stride_cb + row * stride_cs + offs_h[:, None] * stride_ch
    dst += offs_d[None, :] * stride_cd
    if KV_FP8:
        scale_dst = block * stride_sb + row * stride_ss + offs_h * stride_sh
        k = fp8_codes(k, k_scale_ptr + scale_dst, offs_h < NUM_KV_HEADS)
        v = fp8_codes(v, v_scale_ptr + scale_dst, offs_h < NUM_KV_HEADS)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _prefill_tiles(
    m_i, l_i, acc, lo, hi,
    q, seq, kv_head, positions, seq_len, offs_d, d_mask, block_tables_ptr, stride_bt,
    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, qk_scale, stride_cb, stride_cs,
    stride_ch, stride_cd, stride_sb, stride_ss, stride_sh, block_size,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    MASKED: tl.constexpr,  # tiles across the diagonal or the end: causal and length masks
):  # fmt: skip
    """Online softmax over key tiles [lo, hi) (lo a multiple of BLOCK_N) of one query tile."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < seq_len  # all true in unmasked tiles (they end before the queries)
        table = block_tables_ptr + seq * stride_bt + offs_n // block_size
        if MASKED:
            blocks = tl.load(table, mask=n_mask, other=0)
        else:
            blocks = tl.load(table)
        kv_offs = (
            blocks.to(tl.int64) * stride_cb
            + (offs_n % block_size) * stride_cs
            + kv_head * stride_ch
        )
        kv_offs = kv_offs[:, None] + offs_d[None, :] * stride_cd
        if MASKED or BLOCK_D != HEAD_DIM:
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        else:
            k = tl.load(k_cache_ptr + kv_offs)
            v = tl.load(v_cache_ptr + kv_offs)
        if KV_FP8:
            scale_offs = blocks.to(tl.int64) * stride_sb + (offs_n % block_size) * stride_ss
            scale_offs += kv_head * stride_sh
            k, v, k_scale = fp8_keys_and_values(
                q, k, v, k_scale_ptr + scale_offs, v_scale_ptr + scale_offs, n_mask
            )

        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if KV_FP8:
            qk = qk * k_scale[None, :]
        if MASKED:
            visible = (offs_n[None, :] <= positions[:, None]) & n_mask[None, :]
            qk = tl.where(visible, qk, float("-inf"))
        # Key lo is visible to every row of the tile, so m_new is finite from the first tile.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


def _prefill_configs() -> list[triton.Config]:
    """Tile shapes the prefill kernel's autotuner times on first use of each head dim and
    dtype set (FlashAttention-2's on H100: 128-row query tiles with 8 warps for head dim
    128; shorter tiles for wide fp32 rows, which would not fit shared memory, and for short
    prompts). A config that does not fit is skipped by the autotuner (OutOfResources). The
    interpreter gets one config: nothing to time on CPU, and each extra one would rerun.
    PDSERVE_PREFILL_AUTOTUNE=0 keeps one config that fits every dtype and head dim (GPU test
    runs, where each new head dim would otherwise compile and time all five)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32})]
    if os.environ.get("PDSERVE_PREFILL_AUTOTUNE") == "0":
        return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=3)]
    shapes = [(128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3), (128, 128, 8, 2)]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=warps, num_stages=stages)
        for m, n, warps, stages in shapes
    ]


# Keyed on the head dim; Triton's autotuner adds every tensor argument's dtype to the key.
# The kernel only writes ``out`` (each config's trial run overwrites it), so timing is safe.
@triton.autotune(configs=_prefill_configs(), key=["HEAD_DIM"])
@triton.jit
def _prefill_attention_kernel(
    q_ptr,  # [T, h, d]
    k_cache_ptr,  # [num_blocks, block_size, kvh, d]
    v_cache_ptr,  # [num_blocks, block_size, kvh, d]
    out_ptr,  # [T, h, d]
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    block_tables_ptr,  # [B, max_blocks] int32
    k_scale_ptr,  # fp8 caches: [num_blocks, block_size, kvh] fp32 views into the caches' rows
    v_scale_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_bt,
    stride_sb,
    stride_ss,
    stride_sh,
    block_size,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,  # caches of float8_e4m3fn codes + a scale per token and head
):
    m_block = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    # The grid is sized for the longest query; shorter sequences have idle tail programs.
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len
    kv_head = head // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    positions = context + offs_m
    row_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_offs = (q_start + offs_m)[:, None] * stride_qt + head * stride_qh
    q = tl.load(
        q_ptr + q_offs + offs_d[None, :] * stride_qd,
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys past the last query row of this tile are causally invisible to all of its rows;
    # keys before its first row are visible to all of them: those tiles need no mask at all
    # (FlashAttention-2's split of the causal loop), only the tiles across the diagonal do.
    hi = tl.minimum(seq_len, context + (m_block + 1) * BLOCK_M)
    full_hi = (context + m_block * BLOCK_M) // BLOCK_N * BLOCK_N
    tile_args = (
        q, seq, kv_head, positions, seq_len, offs_d, d_mask, block_tables_ptr, stride_bt,
        k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, qk_scale, stride_cb, stride_cs,
        stride_ch, stride_cd, stride_sb, stride_ss, stride_sh, block_size,
    )  # fmt: skip
    m_i, l_i, acc = _prefill_tiles(
        m_i, l_i, acc, 0, full_hi, *tile_args, HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION, KV_FP8, False
    )
    m_i, l_i, acc = _prefill_tiles(
        m_i, l_i, acc, full_hi, hi, *tile_args, HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION, KV_FP8, True
    )

    acc = acc / l_i[:, None]
    o_offs = (q_start + offs_m)[:, None] * stride_ot + head * stride_oh
    tl.store(
        out_ptr + o_offs + offs_d[None, :] * stride_od,
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def _tile(n: int) -> int:
    """Power-of-two tile covering n, at least 16 (tl.dot's smallest operand)."""
    return max(16, triton.next_power_of_2(n))


def _precision(dtype: torch.dtype) -> str:
    # TF32 would cost fp32 inputs ~1e-3 relative error; fp16/bf16 ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


def _key_tile(query: torch.Tensor) -> int:
    if not query.is_cuda:
        # The interpreter pays per loop iteration, not per element: larger tiles run faster.
        return 32
    # Pipelined K and V tiles live in shared memory (2 tensors x ~3 stages); 64 rows of
    # 128 fp32 would not fit on A100-class parts, so wide rows get a shorter tile.
    row_bytes = query.shape[-1] * query.element_size()
    return 64 if row_bytes <= 256 else 32


def store_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert k_cache.stride() == v_cache.stride() and value.shape == key.shape
    k_scales, v_scales, scale_strides = _scale_views(k_cache, v_cache)
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scales,
        v_scales,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *scale_strides,
        k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        KV_FP8=kv_fp8.is_fp8(k_cache),
    )


def _scale_views(k_cache: torch.Tensor, v_cache: torch.Tensor):
    """The fp32 scale views of fp8 caches and their strides; for float caches the caches
    themselves stand in (the kernels never read them as scales)."""
    if not kv_fp8.is_fp8(k_cache):
        return k_cache, v_cache, (0, 0, 0)
    k_scales, v_scales = kv_fp8.scales(k_cache), kv_fp8.scales(v_cache)
    assert k_scales.stride() == v_scales.stride()
    return k_scales, v_scales, k_scales.stride()


def _common_args(query, k_cache, v_cache, out, meta, scale):
    assert k_cache.stride() == v_cache.stride()
    k_scales, v_scales, scale_strides = _scale_views(k_cache, v_cache)
    return (
        query,
        k_cache,
        v_cache,
        out,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        k_scales,
        v_scales,
        scale * LOG2E,
        *query.stride(),
        *out.stride(),
        *k_cache.stride(),
        meta.block_tables.stride(0),
        *scale_strides,
        k_cache.shape[1],
    )


def prefill_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    max_query_len, num_seqs = meta.max_query_len, meta.num_seqs

    def grid(config):  # query tiles of the autotuned BLOCK_M
        return (triton.cdiv(max_query_len, config["BLOCK_M"]), num_heads, num_seqs)

    _prefill_attention_kernel[grid](
        *_common_args(query, k_cache, v_cache, out, meta, scale),
        GROUP=num_heads // k_cache.shape[2],
        HEAD_DIM=head_dim,
        BLOCK_D=_tile(head_dim),
        PRECISION=_precision(query.dtype),
        KV_FP8=kv_fp8.is_fp8(k_cache),
    )
    return out


def decode_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """``num_splits`` slices of the context per (sequence, KV head), reduced by a second
    kernel (kernels/triton_decode_splitk.py); None: ``choose_num_splits`` picks, 1 when the
    batch x KV heads already fill the GPU or contexts are short (then one pass, no partials)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if num_splits is None:
        num_splits = choose_num_splits(meta.num_seqs, num_kv_heads, meta.max_seq_len)
    if num_tokens and num_splits > 1:
        qk_scale = scale * LOG2E
        args = (_key_tile(query), _precision(query.dtype))
        return decode_attention_split_k(query, k_cache, v_cache, meta, qk_scale, num_splits, *args)
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    _decode_attention_kernel[(meta.num_seqs, num_kv_heads)](
        *_common_args(query, k_cache, v_cache, out, meta, scale),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=_tile(head_dim),
        BLOCK_G=_tile(group),
        BLOCK_N=_key_tile(query),
        PRECISION=_precision(query.dtype),
        KV_FP8=kv_fp8.is_fp8(k_cache),
    )
    return out
