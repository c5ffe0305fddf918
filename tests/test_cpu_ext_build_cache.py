"""The CPU extension's build folder is keyed by what the build depends on, not by the checkout
(kernels/cpu_extension.py ``_build_directory``): a fresh clone of the same sources (CI) loads
the modules an earlier checkout built instead of compiling every variant again (2 minutes each
on 2 cores; the full suite's first load and test_bench_engine paid 380 s of it). Nothing is
compiled here: torch's loader is replaced by a fake that records what it was given."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from kernels import cpu_extension

VARIANT = cpu_extension.VARIANTS[-1]


@pytest.fixture
def build_root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    return root


def _checkout(tmp_path: Path, name: str) -> Path:
    """A copy of this checkout's csrc, as another clone has it."""
    csrc = tmp_path / name / "kernels" / "csrc"
    shutil.copytree(cpu_extension._CSRC, csrc)
    return csrc


def _fake_torch_load(calls: list[dict]):
    def load(name, sources, build_directory, **kw):
        calls.append({"sources": sources, "build_directory": build_directory, **kw})
        return SimpleNamespace(instruction_set=name.rsplit("_", 1)[1])

    return load


def test_two_checkouts_of_the_same_sources_build_in_one_folder_from_the_same_paths(
    tmp_path, build_root, monkeypatch
):
    import torch.utils.cpp_extension

    calls: list[dict] = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", _fake_torch_load(calls))
    for name in ("clone_a", "clone_b"):
        monkeypatch.setattr(cpu_extension, "_CSRC", _checkout(tmp_path, name))
        assert cpu_extension._build(VARIANT) is not None
    first, second = calls
    # Same folder, same source paths, same flags: torch's and ninja's records match, so the
    # second checkout's load finds the objects up to date.
    assert first == second
    folder = Path(first["build_directory"])
    assert folder.is_relative_to(build_root) and "clone" not in str(folder)
    for source in first["sources"]:
        assert Path(source).is_relative_to(folder)
    staged = folder / "src"
    original = cpu_extension.__file__.replace("cpu_extension.py", "csrc")
    assert sorted(p.name for p in staged.iterdir()) == sorted(
        p.name for p in Path(original).iterdir()
    )
    for path in staged.iterdir():  # headers too: the sources include them from beside them
        assert path.read_bytes() == (Path(original) / path.name).read_bytes()


def test_a_changed_header_or_flag_gets_a_folder_of_its_own(tmp_path, build_root, monkeypatch):
    monkeypatch.setattr(cpu_extension, "_CSRC", _checkout(tmp_path, "clone_a"))
    before = cpu_extension._build_directory(VARIANT.name)
    simd = cpu_extension._CSRC / "simd.h"
    simd.write_text(simd.read_text() + "\n// edited\n")
    edited = cpu_extension._build_directory(VARIANT.name)
    assert edited != before
    other_variant = cpu_extension.VARIANTS[0].name
    assert cpu_extension._build_directory(other_variant) not in (before, edited)
    monkeypatch.setenv("CXX", "clang++")
    assert cpu_extension._build_directory(VARIANT.name) != edited


def test_another_virtualenv_gets_a_folder_of_its_own(tmp_path, build_root, monkeypatch):
    """torch's include and library folders are in the compile and link commands: two
    virtualenvs in one folder made ninja recompile every object at each switch between them."""
    from torch.utils import cpp_extension as torch_ext

    mine = cpu_extension._build_directory(VARIANT.name)
    assert cpu_extension._build_directory(VARIANT.name) == mine  # the key is stable
    other_torch = [str(tmp_path / "other-venv" / "torch" / "include")]
    monkeypatch.setattr(torch_ext, "include_paths", lambda *a, **kw: other_torch)
    assert cpu_extension._build_directory(VARIANT.name) != mine
