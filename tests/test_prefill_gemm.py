"""``prefill_gemm: fp32 | bf16 | int8 | auto``: many-row matmuls (prefill chunks, mixed steps) on
bf16 copies of the weights, or on int8 / q4 weights' int8-activation kernel; few-row ones
(decode) on the skinny kernels as before; auto picks the fastest of bf16 and int8 for quantized
weights only, and only where its measurement says it beats fp32."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import engine.model
from engine import prefill_gemm
from engine.config import CacheConfig, EngineConfig
from engine.linear import SKINNY_MAX_ROWS, Linear
from engine.loader import load_config, load_model
from kernels import cpu_extension, quant
from kernels.metadata import AttentionMetadata
from kernels.ops import paged_attention
from pdserve.config import ConfigError, validate_config
from tests.conftest import tiny_llama_dir

MANY = SKINNY_MAX_ROWS + 32  # a prefill chunk: past the skinny kernel's rows
FEW = 20  # a decode batch (or a short prompt): the skinny kernel's rows


@pytest.fixture
def injected_timings(monkeypatch):
    """``set_timings(fp32_s, bf16_s, int8_s=None)``: what auto's startup measurement will find
    (int8 for int8 / q4 weights only, as the probe times it)."""

    def set_timings(fp32_s: float, bf16_s: float, int8_s: float | None = None) -> None:
        def probe(weights):
            seconds = {"fp32": fp32_s, "bf16": bf16_s}
            if int8_s is not None and weights in ("int8", "q4"):
                seconds["int8"] = int8_s
            return seconds

        monkeypatch.setattr(prefill_gemm, "probe_seconds", probe)
        prefill_gemm._timings_at.cache_clear()

    yield set_timings
    prefill_gemm._timings_at.cache_clear()


def prefill_logits(model, n: int) -> torch.Tensor:
    """Logits of every position of an ``n``-token prompt prefilled in one forward."""
    ids = [(7 * i + 3) % model.cfg.vocab_size for i in range(n)]
    blocks = n // 16 + 1
    kv = model.allocate_kv_cache(blocks, 16)
    meta = AttentionMetadata.build([n], [n], [list(range(blocks))], 16)
    return model.compute_logits(model(torch.tensor(ids), torch.arange(n), meta, kv))


def test_prefill_gemm_is_checked_by_name(tmp_path):
    d, _ = tiny_llama_dir(tmp_path)
    cfg = load_config(d)
    assert EngineConfig(cfg, CacheConfig(), prefill_gemm="bf16").prefill_gemm == "bf16"
    with pytest.raises(ValueError, match="prefill_gemm 'fp16'"):
        EngineConfig(cfg, prefill_gemm="fp16")
    with pytest.raises(ValueError, match="prefill_gemm 'amx'"):
        load_model(d, cfg, 128, prefill_gemm="amx")
    with pytest.raises(ConfigError, match="prefill_gemm"):
        validate_config({"prefill_gemm": "fp16"})
    # int8 is the int8-activation kernel of int8 / q4 weights: nothing else takes it.
    for bad in ({}, {"weights": "bf16"}, {"weights": "q4", "activations": "fp32"}):
        with pytest.raises(ConfigError, match="prefill_gemm 'int8' needs weights int8 or q4"):
            validate_config({"prefill_gemm": "int8", **bad})
        with pytest.raises(ValueError, match="prefill_gemm 'int8' needs"):
            EngineConfig(cfg, prefill_gemm="int8", **bad)
    assert validate_config({"prefill_gemm": "int8", "weights": "q4"}).prefill_gemm == "int8"
    with pytest.raises(ValueError, match="prefill_gemm 'int8' needs"):
        load_model(d, cfg, 128, prefill_gemm="int8")


def test_the_cluster_config_reaches_every_workers_engine():
    from pdserve.settings import settings_from_config

    s = settings_from_config(validate_config({"prefill_gemm": "bf16"}), "127.0.0.1", "/m")
    assert s.prefill.engine.prefill_gemm == s.decode.engine.prefill_gemm == "bf16"
    assert validate_config({}).prefill_gemm == "auto"


def test_auto_takes_bf16_only_for_quantized_weights_where_it_measures_faster(injected_timings):
    injected_timings(0.70, 0.10)  # bf16 7x faster
    assert prefill_gemm.choose("auto", "q4", "cpu") == "bf16"
    assert prefill_gemm.choose("auto", "int8", "cpu") == "bf16"
    assert prefill_gemm.choose("auto", "fp32", "cpu") == "fp32"  # fp32 weights stay exact
    assert prefill_gemm.choose("auto", "q4", "cuda:0") == "fp32"
    injected_timings(0.70, 0.50)  # 1.4x: under the bar
    assert prefill_gemm.choose("auto", "q4", "cpu") == "fp32"
    injected_timings(0.20, 0.40)  # an AVX2-only CPU emulating bf16
    assert prefill_gemm.choose("auto", "int8", "cpu") == "fp32"
    assert prefill_gemm.choose("bf16", "fp32", "cpu") == "bf16"  # asked for: no measurement
    assert prefill_gemm.choose("fp32", "q4", "cpu") == "fp32"


def test_auto_takes_the_fastest_of_bf16_and_int8_past_the_bar(injected_timings):
    injected_timings(0.70, 0.20, 0.15)  # a CPU without AMX: bytes beat bf16
    assert prefill_gemm.choose("auto", "q4", "cpu") == "int8"
    assert prefill_gemm.choose("auto", "int8", "cpu") == "int8"
    assert prefill_gemm.choose("auto", "bf16", "cpu") == "bf16"  # bf16 weights: no int8 kernel
    assert prefill_gemm.attention_bf16("int8", "q4")  # bf16 is native here: attention takes it
    injected_timings(0.70, 0.10, 0.30)  # AMX: bf16 wins
    assert prefill_gemm.choose("auto", "q4", "cpu") == "bf16"
    injected_timings(0.30, 0.60, 0.18)  # AVX2 only: bf16 emulated, bytes 1.67x fp32
    assert prefill_gemm.choose("auto", "q4", "cpu") == "int8"
    assert not prefill_gemm.attention_bf16("int8", "q4")  # attention stays fp32 there
    injected_timings(0.30, 0.60, 0.25)  # bytes only 1.2x: under the bar
    assert prefill_gemm.choose("auto", "q4", "cpu") == "fp32"
    assert prefill_gemm.attention_bf16("bf16", "q4") and not prefill_gemm.attention_bf16(
        "fp32", "q4"
    )


def test_the_probe_times_the_int8_kernel_only_for_weights_it_takes():
    if cpu_extension.load() is None:
        pytest.skip("no CPU extension: no int8-activation kernel")
    assert set(prefill_gemm.probe_seconds("q4", reps=1)) == {"fp32", "bf16", "int8"}
    assert set(prefill_gemm.probe_seconds("bf16", reps=1)) == {"fp32", "bf16"}


def test_auto_does_not_measure_for_fp32_weights(monkeypatch):
    def never(weights):
        raise AssertionError("measured for fp32 weights")

    monkeypatch.setattr(prefill_gemm, "measured_seconds", never)
    assert prefill_gemm.choose("auto", "fp32", "cpu") == "fp32"


@pytest.mark.parametrize("fp32_s,bf16_s,expected", [(0.7, 0.1, "bf16"), (0.7, 0.6, "fp32")])
def test_a_loaded_models_matmuls_follow_autos_measurement(
    tmp_path, injected_timings, fp32_s, bf16_s, expected
):
    injected_timings(fp32_s, bf16_s)
    d, _ = tiny_llama_dir(tmp_path)
    model = load_model(d, load_config(d), 128, weights="int8", prefill_gemm="auto")
    assert model.prefill_gemm == expected
    assert model.gemm_dtype_for(MANY) == expected and model.gemm_dtype_for(FEW) == "fp32"
    has_skinny = cpu_extension.load() is not None
    for m in model.modules():
        if isinstance(m, Linear):
            # Only the copy each path needs: bf16 for many rows; oneDNN's fp32 packing only
            # where the few rows have no skinny kernel, or the many rows no bf16 copy.
            assert (m.prefill_bf16 is not None) == (expected == "bf16")
            assert (m.packed is None) == (expected == "bf16" and has_skinny)
            assert (m.skinny is not None) == has_skinny


@pytest.mark.parametrize("fmt", ["fp32", "int8", "q4"])
def test_linear_runs_many_rows_on_the_bf16_copy_and_few_on_the_fp32_kernel(fmt):
    torch.manual_seed(3)
    lin = Linear(128, 200, bias=True)
    if fmt != "fp32":
        lin.quantize(fmt, 32)
    lin.set_prefill_gemm("bf16")
    lin.pack_for_cpu()
    w = lin.weight.detach()  # the dequantized values
    x = torch.randn(MANY, 128)
    expected = F.linear(x.bfloat16(), w.bfloat16()).float() + lin.bias.detach()
    got = lin(x)
    assert lin.prefill_bf16.dtype == torch.bfloat16 and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    assert not torch.allclose(got, F.linear(x, w, lin.bias), rtol=1e-5, atol=1e-5)
    few = x[:FEW]  # the few-row kernel is untouched: int8 / q4 ones take int8 activations
    few_expected = (
        quant.int8_activation_reference(few, lin.quantized, lin.bias.detach())
        if lin.skinny is not None and lin.skinny_activations == "int8"
        else F.linear(few, w, lin.bias)
    )
    assert lin.skinny_activations == ("fp32" if fmt == "fp32" else "int8")
    torch.testing.assert_close(lin(few), few_expected, rtol=1e-4, atol=1e-4)
    lin.set_prefill_gemm("fp32")  # and back: the fp32 packing returns, the copy goes
    assert lin.prefill_bf16 is None and lin.packed is not None
    torch.testing.assert_close(lin(x), F.linear(x, w, lin.bias), rtol=1e-4, atol=1e-4)


def test_bf16_prefill_logits_are_close_to_fp32_prefill(tmp_path, monkeypatch):
    d, _ = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2)
    cfg = load_config(d)
    fp32 = load_model(d, cfg, 256, prefill_gemm="fp32")
    bf16 = load_model(d, cfg, 256, prefill_gemm="bf16")
    assert fp32.prefill_gemm == "fp32" and bf16.prefill_gemm == "bf16"
    ref, got = prefill_logits(fp32, MANY), prefill_logits(bf16, MANY)
    # bf16's own rounding (8 bits of mantissa) on a random model: small on average, a few
    # near-ties further apart; the argmax mostly the same.
    assert (got - ref).abs().mean() <= 0.03 * ref.std(), ((got - ref).abs().mean(), ref.std())
    assert (got - ref).abs().max() <= 0.1 * ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    # ... and exactly what every projection computing bf16(x) @ bf16(W)^T gives, with the
    # attention kernel's bf16 GEMMs (tests/test_kernels.py checks those against torch).
    emulated = load_model(d, cfg, 256, prefill_gemm="fp32")
    emulated.cpu_stack = None

    def bf16_forward(self, x):
        y = F.linear(x.bfloat16(), self.weight.bfloat16()).float()
        return y if self.bias is None else y + self.bias

    def bf16_attention(*args, **kwargs):
        return paged_attention(*args, **{**kwargs, "bf16": True})

    monkeypatch.setattr(Linear, "forward", bf16_forward)
    monkeypatch.setattr(engine.model, "paged_attention", bf16_attention)
    torch.testing.assert_close(got, prefill_logits(emulated, MANY), rtol=1e-3, atol=1e-3)
    monkeypatch.undo()
    # A batch the skinny kernels take runs the fp32 C++ layers in both: the same numbers.
    assert torch.equal(prefill_logits(bf16, FEW), prefill_logits(fp32, FEW))


def test_bf16_copy_is_of_the_quantized_values(tmp_path):
    d, _ = tiny_llama_dir(tmp_path)
    model = load_model(d, load_config(d), 128, weights="q4", prefill_gemm="bf16")
    lin = model.layers[0].mlp.down_proj
    dense = torch.randn(MANY, lin.in_features)
    deq = quant.dequantize(lin.quantized)
    expected = F.linear(dense.bfloat16(), deq.bfloat16()).float()
    torch.testing.assert_close(lin(dense), expected, rtol=2e-2, atol=2e-2)


def test_bench_engine_divides_prefill_flops_by_the_peak_of_the_dtype_in_use(tmp_path, monkeypatch):
    from pdserve.bench.micro import engine as bench_engine

    peaks = {torch.float32: 1e11, torch.bfloat16: 8e11}
    monkeypatch.setattr(bench_engine, "gemm_peak", lambda n=2048, dtype=torch.float32: peaks[dtype])
    monkeypatch.setattr(bench_engine, "read_bandwidth", lambda: 1e10)
    path, _ = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2)
    before = torch.get_num_threads()
    try:
        result = bench_engine.run(
            str(path), 1, (FEW, MANY), (1,), (32,), baseline=False, weights=("int8",),
            prefill_gemm=("fp32", "bf16"),
        )  # fmt: skip
    finally:
        torch.set_num_threads(before)
    assert result["gemm_peak_gflops"] == 100 and result["gemm_peak_bf16_gflops"] == 800
    cfg = load_config(path)
    prefill = [r for r in result["rows"] if r["kind"] == "prefill"]
    assert [(r["tokens"], r["prefill_gemm"]) for r in prefill] == [
        (FEW, "fp32"), (MANY, "fp32"), (FEW, "fp32"), (MANY, "bf16")
    ]  # fmt: skip
    for r in prefill:
        peak = peaks[torch.bfloat16 if r["prefill_gemm"] == "bf16" else torch.float32]
        flops = bench_engine.prefill_flops(cfg, r["tokens"])
        assert r["ratio"] == pytest.approx(flops / r["seconds"] / peak)
    report = bench_engine.format_report(result)
    assert "bf16 800.0" in report
    assert sum(line.startswith("prefill") and " bf16 " in line for line in report.splitlines()) == 1


def test_a_worker_process_gets_prefill_gemm_through_its_flags():
    import argparse

    from engine.args import add_engine_args, engine_args, engine_settings_from_args
    from engine.settings import EngineSettings

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    s = EngineSettings(weights="q4", prefill_gemm="bf16")
    assert engine_settings_from_args(parser.parse_args(engine_args(s))) == s
    assert parser.parse_args([]).prefill_gemm == "auto"


@pytest.mark.parametrize("fmt", ["int8", "q4"])
def test_int8_prefill_runs_many_rows_through_the_int8_activation_kernel(fmt):
    """Every row, many or few, is quantized per block of 32 and multiplied as bytes: the same
    kernel and reference as a decode step's rows, and no other copy of the weight is kept."""
    if cpu_extension.load() is None:
        pytest.skip("no CPU extension: no int8-activation kernel")
    torch.manual_seed(5)
    lin = Linear(128, 200, bias=True)
    lin.quantize(fmt, 32)
    lin.set_prefill_gemm("int8")
    lin.pack_for_cpu()
    assert lin.prefill_int8 and lin.packed is None and lin.prefill_bf16 is None
    x = torch.randn(MANY, 128)
    expected = quant.int8_activation_reference(x, lin.quantized, lin.bias.detach())
    torch.testing.assert_close(lin(x), expected, rtol=1e-4, atol=1e-4)
    # A row's result does not depend on the rows beside it.
    torch.testing.assert_close(lin(x)[:FEW], lin(x[:FEW]), rtol=0, atol=0)
    plain = Linear(128, 200, bias=False)  # fp32 weights have no int8 kernel: they stay fp32
    plain.set_prefill_gemm("int8")
    assert not plain.prefill_int8


def chunked_prefill_logits(model, n: int, chunk: int) -> torch.Tensor:
    """``prefill_logits`` of the same prompt, prefilled ``chunk`` tokens a forward."""
    ids = [(7 * i + 3) % model.cfg.vocab_size for i in range(n)]
    blocks = n // 16 + 1
    kv, table, out = model.allocate_kv_cache(blocks, 16), [list(range(blocks))], []
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        meta = AttentionMetadata.build([end - start], [end], table, 16)
        h = model(torch.tensor(ids[start:end]), torch.arange(start, end), meta, kv)
        out.append(model.compute_logits(h))
    return torch.cat(out)


@pytest.mark.parametrize("fused_layers", [True, False])
def test_int8_prefill_of_a_whole_prompt_equals_its_decode_sized_chunks(tmp_path, fused_layers):
    """A q4 model with prefill_gemm int8 (attention in fp32): one forward over MANY tokens
    gives the logits of the same prompt prefilled in chunks the skinny kernels take anyway, on
    the C++ layers and on the Python ones (what int8 rows cost on the real model:
    tests/test_quant_smollm2.py)."""
    if cpu_extension.load() is None:
        pytest.skip("no CPU extension: no int8-activation kernel")
    d, _ = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2)
    cfg = load_config(d)
    model = load_model(d, cfg, 256, weights="q4", prefill_gemm="fp32")
    fp32 = prefill_logits(model, MANY)
    model.use_prefill_gemm("int8", attention_bf16=False)
    assert model.gemm_dtype_for(MANY) == "int8" and model.gemm_dtype_for(FEW) == "fp32"
    assert model.cpu_stack is not None
    if not fused_layers:
        model.cpu_stack = None
    whole = prefill_logits(model, MANY)
    torch.testing.assert_close(whole, chunked_prefill_logits(model, MANY, FEW), rtol=0, atol=2e-5)
    assert (whole - fp32).abs().max() > 1e-3  # the rows really were quantized


def test_int8_prefill_attends_in_bf16_where_bf16_is_native(tmp_path, injected_timings):
    injected_timings(0.70, 0.20, 0.15)
    d, _ = tiny_llama_dir(tmp_path)
    model = load_model(d, load_config(d), 128, weights="q4", prefill_gemm="auto")
    assert model.prefill_gemm == "int8" and model.prefill_attention_bf16
    injected_timings(0.30, 0.60, 0.18)
    model = load_model(d, load_config(d), 128, weights="q4", prefill_gemm="auto")
    assert model.prefill_gemm == "int8" and not model.prefill_attention_bf16
