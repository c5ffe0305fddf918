"""Which build of the CPU extension runs: chosen from the CPU's flags, forced by
PDSERVE_CPU_ISA, never one whose instructions the CPU lacks; and the AVX2 build really holds no
AVX-512 code (it must run on AVX2-only CPUs such as AMD EPYC before Zen 4)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kernels import cpu_extension
from tests import cpu_variants

ext = cpu_variants.ext  # fixture: each build in turn (AVX-512, AVX2)

AVX2_ONLY = cpu_extension.VARIANTS[-1].cpu_flags | {"sse4_2"}  # e.g. an AMD EPYC Zen 2/3
AVX512_NO_VNNI = cpu_extension.VARIANTS[1].cpu_flags | AVX2_ONLY  # e.g. a Skylake-SP Xeon


@pytest.fixture
def fresh_choice(monkeypatch):
    """Forget this process's choice so the test's environment decides it again."""
    monkeypatch.setattr(cpu_extension, "_selected", None)
    monkeypatch.delenv("PDSERVE_CPU_ISA", raising=False)
    monkeypatch.delenv("PDSERVE_NO_CPU_EXT", raising=False)


def test_each_build_is_compiled_for_its_own_instruction_set(ext):
    assert ext.instruction_set in {v.name for v in cpu_extension.VARIANTS}
    assert ext is cpu_extension.load(ext.instruction_set)


def test_the_best_runnable_build_is_chosen(fresh_choice, monkeypatch):
    monkeypatch.setattr(cpu_extension, "cpu_flags", lambda: frozenset(AVX2_ONLY))
    assert cpu_extension.runnable_variants() == ["avx2"]
    assert cpu_extension.selected_variant() == "avx2"
    assert cpu_extension.load().instruction_set == "avx2"


def test_avx512_without_the_int8_dot_product_gets_the_plain_avx512_build(fresh_choice, monkeypatch):
    monkeypatch.setattr(cpu_extension, "cpu_flags", lambda: frozenset(AVX512_NO_VNNI))
    assert cpu_extension.runnable_variants() == ["avx512", "avx2"]
    monkeypatch.setattr(cpu_extension, "cpu_flags", lambda: AVX512_NO_VNNI | {"avx512_vnni"})
    assert cpu_extension.runnable_variants() == ["avx512vnni", "avx512", "avx2"]


def test_a_cpu_without_avx2_gets_the_torch_path(fresh_choice, monkeypatch):
    monkeypatch.setattr(cpu_extension, "cpu_flags", lambda: frozenset({"sse4_2", "avx"}))
    monkeypatch.setattr(cpu_extension, "_modules", {"torch": None})  # nothing built yet
    assert cpu_extension.selected_variant() == "torch"
    assert cpu_extension.load() is None
    assert cpu_extension.load("avx2") is None  # never a build the CPU cannot run


@pytest.mark.parametrize("name", cpu_extension.CHOICES)
def test_the_environment_forces_a_variant(fresh_choice, monkeypatch, name):
    monkeypatch.setenv("PDSERVE_CPU_ISA", name)
    expected = name if name in cpu_extension.runnable_variants() + ["torch"] else "torch"
    assert cpu_extension.selected_variant() == expected
    assert cpu_extension.describe()["cpu_kernels"] == expected


def test_forcing_an_instruction_set_the_cpu_lacks_falls_back_to_torch(fresh_choice, monkeypatch):
    monkeypatch.setattr(cpu_extension, "cpu_flags", lambda: frozenset(AVX2_ONLY))
    monkeypatch.setenv("PDSERVE_CPU_ISA", "avx512")
    assert cpu_extension.selected_variant() == "torch"


def test_no_cpu_ext_means_torch_and_unknown_names_are_refused(fresh_choice, monkeypatch):
    monkeypatch.setenv("PDSERVE_NO_CPU_EXT", "1")
    assert cpu_extension.selected_variant() == "torch"
    with pytest.raises(ValueError, match="expected one of"):
        cpu_extension.use("sse2")
    with pytest.raises(ValueError, match="expected one of"):
        cpu_extension.load("neon")


def test_describe_names_the_cpu_and_its_instruction_sets():
    info = cpu_extension.describe()
    assert info["cpu_model"] and info["cpu_isa"]
    assert set(info["cpu_isa"].split("+")) <= {"avx512vnni", "avx512", "avx2", "none"}


def test_builds_agree_with_each_other_on_a_decode_step():
    """The same paged decode through every build: equal to float rounding."""
    builds = [cpu_extension.load(n) for n in cpu_extension.runnable_variants()]
    builds = [b for b in builds if b is not None]
    if len(builds) < 2:
        pytest.skip("fewer than two builds run on this CPU")
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(8, 16, 2, 64, generator=g), torch.randn(8, 16, 2, 64, generator=g)
    q = torch.randn(3, 6, 64, generator=g)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 0]], dtype=torch.int32)
    lens = torch.tensor([40, 17, 23], dtype=torch.int32)
    outs = [b.paged_decode_attention(q, k, v, tables, lens, 0.125) for b in builds]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-6)


# zmm registers, ymm/xmm 16-31 and mask registers exist only with AVX-512 (EVEX encoding).
AVX512_OPERAND = re.compile(r"%zmm\d|%[xy]mm(1[6-9]|2\d|3[01])\b|%k[0-7]\b")


def _disassembly(variant: str) -> list[str]:
    module = cpu_extension.load(variant)
    if module is None:
        pytest.skip(f"no {variant} build on this CPU")
    return subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(Path(module.__file__))],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump")
def test_the_avx2_build_holds_no_avx512_instruction():
    hits = [line for line in _disassembly("avx2") if AVX512_OPERAND.search(line)]
    assert not hits, hits[:5]


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump")
def test_only_the_vnni_build_holds_the_int8_dot_product():
    """The plain AVX-512 build must run on Skylake-SP, which has no vpdpbusd."""
    assert not [line for line in _disassembly("avx512") if "vpdpbus" in line]
    assert [line for line in _disassembly("avx512vnni") if "vpdpbusd" in line]
