"""Triton weight-only matmuls for CUDA: ``x @ dequantize(w).T`` with the int8 and q4 weights of
kernels/quant.py, dequantized in registers (the weight is read as its codes and scales only).

Formats as on the CPU (kernels/quant.py), repacked once at load (``pack``):
- int8: the [N, K] int8 codes as they are, the [N] fp32 scale applied once after the sum
  (w = q * scale, so x @ w.T = (x @ q.T) * scale);
- q4: the codes two a byte, ``[N, K // 2]`` uint8, in chunks of ``chunk`` (64, or 32 when 64
  does not divide K) weights along K: byte j of a chunk holds weight j in its low nibble and
  weight j + chunk / 2 in its high one, so a chunk's two halves are two contiguous K ranges
  (two ``tl.dot``s, no interleaving in registers). Each half lies inside one group, so its
  fp16 scales and minimums are one vector over N: quant.py's, transposed to [K // group, N]
  so that a tile's are contiguous; w = q * scale + min.

Activations fp32, fp16 or bf16 (output in x's dtype, fp32 accumulation; fp32 uses exact
"ieee" dots, as kernels/triton_kernels.py, and up to ``FMA_MAX_ROWS`` fp32 rows plain FMAs). The kernels are decode-shaped: few rows
(``MAX_ROWS``), where a matmul reads each weight byte once and the bytes are the cost; the
weight's K range is split over programs (``split_k``, partial sums added after) so that a
one-row matmul still fills the GPU. Larger batches (prefill) go to cuBLAS on the dequantized
weight (engine/linear.py).

Importing this module needs Triton. Under ``TRITON_INTERPRET=1`` (set before the import) the
kernels run on CPU tensors (tests/triton_quant_check.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.quant import QuantizedWeight

MAX_ROWS = 64  # up to this many rows the Triton kernels run; more go to cuBLAS
FMA_MAX_ROWS = 4  # fp32 activations up to this many rows multiply without tl.dot
Q4_CHUNK = 64  # weights along K per packed q4 chunk (32 where 64 does not divide K)


@dataclass(frozen=True)
class PackedWeight:
    """One [N, K] weight packed for the kernels below."""

    format: str  # "int8" | "q4"
    codes: torch.Tensor  # int8: [N, K] int8; q4: [N, K // 2] uint8 (chunk-split nibbles)
    scale: torch.Tensor  # int8: [N] fp32; q4: [K // group, N] fp16
    minimum: torch.Tensor | None  # q4: [K // group, N] fp16
    in_features: int  # K
    group: int = 0  # q4: weights per scale
    chunk: int = 0  # q4: weights per packed chunk

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]


def pack(qw: QuantizedWeight) -> PackedWeight:
    """The kernels' layout of an int8 or q4 weight (on the weight's device)."""
    n, k = qw.q.shape
    if qw.format == "int8":
        return PackedWeight("int8", qw.q.contiguous(), qw.scale.float().contiguous(), None, k)
    if qw.format != "q4":
        raise ValueError(f"no Triton kernel for weights {qw.format!r} (int8, q4)")
    chunk = Q4_CHUNK if k % Q4_CHUNK == 0 else qw.group
    halves = qw.q.view(n, k // chunk, 2, chunk // 2).to(torch.int32)
    codes = (halves[:, :, 0] | (halves[:, :, 1] << 4)).to(torch.uint8).view(n, k // 2)
    scale, minimum = qw.scale.t().contiguous(), qw.minimum.t().contiguous()
    return PackedWeight("q4", codes.contiguous(), scale, minimum, k, qw.group, chunk)


@triton.jit
def _int8_linear_kernel(
    x_ptr,  # [M, K] fp32 / fp16 / bf16
    w_ptr,  # [N, K] int8 codes
    scale_ptr,  # [N] fp32
    out_ptr,  # [SPLIT_K, M, N] fp32 partial sums, or [M, N] in x's dtype when SPLIT_K == 1
    bias_ptr,  # [N] (read only when HAS_BIAS)
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_xk,
    stride_wn,
    stride_os,
    stride_om,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = tl.load(  # [BLOCK_K, BLOCK_N]: codes are exact in every activation dtype
            w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
            mask=k_mask[:, None] & n_mask[None, :],
            other=0,
        )
        acc += _tile_product(x, w, USE_DOT, PRECISION)
    acc *= tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    out_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    _store_tile(acc, out_ptrs, mask, bias_ptr + offs_n, n_mask, HAS_BIAS, SPLIT_K)


@triton.jit
def _q4_linear_kernel(
    x_ptr,  # [M, K] fp32 / fp16 / bf16
    w_ptr,  # [N, K // 2] uint8: chunk-split nibbles (see pack)
    scale_ptr,  # [K // GROUP, N] fp16
    min_ptr,  # [K // GROUP, N] fp16
    out_ptr,  # as _int8_linear_kernel's
    bias_ptr,
    M,
    N,
    K,
    k_per_split,  # a multiple of CHUNK
    stride_xm,
    stride_xk,
    stride_wn,
    stride_sg,
    stride_os,
    stride_om,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    HALF: tl.constexpr = CHUNK // 2
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * k_per_split
    for c0 in range(k_start, tl.minimum(k_start + k_per_split, K), CHUNK):
        b = tl.load(  # [HALF, BLOCK_N] bytes; K is a multiple of CHUNK
            w_ptr + offs_n[None, :] * stride_wn + (c0 // 2 + offs_h)[:, None],
            mask=n_mask[None, :],
            other=0,
        )
        for half in tl.static_range(2):
            k0 = c0 + half * HALF
            group = k0 // GROUP  # a half never straddles two groups (HALF divides GROUP)
            s = tl.load(scale_ptr + group * stride_sg + offs_n, mask=n_mask, other=0.0)
            mn = tl.load(min_ptr + group * stride_sg + offs_n, mask=n_mask, other=0.0)
            q = ((b >> (4 * half)) & 0xF).to(tl.float32)
            w = q * s.to(tl.float32)[None, :] + mn.to(tl.float32)[None, :]
            x = tl.load(
                x_rows + (k0 + offs_h)[None, :] * stride_xk, mask=m_mask[:, None], other=0.0
            )
            acc += _tile_product(x, w, USE_DOT, PRECISION)
    out_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    _store_tile(acc, out_ptrs, mask, bias_ptr + offs_n, n_mask, HAS_BIAS, SPLIT_K)


@triton.jit
def _tile_product(x, w, USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """x [BLOCK_M, k] @ w [k, BLOCK_N] in fp32: a tl.dot (w in x's dtype: int8 codes exactly,
    q4's dequantized values rounded), or broadcast FMAs for a few fp32 rows."""
    if USE_DOT:
        return tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
    else:
        return tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def _store_tile(
    acc, out_ptrs, mask, bias_ptrs, n_mask, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr
):
    """One split's fp32 partial sums, or (no split) the finished tile in the output's dtype."""
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptrs, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptrs, acc, mask=mask)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp16/bf16 ignore the setting


@dataclass(frozen=True)
class _Launch:
    """Tiles, grid and K split of one call."""

    block_m: int
    block_n: int
    block_k: int  # int8 only (q4 steps by its chunk)
    use_dot: bool
    split: int
    k_per_split: int

    def grid(self, rows: int, n: int) -> tuple[int, int, int]:
        return (triton.cdiv(rows, self.block_m), triton.cdiv(n, self.block_n), self.split)


def _launch(x: torch.Tensor, rows: int, w: PackedWeight, split_k: int) -> _Launch:
    # A few fp32 rows multiply with FMAs: an fp32 tl.dot pads the rows to 16 and has no
    # tensor cores, so it would do 16x the work of one row.
    use_dot = not (x.dtype == torch.float32 and rows <= FMA_MAX_ROWS)
    if not use_dot:
        block_m = triton.next_power_of_2(rows)
    else:
        block_m = 16 if rows <= 16 or not x.is_cuda else 32 if rows <= 32 else 64
    block_n = 64 if x.is_cuda else 32  # the interpreter: fewer, smaller programs
    step = _k_step(w)
    block_k = 32 if not use_dot and block_m >= 4 else step  # FMA tiles stay in registers
    split = split_k or default_split_k(x, rows, w, block_m, block_n)
    k_per_split = triton.cdiv(triton.cdiv(w.in_features, split), step) * step
    split = triton.cdiv(w.in_features, k_per_split)  # no empty split
    return _Launch(block_m, block_n, block_k, use_dot, split, k_per_split)


def default_split_k(x: torch.Tensor, rows: int, w: PackedWeight, block_m: int, block_n: int):
    """Splits of K so that about two programs per SM run, each over at least 2 K steps."""
    if not x.is_cuda:
        return 1
    programs = triton.cdiv(rows, block_m) * triton.cdiv(w.out_features, block_n)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    steps = w.in_features // _k_step(w)
    return max(1, min(2 * sms // programs, steps // 2, 16))


def _k_step(w: PackedWeight) -> int:
    return w.chunk if w.format == "q4" else 64


def quant_linear(
    x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None, split_k: int = 0
) -> torch.Tensor:
    """``F.linear(x, dequantize(w), bias)`` for x [..., K]; ``split_k`` 0 chooses."""
    k, n = w.in_features, w.out_features
    assert x.shape[-1] == k, f"x has {x.shape[-1]} features, the weight {k}"
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    run = _launch(x, rows, w, split_k)
    # One split writes the output itself; several write fp32 partial sums, added below.
    out_dtype = x.dtype if run.split == 1 else torch.float32
    out = torch.empty((run.split, rows, n), dtype=out_dtype, device=x.device)
    has_bias = bias is not None and run.split == 1
    args = (x2, w.codes, w.scale) + ((w.minimum,) if w.format == "q4" else ())
    args += (out, bias if has_bias else out, rows, n, k, run.k_per_split, *x2.stride())
    args += (w.codes.stride(0),) + ((w.scale.stride(0),) if w.format == "q4" else ())
    args += (out.stride(0), out.stride(1))
    consts = {"HAS_BIAS": has_bias, "SPLIT_K": run.split, "BLOCK_M": run.block_m}
    consts |= {"BLOCK_N": run.block_n, "USE_DOT": run.use_dot, "PRECISION": _precision(x.dtype)}
    if w.format == "int8":
        _int8_linear_kernel[run.grid(rows, n)](*args, BLOCK_K=run.block_k, **consts)
    else:
        _q4_linear_kernel[run.grid(rows, n)](*args, GROUP=w.group, CHUNK=w.chunk, **consts)
    y = out[0] if run.split == 1 else out.sum(0)
    if bias is not None and not has_bias:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], n)
