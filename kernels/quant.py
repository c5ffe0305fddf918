"""Weight-only quantization: the formats, their torch reference, and the packings the CPU
extension's quantized skinny kernel reads (kernels/csrc/quant_gemm_cpu.cpp).

Formats (``weights`` in the engine config):
- ``bf16``: the fp32 weight rounded to bfloat16 (2 bytes a weight).
- ``int8``: symmetric, one fp32 scale per output channel: w = q * scale, q in -127..127.
- ``q4``: asymmetric 4-bit in groups of ``group`` (32 or 64) along K, an fp16 scale and an fp16
  minimum per group: w = q * scale + min, q in 0..15 (llama.cpp's Q4_1 at group 32: 5 bits a
  weight with its scales; requantizing a Q4_1-dequantized weight at group 32 gives the file's
  blocks back, tests/test_quant.py).

Activations stay fp32. ``dequantize`` is the reference: a quantized matmul must equal
``x @ dequantize(w).T`` to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Q4_GROUPS = (32, 64)
TILE = 16  # outputs per tile of the skinny kernels


@dataclass(frozen=True)
class QuantizedWeight:
    """One [N, K] weight in ``format``: ``q`` (bf16 / int8 / uint8 codes), and per output
    channel (int8) or per output channel and group (q4) ``scale`` and ``minimum``."""

    format: str
    q: torch.Tensor  # [N, K]
    scale: torch.Tensor | None = None  # int8: [N] fp32; q4: [N, K // group] fp16
    minimum: torch.Tensor | None = None  # q4: [N, K // group] fp16
    group: int = 0

    @property
    def nbytes(self) -> int:
        """What a matmul reads: codes (q4 two a byte) and scales."""
        codes = (
            self.q.numel() // 2 if self.format == "q4" else self.q.numel() * self.q.element_size()
        )
        extra = sum(
            t.numel() * t.element_size() for t in (self.scale, self.minimum) if t is not None
        )
        return codes + extra


def quantize(weight: torch.Tensor, fmt: str, group: int = 32) -> QuantizedWeight:
    w = weight.detach().float()
    if fmt == "bf16":
        return QuantizedWeight("bf16", w.to(torch.bfloat16))
    if fmt == "int8":
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight("int8", q, scale)
    if fmt == "q4":
        return _quantize_q4(w, group)
    raise ValueError(f"weights {fmt!r}: expected bf16, int8 or q4")


def _quantize_q4(w: torch.Tensor, group: int) -> QuantizedWeight:
    if group not in Q4_GROUPS:
        raise ValueError(f"q4 group {group}: expected one of {Q4_GROUPS}")
    n, k = w.shape
    if k % group:
        raise ValueError(f"q4 group {group} does not divide K = {k}")
    g = w.view(n, k // group, group)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    # Codes from the fp16-rounded scale and minimum: what the kernel multiplies back.
    minimum = lo.to(torch.float16)
    scale = ((hi - minimum.float()) / 15.0).to(torch.float16)
    safe = scale.float().clamp(min=1e-12)
    q = torch.round((g - minimum.float()[..., None]) / safe[..., None]).clamp(0, 15)
    return QuantizedWeight("q4", q.to(torch.uint8).view(n, k), scale, minimum, group)


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """The fp32 [N, K] weight the format stands for."""
    if qw.format == "bf16":
        return qw.q.float()
    if qw.format == "int8":
        return qw.q.float() * qw.scale[:, None]
    n, k = qw.q.shape
    g = qw.q.view(n, k // qw.group, qw.group).float()
    return (g * qw.scale.float()[..., None] + qw.minimum.float()[..., None]).view(n, k)


def reference_linear(x: torch.Tensor, qw: QuantizedWeight, bias=None) -> torch.Tensor:
    return torch.nn.functional.linear(x, dequantize(qw), bias)


def quantize_activations(x: torch.Tensor, levels: int = 127) -> torch.Tensor:
    """x [M, K] as quant_dot_cpu.cpp multiplies it: per row and block of 32, codes
    round(x * levels / max|x|) times the scale max|x| / levels (fp32 arithmetic, as the
    kernel)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // DOT_BLOCK, DOT_BLOCK)
    top = blocks.abs().amax(dim=2, keepdim=True)
    inv = torch.where(top > 0, levels / top, torch.zeros_like(top))
    return (torch.round(blocks * inv) * (top / levels)).reshape(m, k)


def activation_levels(fmt: str) -> int:
    """The codes x takes on each side of zero in the int8-activation kernel of the build this
    process loads (``cpu_extension.load()``) for weights of ``fmt``: 127, or 63 for int8
    weights on the AVX2 build (7-bit codes: quant_dot_cpu.cpp's kSevenBit)."""
    from kernels import cpu_extension

    module = cpu_extension.load()
    return 127 if module is None else int(module.int8_activation_levels(fmt == "q4"))


def int8_activation_reference(x: torch.Tensor, qw: QuantizedWeight, bias=None) -> torch.Tensor:
    """What the int8-activation kernel of the loaded build computes, in fp32 torch: the
    quantized x times the weight's scaled codes, plus (q4) the exact x times the weight's
    minimums."""
    xq = quantize_activations(x, activation_levels(qw.format))
    if qw.format == "int8":
        return torch.nn.functional.linear(xq, dequantize(qw), bias)
    n, k = qw.q.shape
    codes = qw.q.view(n, k // qw.group, qw.group).float()
    scaled = (codes * qw.scale.float()[..., None]).view(n, k)
    minimums = qw.minimum.float().repeat_interleave(qw.group, dim=1)
    return torch.nn.functional.linear(xq, scaled, bias) + x.float() @ minimums.T


ACTIVATIONS = ("fp32", "int8")
DOT_BLOCK = 32  # activations per int8 scale in quant_dot_cpu.cpp


def dot_packable(qw: QuantizedWeight) -> bool:
    """Whether int8 activations can multiply ``qw``: int8 or q4 codes, K in blocks of 32."""
    return qw.format in ("int8", "q4") and qw.q.shape[1] % DOT_BLOCK == 0


def pack(qw: QuantizedWeight, activations: str = "fp32") -> torch.Tensor:
    """The packing the CPU extension reads, zero-padded to whole tiles of 16 outputs:
    quant_gemm_cpu.cpp's (fp32 activations), or with ``activations="int8"`` (int8 / q4
    weights, ``dot_packable``) quant_dot_cpu.cpp's, whose kernel quantizes x per row in
    blocks of 32 and multiplies bytes. Layouts in each file's header."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations {activations!r}: expected one of {ACTIVATIONS}")
    n, k = qw.q.shape
    tiles = -(-n // TILE)
    if activations == "int8":
        if not dot_packable(qw):
            raise ValueError("int8 activations need int8 or q4 weights with K % 32 == 0")
        return _pack_dot(qw, tiles)
    if qw.format == "bf16":
        return _tiles(qw.q, tiles).transpose(1, 2).contiguous()  # [tiles, K, 16]
    if qw.format == "int8":
        codes = _tiles(qw.q, tiles).transpose(1, 2).reshape(tiles, k * TILE)
        return torch.cat([codes, _channel_scales(qw, tiles).view(torch.int8)], dim=1)
    groups, gs = k // qw.group, qw.group
    q = _tiles(qw.q, tiles).view(tiles, TILE, groups, gs // 2, 2).to(torch.int32)
    nibbles = (q[..., 0] | (q[..., 1] << 4)).to(torch.uint8)  # [tiles, 16, groups, G/2]
    nibbles = nibbles.permute(0, 2, 3, 1).reshape(tiles, groups, gs // 2 * TILE)
    return torch.cat([nibbles, *_group_scales(qw, tiles)], dim=2)  # [tiles, groups, G * 8 + 64]


def _pack_dot(qw: QuantizedWeight, tiles: int) -> torch.Tensor:
    """quant_dot_cpu.cpp's layouts: chunks of 16 outputs x 4 bytes along K."""
    k = qw.q.shape[1]
    if qw.format == "int8":
        shifted = (qw.q.to(torch.int16) + 128).to(torch.uint8)  # padding rows: code 0 -> 128
        codes = _tiles(shifted, tiles, fill=128).view(tiles, TILE, k // 4, 4)
        codes = codes.permute(0, 2, 1, 3).reshape(tiles, k * TILE)
        return torch.cat([codes, _channel_scales(qw, tiles).view(torch.uint8)], dim=1)
    q = _tiles(qw.q, tiles).view(tiles, TILE, k // 8, 2, 4).to(torch.int32)
    nibbles = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).to(torch.uint8)  # [tiles, 16, K/8, 4]
    nibbles = nibbles.permute(0, 2, 1, 3).reshape(tiles, k // qw.group, qw.group * 8)
    return torch.cat([nibbles, *_group_scales(qw, tiles)], dim=2).view(torch.int8)


def _channel_scales(qw: QuantizedWeight, tiles: int) -> torch.Tensor:
    """int8: the fp32 scales of each tile's 16 outputs, [tiles, 16]."""
    return _tiles(qw.scale[:, None], tiles).reshape(tiles, TILE).contiguous()


def _group_scales(qw: QuantizedWeight, tiles: int) -> list[torch.Tensor]:
    """q4: per tile and group, the 16 outputs' fp16 scales, then their minimums, as bytes
    ([tiles, groups, 32] each)."""
    groups = qw.q.shape[1] // qw.group
    sm = [_tiles(t, tiles).transpose(1, 2).contiguous() for t in (qw.scale, qw.minimum)]
    return [t.view(torch.uint8).view(tiles, groups, TILE * 2) for t in sm]


def _tiles(t: torch.Tensor, tiles: int, fill: int = 0) -> torch.Tensor:
    """[N, ...] padded with ``fill`` to [tiles, 16, ...]."""
    padded = t.new_full((tiles * TILE, *t.shape[1:]), fill)
    padded[: t.shape[0]] = t
    return padded.view(tiles, TILE, *t.shape[1:])


def torch_int8pack_linear(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """torch's own weight-only int8 kernel, for benchmarks against this one (slower with fp32
    activations on the CPUs measured; docs/results/quantized.md)."""
    return torch.ops.aten._weight_int8pack_mm(x, qw.q, qw.scale)
