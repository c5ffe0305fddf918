"""Weight-only quantization: the CPU kernels equal dequantize-then-matmul on every build, the
q4 format gives a Q4_1 file's blocks back, and a quantized model's decode (quantized kernel)
and prefill (fp32 kernels on the dequantized weight) multiply the same weights."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.linear import Linear
from engine.loader import load_config, load_model
from kernels import quant
from kernels.metadata import AttentionMetadata
from tests.conftest import tiny_llama_dir
from tests.cpu_variants import ext  # noqa: F401  (fixture)

FORMATS = [("bf16", 32), ("int8", 32), ("q4", 32), ("q4", 64)]


@pytest.mark.parametrize("fmt,group", FORMATS)
@pytest.mark.parametrize("n,k", [(40, 64), (576, 576), (100, 128), (16, 1536)])
def test_quantized_kernel_equals_dequantize_then_matmul(ext, fmt, group, n, k):  # noqa: F811
    torch.manual_seed(n + k)
    qw = quant.quantize(torch.randn(n, k), fmt, group)
    packed = quant.pack(qw)
    bias, residual_rows = torch.randn(n), 32
    for rows in (1, 2, 7, 13, 24, residual_rows):
        x = torch.randn(rows, k)
        residual = torch.randn(rows, n)
        ref = quant.reference_linear(x, qw, bias) + residual
        got = ext.skinny_linear(x, packed, n, bias, residual)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * k**0.5)
        plain = ext.skinny_linear(x, packed, n)
        torch.testing.assert_close(plain, quant.reference_linear(x, qw), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "q4"])
def test_quantization_error_is_within_the_format_step(fmt):
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    err = (quant.dequantize(quant.quantize(w, fmt, 32)) - w).abs()
    step = {
        "bf16": w.abs() * 2**-8,  # 8 bits of mantissa: half an ulp
        "int8": w.abs().amax(dim=1, keepdim=True) / 127 / 2,
        "q4": (w.view(64, 8, 32).amax(2) - w.view(64, 8, 32).amin(2)).repeat_interleave(32, 1)
        / 15
        / 2,
    }[fmt]
    assert bool((err <= step * 1.01 + 1e-6).all())


def test_q4_at_group_32_gives_q4_1_blocks_back():
    """A weight dequantized from Q4_1 blocks (fp16 scale and minimum, codes 0..15 that reach
    both ends) requantizes to the same blocks: q4 loads a Q4_1 GGUF without new error."""
    torch.manual_seed(1)
    n, k = 32, 128
    codes = torch.randint(0, 16, (n, k // 32, 32))
    codes[..., 0], codes[..., 1] = 0, 15  # llama.cpp's quantizer spans min..max
    d = (torch.rand(n, k // 32) * 0.02 + 1e-3).half()
    m = (-torch.rand(n, k // 32) * 0.1).half()
    w = (codes * d.float()[..., None] + m.float()[..., None]).view(n, k)
    qw = quant.quantize(w, "q4", 32)
    assert torch.equal(qw.q.view(n, k // 32, 32).long(), codes)
    torch.testing.assert_close(quant.dequantize(qw), w, rtol=0, atol=2e-4)


def test_bytes_read_per_weight():
    w = torch.randn(64, 256)
    assert quant.quantize(w, "bf16").nbytes == 64 * 256 * 2
    assert quant.quantize(w, "int8").nbytes == 64 * 256 + 64 * 4
    assert quant.quantize(w, "q4", 32).nbytes == 64 * 256 // 2 + 64 * 8 * 4  # 5 bits a weight
    assert quant.quantize(w, "q4", 64).nbytes == 64 * 256 // 2 + 64 * 4 * 4


@pytest.mark.parametrize("fmt", ["int8", "q4"])
def test_linear_few_and_many_rows_multiply_the_same_weight(ext, fmt):  # noqa: F811
    """Decode (quantized skinny kernel) and prefill (oneDNN on the dequantized weight) agree."""
    torch.manual_seed(2)
    lin = Linear(128, 200, bias=True)
    lin.quantize(fmt, 32)
    assert lin.pack_for_cpu() and lin.skinny.dtype != torch.float32
    x = torch.randn(64, 128)
    many = lin(x)
    few = torch.cat([lin(x[i : i + 8]) for i in range(0, 64, 8)])
    torch.testing.assert_close(few, many, rtol=1e-4, atol=1e-4)
    assert lin.decode_bytes == lin.quantized.nbytes


def _decode_logits(model, ctx_ids):
    """Prefill ``ctx_ids[:-1]`` then decode the last token; its logits."""
    kv = model.allocate_kv_cache(8, 16)
    n = len(ctx_ids)
    table = [list(range(8))]
    model(torch.tensor(ctx_ids[:-1]), torch.arange(n - 1),
          AttentionMetadata.build([n - 1], [n - 1], table, 16), kv)  # fmt: skip
    meta = AttentionMetadata.build([1], [n], table, 16)
    h = model(torch.tensor(ctx_ids[-1:]), torch.tensor([n - 1]), meta, kv)
    return model.compute_logits(h)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "q4"])
def test_quantized_model_decodes_what_its_dequantized_weights_compute(tmp_path, ext, fmt):  # noqa: F811
    d, _ = tiny_llama_dir(tmp_path)
    cfg = load_config(d)
    quantized = load_model(d, cfg, 128, weights=fmt)
    assert quantized.cpu_stack is not None  # the C++ layers run the quantized tiles
    reference = load_model(d, cfg, 128)
    for ours, ref in zip(quantized.modules(), reference.modules()):
        if isinstance(ours, Linear):
            assert ours.quantized is not None
            ref.weight.data = quant.dequantize(ours.quantized)
            ref.skinny = None
    reference.pack_weights_for_cpu()
    ids = [1, 5, 9, 33, 2, 7, 100, 4, 12]
    torch.testing.assert_close(
        _decode_logits(quantized, ids), _decode_logits(reference, ids), rtol=1e-4, atol=1e-4
    )
    fp32 = load_model(d, cfg, 128)
    assert quantized.weight_bytes_per_step() < fp32.weight_bytes_per_step()


def test_engine_config_checks_weights_and_kv_dtype(tmp_path):
    cfg = load_config(tiny_llama_dir(tmp_path)[0])
    assert EngineConfig(cfg, CacheConfig(), weights="q4", weight_group=64).weights == "q4"
    with pytest.raises(ValueError, match="weights"):
        EngineConfig(cfg, weights="q3")
    with pytest.raises(ValueError, match="group"):
        EngineConfig(cfg, weights="q4", weight_group=48)
    with pytest.raises(ValueError, match="kv_dtype"):
        EngineConfig(cfg, kv_dtype="fp4")  # fp8 is a KV format now (tests/test_kv_fp8.py)


def test_bench_engine_counts_the_bytes_each_format_reads(tmp_path, monkeypatch):
    from pdserve.bench.micro import engine as bench_engine

    path, _ = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2)
    monkeypatch.setattr(bench_engine, "gemm_peak", lambda: 1e11)
    monkeypatch.setattr(bench_engine, "read_bandwidth", lambda: 1e10)
    before = torch.get_num_threads()
    try:
        result = bench_engine.run(
            str(path), 1, (16,), (2,), (32,), baseline=False, weights=("fp32", "int8", "q4"),
            kv_dtype="int8",
        )  # fmt: skip
    finally:
        torch.set_num_threads(before)
    decode = {r["weights"]: r for r in result["rows"] if r["kind"] == "decode"}
    cfg = load_config(path)
    kv = 2 * 32 * cfg.kv_bytes_per_token_as("int8")
    assert decode["fp32"]["bytes_read"] == bench_engine.decode_bytes(cfg, 2, 32, None, "int8")
    assert (
        kv
        < decode["q4"]["bytes_read"]
        < decode["int8"]["bytes_read"]
        < decode["fp32"]["bytes_read"]
    )
    assert "int8" in bench_engine.format_report(result)
