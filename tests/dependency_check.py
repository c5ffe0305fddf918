"""Which third-party imports no declared distribution provides (pyproject.toml, via ast).

A fresh machine installs only what pyproject.toml declares, so an import that some other
package happens to pull in works on a developer's machine and fails on a user's. Every
top-level import of the project's packages must come from a runtime dependency; those of the
tests and scripts may also come from the test extra. An import inside ``try: ... except
ImportError`` is optional by design and skipped.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from importlib.metadata import packages_distributions
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
TEST_DIRS = ("tests", "scripts")


@dataclass(frozen=True)
class Undeclared:
    module: str
    path: str
    provided_by: tuple[str, ...]  # installed distributions with that module; () if none

    def __str__(self) -> str:
        where = ", ".join(self.provided_by) or "no installed distribution"
        return f"{self.path}: imports {self.module!r} (from {where}), which is not declared"


def normalize(name: str) -> str:
    """PEP 503 names: 'Typing_Extensions' and 'typing-extensions' are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return normalize(re.split(r"[\s\[<>=!~;@]", requirement.strip(), maxsplit=1)[0])


def declared(pyproject: Path) -> tuple[set[str], set[str]]:
    """(runtime distributions, runtime + every optional extra)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    runtime = {requirement_name(r) for r in project.get("dependencies", [])}
    extras = {
        requirement_name(r) for v in project.get("optional-dependencies", {}).values() for r in v
    }
    return runtime, runtime | extras


def local_packages(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if (p / "__init__.py").is_file()} | {"tests"}


def top_level_imports(tree: ast.AST) -> list[str]:
    """Absolute imports outside ``try/except ImportError`` blocks, as top-level names."""
    optional: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
            # The import tried and its fallback in the handler are both optional.
            stmts = [*node.body, *(s for h in node.handlers for s in h.body)]
            optional.update(id(n) for stmt in stmts for n in ast.walk(stmt))
    names = []
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            names += [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module.split(".")[0])
    return names


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(
        isinstance(k, ast.Name) and k.id in ("ImportError", "ModuleNotFoundError") for k in kinds
    )


def python_files(root: Path, packages: set[str]) -> list[Path]:
    dirs = [root / name for name in sorted(packages | set(TEST_DIRS))]
    return sorted(f for d in dirs if d.is_dir() for f in d.rglob("*.py"))


def find_undeclared(root: Path = ROOT) -> list[Undeclared]:
    runtime, with_extras = declared(root / "pyproject.toml")
    local = local_packages(root)
    providers = {
        m: tuple(sorted({normalize(d) for d in ds})) for m, ds in packages_distributions().items()
    }
    problems = []
    for path in python_files(root, local):
        rel = path.relative_to(root)
        allowed = with_extras if rel.parts[0] in TEST_DIRS else runtime
        for module in sorted(set(top_level_imports(ast.parse(path.read_text(), str(rel))))):
            if module in sys.stdlib_module_names or module in local or module == "__future__":
                continue
            if rel.parts[0] == "scripts" and (path.parent / f"{module}.py").is_file():
                continue  # a script's own folder is on its path: a sibling module is local
            have = providers.get(module, ())
            if not set(have) & allowed:
                problems.append(Undeclared(module, str(rel), have))
    return problems


if __name__ == "__main__":
    found = find_undeclared()
    print("\n".join(map(str, found)) or "every import is declared")
    sys.exit(1 if found else 0)
