"""The Triton weight-only matmuls (int8, q4 in groups of 32 and 64) equal dequantize-then-
matmul, and the Triton attention kernels read and write fp8 KV caches as the torch reference
does.

On CPU the kernels run under the Triton interpreter in a subprocess (tests/triton_quant_check.py;
tests/triton_interpret_check.py says why); on CUDA (``-m gpu``) they run compiled, on the
interpreter's cases, bf16 activations, the embedded model's shapes, and a whole engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.llm_engine import build_engine
from engine.request import SamplingParams
from engine.settings import EngineSettings
from kernels import ops, quant
from tests.conftest import tiny_llama_dir
from tests.test_engine_greedy_tiny import random_prompts
from tests.triton_quant_check import (
    QuantCase,
    check_fp8,
    check_fp8_rounding,
    check_quant,
    fp8_cases,
    quant_cases,
)

ROOT = Path(__file__).resolve().parents[1]
# Relative to the output's magnitude: fp32 sums in another order; fp16 / bf16 round the
# activations and the dequantized weight to 11 / 8 bits before the (fp32-accumulated) dot.
QUANT_TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.5e-2}
ATTENTION_TOLERANCE = {"float32": 1e-3, "float16": 1e-2}

needs_triton = pytest.mark.skipif(not ops.TRITON_AVAILABLE, reason="Triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
on_gpu = [pytest.mark.gpu, needs_cuda, needs_triton]


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict[str, float]]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.triton_quant_check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_quant_close(case: QuantCase, result: dict[str, float]) -> None:
    bound = QUANT_TOLERANCE[case.dtype] * result["scale"]
    assert result["error"] <= bound, f"{case}: error {result['error']} > {bound}"


def _assert_fp8_ok(case, result: dict[str, float]) -> None:
    assert result.pop("store_kv_bytes_differing") == 0, f"{case}: fp8 store differs"
    tolerance = ATTENTION_TOLERANCE[case.dtype]
    bad = {op: err for op, err in result.items() if not err <= tolerance}
    assert not bad, f"{case} exceeds {tolerance}: {bad}"


@needs_triton
@pytest.mark.parametrize("case", quant_cases(), ids=lambda c: c.name)
def test_triton_quant_linear_equals_dequantize_then_matmul_interpreted(case, interpreted):
    _assert_quant_close(case, interpreted[case.name])


@needs_triton
@pytest.mark.parametrize("case", fp8_cases(), ids=lambda c: c.name)
def test_triton_attention_on_fp8_kv_matches_the_reference_interpreted(case, interpreted):
    _assert_fp8_ok(case, dict(interpreted[case.name]))


@needs_triton
def test_triton_fp8_store_rounds_edge_values_as_torch_does_interpreted(interpreted):
    assert interpreted["fp8-rounding"]["store_kv_bytes_differing"] == 0


def test_q4_packing_keeps_every_code():
    """The CUDA packing's chunks hold the codes quant.py made, each exactly once."""
    pytest.importorskip("triton")
    from kernels import triton_quant

    for k, group, chunk in ((128, 32, 64), (96, 32, 32), (128, 64, 64)):
        qw = quant.quantize(torch.randn(8, k), "q4", group)
        packed = triton_quant.pack(qw)
        assert packed.chunk == chunk and packed.codes.shape == (8, k // 2)
        b = packed.codes.view(8, k // chunk, chunk // 2).to(torch.int32)
        unpacked = torch.cat([b & 15, b >> 4], dim=2).reshape(8, k)
        assert torch.equal(unpacked.to(torch.uint8), qw.q)


# ---- compiled, on a CUDA device ---------------------------------------------------------

SMOLLM2_SHAPES = [(576, 1728), (576, 3072), (1536, 576), (576, 49152)]  # (K, N)
GPU_QUANT_CASES = (
    quant_cases()
    + [
        QuantCase(f"{fmt}-{dtype}-m{m}-k{k}-n{n}", fmt, m, k, n, 32, dtype=dtype, seed=m)
        for fmt in ("int8", "q4")
        for dtype in ("bfloat16", "float32")
        for m in (1, 64)
        for k, n in SMOLLM2_SHAPES[:3]
    ]
    + [QuantCase("q4g64-bf16-lm-head", "q4", 4, 576, 49152, 64, dtype="bfloat16", seed=9)]
)


@pytest.mark.parametrize("case", GPU_QUANT_CASES, ids=lambda c: c.name)
@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_triton_quant_linear_equals_dequantize_then_matmul_on_gpu(case: QuantCase):
    _assert_quant_close(case, check_quant(case, device="cuda"))


@pytest.mark.parametrize("case", fp8_cases(), ids=lambda c: c.name)
@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_triton_attention_on_fp8_kv_matches_the_reference_on_gpu(case):
    _assert_fp8_ok(case, check_fp8(case, device="cuda"))


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_triton_fp8_store_rounds_edge_values_as_torch_does_on_gpu():
    assert check_fp8_rounding(device="cuda")["store_kv_bytes_differing"] == 0


@pytest.mark.parametrize("weights", ["int8", "q4"])
@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_quantized_engine_on_cuda_runs_the_triton_kernels_and_agrees_with_cpu(
    tmp_path, monkeypatch, weights
):
    """The same quantized tiny model on both devices: the GPU's decode steps go through the
    Triton kernels (counted), and greedy tokens equal the CPU's exact path (fp32 rows times the
    same dequantized values: activations and prefill GEMMs fp32, not the CPU's int8 / bf16
    defaults, whose rounding the GPU does not share)."""
    from kernels import triton_quant

    path, hf = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2, seed=4)
    prompts = random_prompts([7, 19, 30], hf.config.vocab_size, seed=4)
    params = SamplingParams(max_tokens=12)
    calls = []
    real = triton_quant.quant_linear
    monkeypatch.setattr(triton_quant, "quant_linear", lambda *a: calls.append(1) or real(*a))
    out = {}
    for dev in ("cpu", "cuda"):
        exact = {"activations": "fp32", "prefill_gemm": "fp32"}
        settings = EngineSettings(str(path), num_blocks=64, device=dev, weights=weights, **exact)
        engine = build_engine(settings)
        out[dev] = [r.output_token_ids for r in engine.generate(prompts, params)]
        assert engine.blocks.num_free == engine.blocks.num_total
    assert calls, "no Triton quantized matmul ran on CUDA"
    assert out["cuda"] == out["cpu"]


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_engine_with_fp8_kv_on_cuda_agrees_with_cpu(tmp_path):
    """kv_dtype fp8 on the GPU (the Triton kernels write and read the codes and scales) gives
    the CPU's greedy tokens (the torch path on the same format)."""
    path, hf = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2, seed=6)
    prompts = random_prompts([5, 21, 40], hf.config.vocab_size, seed=6)
    params = SamplingParams(max_tokens=12)
    out = {}
    for dev in ("cpu", "cuda"):
        engine = build_engine(EngineSettings(str(path), num_blocks=64, device=dev, kv_dtype="fp8"))
        assert engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
        out[dev] = [r.output_token_ids for r in engine.generate(prompts, params)]
        assert engine.blocks.num_free == engine.blocks.num_total
    assert out["cuda"] == out["cpu"]


@pytest.mark.gpu
@needs_cuda
def test_fp8_blocks_cross_a_transfer_frame_between_cuda_caches():
    """Gathered from a CUDA fp8 cache (torch's index ops on its bytes), framed, and scattered
    into another CUDA fp8 cache: the same bytes, scales included."""
    pytest.importorskip("crc32c")
    from kernels import kv_fp8
    from kernels.kv_blocks import gather_kv_blocks, scatter_kv_blocks
    from kv_transfer.frame import decode_frame, encode_kv_frame

    shape = (12, 16, 2, 64)
    src = [kv_fp8.quantize(torch.randn(shape, device="cuda")) for _ in range(2)]
    payload, _ = gather_kv_blocks(*src, [3, 7, 1])
    header, body = encode_kv_frame("req", "lease", 0, [0, 1, 2], payload)
    h, kv = decode_frame(header, bytes(body))
    assert h.dtype == "float8_e4m3fn"
    dst = [torch.zeros_like(src[0]), torch.zeros_like(src[1])]
    scatter_kv_blocks(kv, *dst, [0, 5, 11])
    for s, t in zip([3, 7, 1], [0, 5, 11]):
        for a, b in zip(src, dst):
            assert torch.equal(a[s].view(torch.uint8), b[t].view(torch.uint8))
