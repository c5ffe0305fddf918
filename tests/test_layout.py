"""The project's top-level packages are the ones imported (names like ``kernels`` clash on PyPI)."""

from __future__ import annotations

import importlib
import re
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


def _packages() -> list[Path]:
    return sorted(
        init.parent
        for top in (*PROJECT, "tests")
        for init in (ROOT / top).rglob("__init__.py")
        if "__pycache__" not in init.parts
    )


@pytest.mark.parametrize("package", _packages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_each_package_opens_with_a_line_saying_what_it_owns(package):
    import ast

    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
    assert doc and len(doc.splitlines()[0]) > 20, f"{package.relative_to(ROOT)}/__init__.py"


@pytest.mark.parametrize("folder", ["cluster_configs", "scripts"])
def test_each_folder_without_python_opens_with_a_readme(folder):
    readme = ROOT / folder / "README.md"
    assert readme.is_file() and readme.read_text().strip(), readme


def _string_constants(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string literal that is not a docstring."""
    import ast

    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


# A path into docs/ (not a URL's /docs route, not prose: a string with no spaces).
DOCS_PATH = re.compile(r"(?:\./)?docs" + "/" + r"[^\s'\"]*")


def test_no_code_config_or_test_reads_a_file_under_docs():
    # docs/ is reference pages for people: a path into it in a string (a default, a fixture, a
    # config value) would make code depend on a page. Comments and docstrings may cite pages.
    found = []
    for top in (*PROJECT, "tests"):
        for path in (ROOT / top).rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")) or path == Path(__file__):
                continue  # generated, or this check's own patterns
            for line, text in _string_constants(path.read_text()):
                if text == "docs" or DOCS_PATH.fullmatch(text.strip()):
                    found.append(f"{path.relative_to(ROOT)}:{line}: {text[:80]!r}")
    for path in (ROOT / "cluster_configs").rglob("*.yaml"):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if DOCS_PATH.search(line.split("#")[0]):
                found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert found == []
