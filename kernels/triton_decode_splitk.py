"""Decode paged attention split over the context (flash-decoding), for when one program per
(sequence, KV head) leaves the GPU mostly idle: batch 1 of an 8B model is 8 programs on a
132-SM H100.

Two kernels. The first runs one program per (sequence, KV head, split); each reads only its
slice of the context, once for all the query heads that share the KV head (GQA rows of one
tile, as in kernels/triton_kernels.py's single-pass kernel), and writes the slice's running
max, softmax sum and unnormalised accumulator (fp32). The second, one program per (sequence,
KV head), rescales the splits to the common max and divides once. A split past a sequence's
end (shorter sequences in a batch sized for the longest) writes max = -inf and sum = 0, which
the reduction weights by exp2(-inf) = 0.

How many splits: ``choose_num_splits`` (documented there). Importing this module needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import kv_fp8
from kernels.metadata import AttentionMetadata
from kernels.triton_fp8 import fp8_keys_and_values

# Programs that keep every SM of an H100/H200 (132 SMs) busy with a few programs each.
TARGET_PROGRAMS = 4 * 132
# A split shorter than this many keys costs more in its partials (write + reduce) and
# launch tail than it gains; a few key tiles per split.
MIN_KEYS_PER_SPLIT = 128
MAX_SPLITS = 64


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    target_programs: int = TARGET_PROGRAMS,
    min_keys_per_split: int = MIN_KEYS_PER_SPLIT,
    max_splits: int = MAX_SPLITS,
) -> int:
    """Splits per (sequence, KV head): enough that batch x KV heads x splits reaches
    ``target_programs``, but no split shorter than ``min_keys_per_split`` keys of the longest
    context, and at most ``max_splits`` (the reduction reads every split's partials). 1 means
    the single-pass kernel: the batch already fills the GPU or the context is short."""
    base_programs = max(1, num_seqs * num_kv_heads)
    wanted = triton.cdiv(target_programs, base_programs)
    by_length = max(1, max_seq_len // min_keys_per_split)
    return max(1, min(wanted, by_length, max_splits))


@triton.jit
def _decode_partial_kernel(
    q_ptr,  # [B, h, d]
    k_cache_ptr,  # [num_blocks, block_size, kvh, d]
    v_cache_ptr,
    m_ptr,  # [B, h, S] fp32 partial maxima (base 2)
    l_ptr,  # [B, h, S] fp32 partial sums
    acc_ptr,  # [B, h, S, d] fp32 unnormalised partial outputs
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    k_scale_ptr,
    v_scale_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_bt,
    stride_sb,
    stride_ss,
    stride_sh,
    block_size,
    keys_per_split,  # a multiple of BLOCK_N
    num_splits,  # not a constexpr: a new split count must not compile a new kernel
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(query_start_loc_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = split * keys_per_split
    hi = tl.minimum(seq_len, lo + keys_per_split)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(
        q_ptr + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):  # empty when the split starts past seq_len
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        blocks = tl.load(
            block_tables_ptr + seq * stride_bt + offs_n // block_size, mask=n_mask, other=0
        )
        kv_offs = (
            blocks.to(tl.int64) * stride_cb
            + (offs_n % block_size) * stride_cs
            + kv_head * stride_ch
        )
        kv_offs = kv_offs[:, None] + offs_d[None, :] * stride_cd
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if KV_FP8:
            scale_offs = blocks.to(tl.int64) * stride_sb + (offs_n % block_size) * stride_ss
            scale_offs += kv_head * stride_sh
            k, v, k_scale = fp8_keys_and_values(
                q, k, v, k_scale_ptr + scale_offs, v_scale_ptr + scale_offs, n_mask
            )
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if KV_FP8:
            qk = qk * k_scale[None, :]
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    part = (seq * NUM_HEADS + heads) * num_splits + split  # [BLOCK_G] rows of m/l
    tl.store(m_ptr + part, m_i, mask=g_mask)
    tl.store(l_ptr + part, l_i, mask=g_mask)
    acc_offs = part[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(acc_ptr + acc_offs, acc, mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_reduce_kernel(
    m_ptr,  # [B, h, S]
    l_ptr,
    acc_ptr,  # [B, h, S, d]
    out_ptr,  # [B, h, d]
    query_start_loc_ptr,
    stride_ot,
    stride_oh,
    stride_od,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,  # num_splits rounded up to a power of two
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + seq)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    rows = (seq * NUM_HEADS + head) * num_splits + offs_s
    m = tl.load(m_ptr + rows, mask=s_mask, other=float("-inf"))
    l_part = tl.load(l_ptr + rows, mask=s_mask, other=0.0)
    acc = tl.load(
        acc_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_max = tl.max(m, 0)  # finite: split 0 always holds key 0
    # Empty splits have m = -inf, so their weight is exp2(-inf) = 0 (and acc, l are 0).
    weight = tl.math.exp2(m - m_max)
    total = tl.sum(l_part * weight, 0)
    out = tl.sum(acc * weight[:, None], 0) / total
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def decode_attention_split_k(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    qk_scale: float,
    num_splits: int,
    block_n: int,
    precision: str,
) -> torch.Tensor:
    """Decode attention over ``num_splits`` slices of the longest context; ``qk_scale`` is the
    softmax scale times log2(e). Returns [B, h, d] in the query's dtype."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    # Each split takes whole key tiles, so only the last split of a sequence has a ragged tile.
    keys_per_split = triton.cdiv(triton.cdiv(meta.max_seq_len, num_splits), block_n) * block_n
    partial = query.new_empty((num_seqs, num_heads, num_splits), dtype=torch.float32)
    m_part, l_part = partial, torch.empty_like(partial)
    acc_part = query.new_empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32)
    assert k_cache.stride() == v_cache.stride()
    k_scales, v_scales, scale_strides = k_cache, v_cache, (0, 0, 0)
    if kv_fp8.is_fp8(k_cache):
        k_scales, v_scales = kv_fp8.scales(k_cache), kv_fp8.scales(v_cache)
        scale_strides = k_scales.stride()
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_partial_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        m_part,
        l_part,
        acc_part,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        k_scales,
        v_scales,
        qk_scale,
        *query.stride(),
        *k_cache.stride(),
        meta.block_tables.stride(0),
        *scale_strides,
        k_cache.shape[1],
        keys_per_split,
        num_splits,
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        PRECISION=precision,
        KV_FP8=kv_fp8.is_fp8(k_cache),
    )
    _decode_reduce_kernel[(num_seqs, num_heads)](
        m_part,
        l_part,
        acc_part,
        out,
        meta.query_start_loc,
        *out.stride(),
        num_splits,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=block_d,
    )
    return out
