"""Decode paged attention in one pass: one program per (sequence, KV head), the query heads
that share the KV head as rows of one tile, so each key is read once. Launched by
kernels/triton_kernels.py's ``decode_attention_triton`` when the batch fills the GPU (else
the split-K kernels of kernels/triton_decode_splitk.py). Importing this module needs Triton.
"""

import triton
import triton.language as tl

from kernels.triton_fp8 import fp8_keys_and_values


@triton.jit
def _decode_attention_kernel(
    q_ptr,  # [T, h, d], one token per sequence (T == B)
    k_cache_ptr,  # [num_blocks, block_size, kvh, d]
    v_cache_ptr,  # [num_blocks, block_size, kvh, d]
    out_ptr,  # [T, h, d]
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    block_tables_ptr,  # [B, max_blocks] int32
    k_scale_ptr,  # fp8 caches: [num_blocks, block_size, kvh] fp32 views into the caches' rows
    v_scale_ptr,
    qk_scale,  # softmax scale * log2(e)
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
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,  # query heads of one KV head, padded to a tl.dot-sized tile
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,  # caches of float8_e4m3fn codes + a scale per token and head
):
    # One program per (sequence, KV head): all query heads sharing the KV head ride along as
    # rows of one tile, so each key is read from memory once (decode is bandwidth-bound).
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)

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
    for start_n in range(0, seq_len, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < seq_len
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

    acc = acc / l_i[:, None]
    tl.store(
        out_ptr + token * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
        acc.to(out_ptr.dtype.element_ty),
        mask=g_mask[:, None] & d_mask[None, :],
    )
