"""``pdserve bench engine``'s CPU kernel variants: switching a loaded model between builds, and
results that name the CPU, its instruction sets and each row's variant."""

from __future__ import annotations

import pytest
import torch

from engine.linear import Linear
from kernels import cpu_extension
from pdserve.bench.micro import engine as bench_engine
from tests.conftest import tiny_llama_dir


@pytest.fixture
def restore_choice(monkeypatch):
    monkeypatch.setattr(cpu_extension, "_selected", cpu_extension._selected)


def test_use_cpu_kernels_rebuilds_the_layers_from_the_chosen_build(
    tmp_path, make_engine, restore_choice
):
    path, _ = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2)
    model = make_engine(path, block_size=16, num_blocks=64).runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    for name in cpu_extension.runnable_variants():
        bench_engine.use_cpu_kernels(model, name)
        assert type(model.cpu_stack).__module__ == f"pdserve_cpu_kernels_{name}"
        assert all(m.skinny is not None for m in linears)
        assert cpu_extension.load().instruction_set == name
    bench_engine.use_cpu_kernels(model, "torch")
    assert model.cpu_stack is None and all(m.skinny is None for m in linears)
    assert cpu_extension.load() is None


def test_run_records_the_cpu_and_every_rows_variant(tmp_path, monkeypatch, restore_choice):
    path, _ = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2)
    monkeypatch.setattr(bench_engine, "gemm_peak", lambda: 1e11)  # the real ones take seconds
    monkeypatch.setattr(bench_engine, "read_bandwidth", lambda: 1e10)
    variants = (*cpu_extension.runnable_variants(), "torch")
    before = torch.get_num_threads()
    try:
        result = bench_engine.run(
            str(path), 1, (16,), (1,), (16,), baseline=False, cpu_kernels=variants
        )
    finally:
        torch.set_num_threads(before)
    assert result["cpu_kernels"] == list(variants)
    assert result["cpu_model"] and result["cpu_isa"]
    assert [r["cpu_kernels"] for r in result["rows"]] == [*variants, *variants]
    report = bench_engine.format_report(result)
    assert result["cpu_model"] in report and "kernels" in report
