"""Linear layers whose CPU fp32 path runs on weights packed once at load time.

A decode step's matmuls have a few rows (one per sequence): there the weight is a stream read
once, and the C++ extension's skinny kernel (kernels/csrc/skinny_gemm_cpu.cpp, weight in tiles
of 16 outputs) is the faster path on both instruction sets: at 32 rows and 2 threads, with the
CPU's libraries capped at AVX2, 45.5 ms for SmolLM2's projections against oneDNN's 61.2 and
MKL's 64.9; at one row 16.3 against 28.8 and 18.1 (docs/results/isa_variants.md). Larger batches (prefill chunks) go to oneDNN
on its own packed weight, as in vLLM's CPU backend: MKL's sgemm repacks the weight on every call
(~15% slower at prefill sizes). Anywhere else (GPU, other dtypes, no oneDNN, no extension) the
layer is a plain ``F.linear``.

Quantized weights (``quantize``: bf16, int8, q4; kernels/quant.py) keep that dispatch: the
skinny tiles are the quantized packing (kernels/csrc/quant_gemm_cpu.cpp dequantizes in
registers, 2-10x faster than fp32 at one row), and the fp32 weight becomes the dequantized
one, so oneDNN's prefill and every fallback multiply exactly the values decode reads.
On CUDA, int8 and q4 layers of up to ``triton_quant.MAX_ROWS`` rows (decode) run Triton
kernels that read the codes (kernels/triton_quant.py); more rows run cuBLAS on the dequantized
weight.

``set_prefill_gemm("bf16")`` (engine/prefill_gemm.py) gives the many-row matmuls (past
SKINNY_MAX_ROWS: prefill chunks, mixed steps) a bf16 copy of those values instead of oneDNN's
fp32 one (AMX runs it ~7x faster on Sapphire Rapids); the few-row kernels are unchanged.
``set_prefill_gemm("int8")`` sends many rows of an int8 / q4 weight to its int8-activation
skinny kernel too (1.3-1.4x oneDNN bf16 on a Zen 4 without AMX), and needs no other copy.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kernels import cpu_extension, quant

try:  # Triton's weight-only kernels for CUDA
    from kernels import triton_quant
except ImportError:  # no Triton: quantized layers on CUDA multiply the dequantized weight
    triton_quant = None


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


# Where oneDNN's packed kernels take over: without the skinny kernel, from two rows on (one
# row is a GEMV where MKL is as fast); with it, past SKINNY_MAX_ROWS.
ONEDNN_MIN_ROWS = 2
# Up to this many rows the skinny kernel wins (measured, 1 and 2 threads: 64 rows about even,
# 96 rows 5% slower than oneDNN).
SKINNY_MAX_ROWS = 48


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) plus an optional packed weight."""

    packed: torch.Tensor | None = None  # oneDNN's layout
    skinny: torch.Tensor | None = None  # the skinny kernel's tiles (fp32 or quantized)
    quantized: quant.QuantizedWeight | None = None  # set by quantize
    cuda_packed: triton_quant.PackedWeight | None = None  # int8 / q4 on CUDA, set by quantize
    prefill_bf16: torch.Tensor | None = None  # the weight in bf16 for many rows (set_prefill_gemm)
    prefill_bf16_onednn: bool = False  # prefill_bf16 is in oneDNN's layout
    prefill_int8: bool = False  # many rows too take the int8-activation skinny kernel
    skinny_activations: str = "fp32"  # int8: the quantized skinny kernel quantizes its rows

    def quantize(self, fmt: str, group: int = 32, activations: str = "int8") -> None:
        """Store the weight as ``fmt`` (bf16 | int8 | q4 in groups of ``group``); call before
        ``pack_for_cpu``. A tied weight (the LM head's embedding) changes for both users.
        ``activations`` "int8": the skinny kernel of int8 / q4 weights quantizes its rows to
        int8 (quant_dot_cpu.cpp) where ``quant.dot_packable``; "fp32": rows stay fp32."""
        qw = quant.quantize(self.weight.detach(), fmt, group)
        self.weight.data = quant.dequantize(qw).to(self.weight.device)
        self.quantized = qw
        dot = activations == "int8" and quant.dot_packable(qw)
        self.skinny_activations = "int8" if dot else "fp32"
        if self.weight.is_cuda and triton_quant is not None and fmt in ("int8", "q4"):
            self.cuda_packed = triton_quant.pack(qw)

    @property
    def decode_bytes(self) -> int:
        """Bytes a few-row matmul reads: the quantized codes and scales, or the fp32 weight."""
        if self.quantized is not None and (self.skinny is not None or self.cuda_packed):
            return self.quantized.nbytes
        return self.weight.numel() * self.weight.element_size()

    def set_prefill_gemm(self, kind: str) -> None:
        """``kind`` "bf16": matmuls of more than SKINNY_MAX_ROWS rows multiply a bf16 copy of
        the weight (for a quantized one, its dequantized values rounded); "int8": an int8 / q4
        weight's rows are quantized and multiplied as bytes whatever their number (its
        int8-activation kernel; other weights stay fp32); "fp32": no copy. Call after
        ``quantize``; a layer already packed is packed again for the new kind."""
        w = self.weight.detach()
        self.prefill_bf16, self.prefill_bf16_onednn = None, False
        self.prefill_int8 = kind == "int8" and self.skinny_activations == "int8"
        if kind == "bf16":
            wb = w.to(torch.bfloat16)
            self.prefill_bf16_onednn = wb.device.type == "cpu" and onednn_available()
            onednn = self.prefill_bf16_onednn
            self.prefill_bf16 = torch.ops.mkldnn._reorder_linear_weight(wb) if onednn else wb
        if self.packed is not None or self.skinny is not None:
            self.pack_for_cpu()

    def pack_for_cpu(self) -> bool:
        """Pack the weight for oneDNN and, where the C++ extension loads, for the skinny
        kernel; returns whether a packed path is now used."""
        w = self.weight.detach()
        if w.device.type != "cpu" or w.dtype != torch.float32:
            return False
        ext = cpu_extension.load()
        # With a bf16 copy for many rows, oneDNN's fp32 copy would only serve the rows the
        # skinny kernel takes: keep it only where there is no skinny kernel.
        fp32_rows_need_it = (self.prefill_bf16 is None and not self.prefill_int8) or ext is None
        self.packed = None
        if onednn_available() and fp32_rows_need_it:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w)
        if ext is not None:
            qw = self.quantized
            packed = quant.pack(qw, self.skinny_activations) if qw is not None else None
            self.skinny = packed if packed is not None else ext.pack_skinny_weight(w)
        return self.packed is not None or self.skinny is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        on_cuda_kernels = self.cuda_packed is not None and x.is_cuda
        if on_cuda_kernels and x.numel() <= triton_quant.MAX_ROWS * self.in_features:
            return triton_quant.quant_linear(x, self.cuda_packed, self.bias)
        if x.dtype != torch.float32 or x.dim() != 2:
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        if self.skinny is not None and (x.shape[0] <= SKINNY_MAX_ROWS or self.prefill_int8):
            return cpu_extension.load().skinny_linear(x, self.skinny, self.out_features, bias)
        if self.prefill_bf16 is not None and x.shape[0] > SKINNY_MAX_ROWS:
            return self._bf16_linear(x, bias)
        if self.packed is not None and x.shape[0] >= ONEDNN_MIN_ROWS:
            return torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), self.packed, bias, "none", [], ""
            )
        return F.linear(x, self.weight, self.bias)

    def _bf16_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W^T on the bf16 copy: bf16 inputs, fp32 sums, the bias added in fp32."""
        xb = x.to(torch.bfloat16)
        if self.prefill_bf16_onednn:
            y = torch.ops.mkldnn._linear_pointwise(xb, self.prefill_bf16, None, "none", [], "")
        else:
            y = F.linear(xb, self.prefill_bf16)
        y = y.float()
        return y if bias is None else y.add_(bias)
