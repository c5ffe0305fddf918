"""Every third-party import is declared in pyproject.toml (a fresh machine has nothing else)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.dependency_check import ROOT, find_undeclared, requirement_name, top_level_imports


def test_every_import_of_the_project_and_its_tests_is_declared():
    problems = find_undeclared(ROOT)
    assert not problems, "\n".join(map(str, problems))


def _project(tmp_path: Path, package_source: str, test_source: str = "") -> Path:
    (tmp_path / "pyproject.toml").write_text(
        textwrap.dedent(
            """\
            [project]
            name = "fixture"
            dependencies = ["NumPy>=1.26", "pyyaml"]
            [project.optional-dependencies]
            test = ["pytest>=8"]
            """
        )
    )
    pkg = tmp_path / "app"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "core.py").write_text(textwrap.dedent(package_source))
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_core.py").write_text(textwrap.dedent(test_source))
    return tmp_path


def test_a_fixture_with_only_declared_imports_passes(tmp_path):
    root = _project(
        tmp_path,
        """\
        import json, os.path
        import numpy as np
        from yaml import safe_load
        from app import core
        try:
            import definitely_not_installed_module
        except ImportError:  # optional by design
            definitely_not_installed_module = None
        """,
        "import pytest\nfrom app.core import np\n",
    )
    assert find_undeclared(root) == []


def test_a_fixture_with_undeclared_imports_fails(tmp_path):
    # `packaging` is installed here (transformers pulls it in) but the fixture does not
    # declare it: exactly the import that works on a developer's machine only.
    root = _project(
        tmp_path,
        "import numpy\nimport packaging.version\nimport definitely_not_installed_module\n",
        "import pytest\nimport httpx\n",
    )
    found = {(p.module, p.path) for p in find_undeclared(root)}
    assert found == {
        ("packaging", "app/core.py"),
        ("definitely_not_installed_module", "app/core.py"),
        ("httpx", "tests/test_core.py"),
    }


def test_test_only_dependencies_do_not_count_for_the_packages(tmp_path):
    root = _project(tmp_path, "import pytest\n")
    assert [(p.module, p.path) for p in find_undeclared(root)] == [("pytest", "app/core.py")]


def test_requirement_names_are_normalised():
    assert requirement_name("Typing_Extensions>=4.7") == "typing-extensions"
    assert requirement_name("ray[default]>=2.30") == "ray"
    assert requirement_name("triton>=3.0; platform_system == 'Linux'") == "triton"
    names = top_level_imports(
        __import__("ast").parse("import a.b\nfrom c.d import e\nfrom . import f")
    )
    assert names == ["a", "c"]


def test_a_script_may_import_its_sibling_module_but_not_a_missing_one(tmp_path):
    root = _project(tmp_path, "import json\n")
    (root / "scripts").mkdir()
    (root / "scripts" / "report_tables.py").write_text("import json\n")
    (root / "scripts" / "report.py").write_text("import report_tables\nimport report_missing\n")
    found = {(p.module, p.path) for p in find_undeclared(root)}
    assert found == {("report_missing", "scripts/report.py")}
