"""Weight-only quantization: the CPU kernels equal dequantize-then-matmul on every build (with
int8 activations: the same on x quantized per block of 32), the q4 format gives a Q4_1 file's
blocks back, and a quantized model's decode (quantized kernel) and prefill (fp32 kernels on
the dequantized weight) multiply the same weights."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.linear import Linear
from engine.loader import load_config, load_model
from kernels import cpu_extension, quant
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
    bias = torch.randn(n)
    # Every way the kernel cuts a call: q4 sums its groups factored at few rows (AVX2: 1, 2,
    # 3-5 rows, each its own register blocking) and dequantized past them; 7+ rows are whole
    # passes (AVX2 half tiles of up to 12 rows), 13+ several passes of near-equal rows.
    for rows in (1, 2, 3, 5, 6, 7, 8, 13, 24, 32):
        x = torch.randn(rows, k)
        residual = torch.randn(rows, n)
        ref = quant.reference_linear(x, qw, bias) + residual
        got = ext.skinny_linear(x, packed, n, bias, residual)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * k**0.5)
        plain = ext.skinny_linear(x, packed, n)
        torch.testing.assert_close(plain, quant.reference_linear(x, qw), rtol=1e-4, atol=1e-3)


DOT_FORMATS = [("int8", 32), ("q4", 32), ("q4", 64)]


@pytest.mark.parametrize("fmt,group", DOT_FORMATS)
@pytest.mark.parametrize("n,k", [(40, 64), (576, 576), (100, 128), (17, 1536)])
def test_int8_activation_kernel_equals_its_reference(ext, fmt, group, n, k):  # noqa: F811
    """The byte-dot kernel computes exactly quant.int8_activation_reference (its integer sums
    are exact), for every row blocking: AVX-512 passes of up to 4 rows over 2 tiles, AVX2 of 2
    rows over 1, tails of both."""
    torch.manual_seed(n + k + group)
    qw = quant.quantize(torch.randn(n, k), fmt, group)
    packed = quant.pack(qw, "int8")
    bias = torch.randn(n)
    for rows in (1, 2, 3, 4, 5, 7, 8, 13, 32, 48):
        x = torch.randn(rows, k) * 3
        residual = torch.randn(rows, n)
        got = ext.skinny_linear(x, packed, n, bias, residual)
        ref = quant.int8_activation_reference(x, qw, bias) + residual
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * k**0.5)


@pytest.mark.parametrize("fmt,group", DOT_FORMATS)
def test_the_vnni_dot_product_gives_the_same_sums_as_the_sign_trick(fmt, group):
    """vpdpbusd on the stored bytes and maddubs on their magnitudes add the same integers, and
    the two AVX-512 builds scale them in the same order: equal to the last bit."""
    vnni, plain = cpu_extension.load("avx512vnni"), cpu_extension.load("avx512")
    if vnni is None or plain is None:
        pytest.skip("needs the avx512vnni and avx512 builds (an AVX-512 VNNI CPU)")
    torch.manual_seed(11)
    qw = quant.quantize(torch.randn(72, 576), fmt, group)
    packed = quant.pack(qw, "int8")
    for rows in (1, 4, 9):
        x = torch.randn(rows, 576) * 5
        assert torch.equal(vnni.skinny_linear(x, packed, 72, None, None),
                           plain.skinny_linear(x, packed, 72, None, None))  # fmt: skip


@pytest.mark.parametrize("fmt,group", DOT_FORMATS)
def test_int8_activations_stay_within_their_quantization_step(ext, fmt, group):  # noqa: F811
    """Against fp32 activations, the error is what rounding x per block allows: each product
    off by at most half a step (max|x| / (2 x levels)) times |w|; levels are 127 (8-bit
    codes), 63 for int8 weights on the AVX2 build (7-bit codes)."""
    levels = quant.activation_levels(fmt)
    assert levels == (63 if ext.__name__.endswith("avx2") and fmt == "int8" else 127)
    torch.manual_seed(4)
    qw = quant.quantize(torch.randn(64, 256), fmt, group)
    x = torch.randn(8, 256)
    x[:, 7] = 40.0  # an outlier channel costs only its own block's precision
    xq = quant.quantize_activations(x, levels)
    step = x.view(8, 8, 32).abs().amax(2).repeat_interleave(32, 1) / (2 * levels)
    assert bool(((xq - x).abs() <= step * 1.0001).all())
    got = ext.skinny_linear(x, quant.pack(qw, "int8"), 64, None, None)
    w = quant.dequantize(qw)
    if fmt == "q4":  # the minimums multiply the exact x: only the scaled codes see xq's error
        w = w - qw.minimum.float().repeat_interleave(group, dim=1)
    bound = step @ w.abs().T
    assert bool(((got - quant.reference_linear(x, qw)).abs() <= bound * 1.001 + 1e-4).all())


def test_int8_activation_packing_needs_int8_or_q4_and_k_in_blocks_of_32():
    with pytest.raises(ValueError, match="int8 activations"):
        quant.pack(quant.quantize(torch.randn(16, 64), "bf16"), "int8")
    with pytest.raises(ValueError, match="int8 activations"):
        quant.pack(quant.quantize(torch.randn(16, 48), "int8"), "int8")
    with pytest.raises(ValueError, match="activations 'fp16'"):
        quant.pack(quant.quantize(torch.randn(16, 64), "int8"), "fp16")
    lin = Linear(48, 16)  # K = 48: the layer keeps fp32 activations
    lin.quantize("int8", 32, "int8")
    assert lin.skinny_activations == "fp32"


@pytest.mark.parametrize("group", quant.Q4_GROUPS)
def test_q4_kernel_keeps_its_precision_on_weights_far_from_zero(ext, group):  # noqa: F811
    """The few-row q4 sums are factored (scale * sum x q + min * sum x): with weights offset
    far from zero the two terms are large and the result still equals the dequantized matmul."""
    torch.manual_seed(3)
    n, k = 96, 576
    qw = quant.quantize(torch.randn(n, k) * 0.1 + 3.0, "q4", group)
    packed = quant.pack(qw)
    for rows in (1, 2, 4, 8):
        x = torch.randn(rows, k)
        ref = quant.reference_linear(x, qw).double()
        got = ext.skinny_linear(x, packed, n).double()
        exact = x.double() @ quant.dequantize(qw).double().T
        # no worse than fp32's own rounding in the reference matmul, with margin
        assert (got - exact).abs().max() <= 4 * (ref - exact).abs().max() + 1e-4


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
@pytest.mark.parametrize("activations", ["fp32", "int8"])
def test_linear_few_and_many_rows_multiply_the_same_weight(ext, fmt, activations):  # noqa: F811
    """Decode (quantized skinny kernel) and prefill (oneDNN on the dequantized weight) agree;
    with int8 activations decode is the same weight times x rounded per block of 32."""
    torch.manual_seed(2)
    lin = Linear(128, 200, bias=True)
    lin.quantize(fmt, 32, activations)
    assert lin.pack_for_cpu() and lin.skinny.dtype != torch.float32
    x = torch.randn(64, 128)
    many = lin(x)
    few = torch.cat([lin(x[i : i + 8]) for i in range(0, 64, 8)])
    bias = lin.bias.detach()
    torch.testing.assert_close(many, quant.reference_linear(x, lin.quantized, bias))
    if activations == "int8" and fmt != "bf16":
        assert lin.skinny_activations == "int8"
        exact = quant.int8_activation_reference(x, lin.quantized, bias)
        torch.testing.assert_close(few, exact, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(few, many, rtol=1e-4, atol=1e-4)  # the int8 kernel ran
    else:
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
    """With fp32 activations decode equals the dequantized model to float rounding (int8
    activations: tests/test_quant_smollm2.py bounds what they cost on the real model)."""
    d, _ = tiny_llama_dir(tmp_path)
    cfg = load_config(d)
    quantized = load_model(d, cfg, 128, weights=fmt, activations="fp32")
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
    with pytest.raises(ValueError, match="activations"):
        EngineConfig(cfg, weights="q4", activations="int4")
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


def test_bench_quant_compares_each_build_with_llama_cpp_of_its_instruction_set():
    """`pdserve bench quant`: a pdserve build's ratios are against the llama.cpp build of the
    same instruction set (its same batch and its best batched figure), never the other one."""
    from pdserve.bench.kernels import quant as bench

    best = {
        "llama.cpp avx512": {1: 100.0, 8: 200.0, 32: 250.0},
        "llama.cpp avx2": {1: 80.0, 8: 160.0, 32: 200.0},
        "pdserve q4 avx512": {1: 150.0, 8: 500.0, 32: 600.0},
        "pdserve q4 avx2": {1: 120.0, 8: 400.0, 32: 440.0},
    }
    assert bench.baselines_for("pdserve q4 avx2", best) == ["llama.cpp avx2"]
    meta = {"cpu_model": "cpu", "cpu_isa": "avx512+avx2", "threads": 2, "load_before": "0",
            "load_after": "0", "context": 128, "gen": 32, "kv_dtype": "fp32"}  # fmt: skip
    lines = bench.report(best, (1, 8, 32), meta).splitlines()
    (avx2,) = [line for line in lines if "pdserve q4 avx2" in line and " vs " in line]
    assert "1.50x" in avx2 and "vs llama.cpp avx2" in avx2 and "2.00x 2.20x" in avx2
    assert not any("pdserve q4 avx2" in line and "avx512 (" in line for line in lines)
    # without a same-ISA build, every llama.cpp build is a baseline
    del best["llama.cpp avx2"]
    assert bench.baselines_for("pdserve q4 avx2", best) == ["llama.cpp avx512"]
