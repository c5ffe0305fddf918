"""The project's top-level packages are the ones imported (names like ``kernels`` clash on PyPI)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from tests.test_import_boundaries import PROJECT

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", PROJECT)
def test_own_package_is_imported(name):
    module = importlib.import_module(name)
    assert Path(module.__file__).resolve().parent == ROOT / name


def test_tokenizer_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, engine.tokenizer, engine.errors; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True
    )
    assert out.stdout.strip() == "False", out.stderr


def test_every_top_level_package_is_under_the_import_rules():
    # A new top-level package must join PROJECT (and so test_import_boundaries' rules).
    found = {init.parent.name for init in ROOT.glob("*/__init__.py")} - {"tests"}
    assert found == set(PROJECT)
