"""The Triton weight-only matmuls (kernels/triton_quant.py) and the Triton attention kernels on
fp8 KV caches (kernels/triton_kernels.py), each against its torch reference; prints JSON.

Run as ``TRITON_INTERPRET=1 python -m tests.triton_quant_check`` from the repo root (CPU
tensors, small shapes); tests/test_triton_quant.py runs it in a subprocess for the reason
tests/triton_interpret_check.py gives. ``check_*`` also run compiled on CUDA (``-m gpu``).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

import torch

from kernels import kv_fp8, ops, quant
from kernels.reference import paged_attention_ref, store_kv_ref
from tests.kernel_cases import KernelCase, build_inputs


@dataclass(frozen=True)
class QuantCase:
    name: str
    format: str  # int8 | q4
    rows: int
    k: int
    n: int
    group: int = 32
    dtype: str = "float32"
    bias: bool = False
    split_k: int = 0  # 0: the kernel's choice (1 under the interpreter)
    seed: int = 0


def quant_cases() -> list[QuantCase]:
    """Tiny shapes for the interpreter: fp32 rows up to 4 (the FMA path) and more (tl.dot; 17:
    two row tiles), N not a multiple of the tile, K a multiple of 64 and K = 96 (q4 chunks of
    32), split K, bias, fp16."""
    cases = []
    for fmt, group in (("int8", 0), ("q4", 32), ("q4", 64)):
        for rows, k, n, split in ((1, 128, 40, 0), (5, 192, 33, 3), (17, 64, 48, 0)):
            name = f"{fmt}{group or ''}-m{rows}-k{k}-n{n}-split{split}"
            cases.append(QuantCase(name, fmt, rows, k, n, group or 32, split_k=split))
    cases += [
        QuantCase("q4g32-k96-chunk32", "q4", 3, 96, 20, 32, seed=1),
        QuantCase("int8-bias", "int8", 2, 64, 24, bias=True, seed=2),
        QuantCase("q4-bias-split", "q4", 2, 128, 24, 32, bias=True, split_k=2, seed=3),
        QuantCase("int8-m4-fma-k32", "int8", 4, 128, 40, seed=6),  # fp32 FMA path, K tile 32
        QuantCase("int8-fp16", "int8", 4, 128, 40, dtype="float16", seed=4),
        QuantCase("q4g64-fp16", "q4", 4, 128, 40, 64, dtype="float16", seed=5),
    ]
    # No bfloat16: the interpreter's tl.dot reads bf16 operands as garbage (Triton 3.9);
    # the GPU tests cover it.
    return cases


def check_quant(case: QuantCase, device: str = "cpu") -> dict[str, float]:
    """Max abs error of the kernel against F.linear on the dequantized weight (fp32), and the
    reference's largest magnitude (the scale a tolerance applies to)."""
    from kernels import triton_quant

    gen = torch.Generator().manual_seed(case.seed)
    w = torch.randn(case.n, case.k, generator=gen)
    x = torch.randn(case.rows, case.k, generator=gen)
    bias = torch.randn(case.n, generator=gen) if case.bias else None
    qw = quant.quantize(w.to(device), case.format, case.group)
    dtype = getattr(torch, case.dtype)
    xd = x.to(device, dtype)
    packed = triton_quant.pack(qw)
    bias_d = None if bias is None else bias.to(device, dtype)
    y = triton_quant.quant_linear(xd, packed, bias_d, case.split_k)
    assert y.dtype == dtype and y.shape == (case.rows, case.n)
    b = None if bias is None else bias_d.float()
    expected = quant.reference_linear(xd.float(), qw, b)
    return {
        "error": (y.float() - expected).abs().max().item(),
        "scale": expected.abs().max().item(),
    }


def fp8_cases() -> list[KernelCase]:
    """Prefill, chunked prefill over a cached prefix, mixed and decode batches; GQA; block
    sizes 1, 5 (not dividing the key tile) and 16; fp16 queries."""
    return [
        KernelCase("fp8-prefill-bs16", (9, 20, 3), (9, 20, 3), 16, 4, 2, 16, seed=201),
        KernelCase("fp8-chunked-bs5", (7, 12), (30, 19), 5, 6, 2, 24, True, seed=202),
        KernelCase("fp8-mixed-bs1", (1, 13, 1), (21, 40, 9), 1, 4, 1, 16, seed=203),
        KernelCase("fp8-decode-bs16", (1, 1, 1), (33, 70, 5), 16, 8, 2, 32, seed=204),
        KernelCase("fp8-decode-fp16", (1, 1), (33, 64), 16, 8, 2, 32, dtype="float16", seed=205),
    ]


def check_fp8(case: KernelCase, device: str = "cpu") -> dict[str, float]:
    """Triton on fp8 caches: store_kv's bytes against the reference store (count of bytes
    that differ), and each attention op's max abs error against the reference op reading the
    same fp8 caches."""
    x = build_inputs(case, device)
    meta, scale = x["meta"], x["scale"]
    k_cache, v_cache = kv_fp8.quantize(x["k_cache"]), kv_fp8.quantize(x["v_cache"])
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_ref(x["key"], x["value"], k_ref, v_ref, meta.slot_mapping)
    k_out, v_out = k_cache.clone(), v_cache.clone()
    ops.store_kv(x["key"], x["value"], k_out, v_out, meta.slot_mapping, backend="triton")
    errors = {"store_kv_bytes_differing": float(_bytes_differing(k_out, k_ref, v_out, v_ref))}
    args = (x["query"], k_ref, v_ref, meta, scale)
    expected = paged_attention_ref(*args).float()
    for name, op in (("paged", ops.paged_attention), ("prefill", ops.prefill_attention)):
        errors[name] = (op(*args, backend="triton").float() - expected).abs().max().item()
    if case.is_decode_only:
        got = ops.decode_attention(*args, backend="triton").float()
        errors["decode"] = (got - expected).abs().max().item()
    return errors


# Codes at e4m3's edges, with the head's max at 448 so that the scale is exactly 1: a round up
# that carries into the next power of two (-127.9 -> -128, 248 -> 256), ties to even in the
# normal range (17 -> 16, 19 -> 20) and among subnormals (3/1024 -> 2/512, 5/1024 -> 2/512),
# a subnormal, one below the smallest subnormal's half, signed zeros.
FP8_EDGES = [448.0, -127.9, 248.0, 17.0, 19.0, 3 / 1024, 5 / 1024, -(2**-7), 2**-11, 0.0, -0.0]


def check_fp8_rounding(device: str = "cpu") -> dict[str, float]:
    """Triton's fp8 store against the torch path on FP8_EDGES: bytes that differ."""
    head = torch.tensor(FP8_EDGES + [1.0] * (16 - len(FP8_EDGES)), device=device)
    key = torch.stack([head, -head]).view(1, 2, 16)  # one token, two KV heads
    caches = [torch.zeros(2, 4, 2, 20, dtype=kv_fp8.DTYPE, device=device) for _ in range(4)]
    slots = torch.tensor([5], device=device)
    ops.store_kv(key, key, caches[0], caches[1], slots, backend="torch")
    ops.store_kv(key, key, caches[2], caches[3], slots, backend="triton")
    k_torch, v_torch, k_triton, v_triton = caches
    return {
        "store_kv_bytes_differing": float(_bytes_differing(k_triton, k_torch, v_triton, v_torch))
    }


def _bytes_differing(*pairs: torch.Tensor) -> int:
    total = 0
    for a, b in zip(pairs[::2], pairs[1::2]):
        total += int((a.view(torch.uint8) != b.view(torch.uint8)).sum())
    return total


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1 before running this script", file=sys.stderr)
        return 2
    results = {c.name: check_quant(c) for c in quant_cases()}
    results.update({c.name: check_fp8(c) for c in fp8_cases()})
    results["fp8-rounding"] = check_fp8_rounding()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
