"""DESIGN.md's arrows, held by a test: which package may import which.

``router`` -> workers over gRPC only; workers -> ``engine`` -> ``kernels``; workers ->
``kv_transfer``; everything may use ``protos`` and ``grpc_plumbing`` (the torch-free gRPC
plumbing the router and the workers share). The router uses only the engine's torch-free
modules and never imports torch nor ``kv_transfer``. The static check reads every import
statement (function-level ones too, since a lazy import is still an arrow; ``if TYPE_CHECKING:``
blocks excepted, since they never run); the subprocess check imports the router's entry points
and looks at what was loaded. The product never imports the lab (``pdserve/bench``) but for the
CLI, which dispatches ``pdserve bench``; and the project's modules import one another without
a circle (a function-level import that only hides one still counts).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = (
    "engine",
    "kernels",
    "kv_transfer",
    "prefill_worker",
    "decode_worker",
    "router",
    "pdserve",
    "protos",
    "grpc_plumbing",
)
# The engine's modules that import no torch: what the router may use (its tokenizer, request
# parameters and errors, the block-count helper, config defaults, model-folder resolution).
ENGINE_TORCH_FREE = (
    "engine.errors",
    "engine.tokenizer",
    "engine.request",
    "engine.block_manager",
    "engine.config",
    "engine.model_files",
)
WORKERS_AND_ABOVE = ("prefill_worker", "decode_worker", "router", "pdserve")
MODEL_AND_SAMPLING = (
    "engine.model",
    "engine.model_runner",
    "engine.sampler",
    "engine.penalties",
    "engine.llm_engine",
    "engine.loader",
    "engine.linear",
)


@dataclass(frozen=True)
class Rule:
    """Modules of ``package`` must not import anything under ``forbidden``, except what is
    under ``allowed`` (the longest match wins: an allowed module inside a forbidden package)."""

    package: str
    forbidden: tuple[str, ...]
    allowed: tuple[str, ...] = ()
    why: str = ""
    # Files or folders (relative to the root) whose imports the rule does not check.
    exempt: tuple[str, ...] = ()


RULES = (
    Rule(
        "router",
        ("torch", "transformers", "engine", "kernels", "kv_transfer", "prefill_worker")
        + ("decode_worker", "pdserve"),
        allowed=ENGINE_TORCH_FREE,
        why="the router reaches workers over gRPC only and uses the engine's torch-free modules",
    ),
    Rule(
        "engine",
        WORKERS_AND_ABOVE + ("kv_transfer",),
        why="the engine imports nothing above it, and no network",
    ),
    Rule(
        "kernels",
        tuple(p for p in PROJECT if p != "kernels"),
        why="kernels import nothing of the project",
    ),
    Rule("kv_transfer", WORKERS_AND_ABOVE + MODEL_AND_SAMPLING, why="KV moves, it does not model"),
    Rule("prefill_worker", ("decode_worker",), why="the prefill worker knows no decode loop"),
    Rule("decode_worker", ("prefill_worker",), why="the decode worker knows no prefill policy"),
    Rule("prefill_worker", ("router", "pdserve"), why="workers import nothing above them"),
    Rule("decode_worker", ("router", "pdserve"), why="workers import nothing above them"),
    Rule(
        "grpc_plumbing",
        tuple(p for p in PROJECT if p != "grpc_plumbing") + ("torch",),
        why="below everyone who uses it",
    ),
    Rule("protos", tuple(p for p in PROJECT if p != "protos"), why="contracts, no logic"),
    Rule(
        "pdserve",
        ("pdserve.bench",),
        exempt=("pdserve/bench", "pdserve/cli.py"),
        why="the product never imports the lab; only the CLI dispatches `pdserve bench`",
    ),
)


def _under(module: str, prefixes: tuple[str, ...]) -> int:
    """The length of the longest prefix in ``prefixes`` that ``module`` is (or is inside); 0."""
    return max((len(p) for p in prefixes if module == p or module.startswith(p + ".")), default=0)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in ``source`` that can run; ``from a import b``
    counts as ``a.b`` too, so ``from engine import model`` is seen as ``engine.model``."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                found.append((node.lineno, f"{node.module}.{alias.name}"))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def violations(root: Path, rules=RULES) -> list[str]:
    """Every import under ``root`` that breaks a rule, as ``path:line: module (why)``."""
    out = []
    for rule in rules:
        for path in sorted((root / rule.package).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue  # generated by protoc
            rel = path.relative_to(root).as_posix()
            if any(rel == e or rel.startswith(e + "/") for e in rule.exempt):
                continue
            for line, module in imported_modules(path.read_text()):
                if _under(module, rule.forbidden) > _under(module, rule.allowed):
                    out.append(f"{rel}:{line}: imports {module} ({rule.why})")
    return out


def test_the_packages_keep_the_arrows_of_the_design():
    assert violations(ROOT) == []


def _python_only(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if not n.endswith(".py") and not (Path(folder) / n).is_dir()]


def _scratch_copy(tmp_path: Path) -> Path:
    """The project's packages, their Python files only, under ``tmp_path``."""
    for package in PROJECT:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=_python_only)
    return tmp_path


@pytest.mark.parametrize(
    ("module", "forbidden_import"),
    [
        ("router/app.py", "import torch"),
        ("router/grpc_server.py", "from kv_transfer.transport_grpc import bind"),
        ("router/core.py", "from engine import model_runner"),
        ("router/pool.py", "from kernels.ops import paged_attention"),
        ("engine/scheduler.py", "from router.core import Router"),
        ("engine/block_manager.py", "import pdserve.cli"),
        ("engine/worker_base.py", "from decode_worker.worker import DecodeWorker"),
        ("kernels/ops.py", "from engine.config import CacheConfig"),
        ("prefill_worker/server.py", "from decode_worker.worker import DecodeWorker"),
        ("decode_worker/server.py", "import pdserve.config"),
        ("kv_transfer/receiver.py", "from engine.sampler import Sampler"),
        ("grpc_plumbing/server.py", "import torch"),
        ("pdserve/config.py", "from pdserve.bench import micro"),
    ],
)
def test_a_forbidden_import_in_a_scratch_copy_is_reported(tmp_path, module, forbidden_import):
    root = _scratch_copy(tmp_path)
    before = set(violations(root))
    path = root / module
    source = path.read_text()
    # Inside a function, as lazy imports are: those count too.
    path.write_text(source + f"\n\ndef _scratch():\n    {forbidden_import}\n")
    line = source.count("\n") + 4
    [new] = set(violations(root)) - before
    assert new.startswith(f"{module}:{line}: imports "), new


def test_an_allowed_import_and_a_type_checking_one_are_not_reported(tmp_path):
    root = _scratch_copy(tmp_path)
    path = root / "router" / "app.py"
    before = violations(root)
    path.write_text(
        path.read_text()
        + "\nfrom engine.block_manager import blocks_for\n"
        + "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
    )
    assert violations(root) == before


def test_the_cli_and_the_lab_itself_may_import_the_lab(tmp_path):
    root = _scratch_copy(tmp_path)
    before = violations(root)
    for module in ("pdserve/cli.py", "pdserve/bench/__init__.py"):
        path = root / module
        path.write_text(path.read_text() + "\n\ndef _scratch():\n    import pdserve.bench.micro\n")
    assert violations(root) == before


def project_modules(root: Path) -> dict[str, Path]:
    """Every module of the project's packages under ``root``, by dotted name (a package is its
    ``__init__``); protoc's generated modules left out."""
    found = {}
    for package in PROJECT:
        for path in (root / package).rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the project modules it imports (function-level imports too, ``if
    TYPE_CHECKING:`` ones not). ``from a.b import c`` is ``a.b.c`` where that is a module,
    else ``a.b``: the longest dotted prefix that names a module."""
    modules = project_modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for _, imported in imported_modules(path.read_text()):
            parts = imported.split(".")
            prefixes = (".".join(parts[:n]) for n in range(len(parts), 0, -1))
            target = next((p for p in prefixes if p in modules), None)
            if target is not None and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def a_cycle_through(graph: dict[str, set[str]], component: list[str]) -> str:
    """One import circle inside ``component``, as ``a -> b -> ... -> a`` (breadth-first, so
    the shortest back to its first module)."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return " -> ".join([start, *reversed(path[:-1]), start])
                if w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{component} is not strongly connected")


def import_cycles(root: Path) -> list[str]:
    graph = import_graph(root)
    return [a_cycle_through(graph, c) for c in strongly_connected(graph)]


def test_the_project_has_no_import_cycle():
    # A function-level import hides a circle from Python, not from the design: untie it by
    # moving what both sides need below both.
    cycles = import_cycles(ROOT)
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)


def test_an_import_cycle_in_a_scratch_copy_is_reported(tmp_path):
    root = _scratch_copy(tmp_path)
    assert import_cycles(root) == import_cycles(ROOT)
    path = root / "engine" / "errors.py"
    typed = "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import engine.step\n"
    path.write_text(path.read_text() + typed)
    assert import_cycles(root) == import_cycles(ROOT)  # never runs: no circle
    # engine.step imports engine.errors; a lazy import back closes the circle.
    path.write_text(path.read_text() + "\n\ndef _scratch():\n    from engine import step\n")
    [cycle] = import_cycles(root)
    assert "engine.errors -> engine.step -> " in cycle, cycle


def modules_loaded_by(imports: str) -> set[str]:
    """The top-level modules in sys.modules after a fresh interpreter runs ``imports``."""
    code = (
        f"import sys\n{imports}\nprint(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


HEAVY = {"torch", "transformers", "kv_transfer", "kernels"}


def test_the_router_entry_points_load_no_torch_and_no_transformers():
    loaded = modules_loaded_by("import router.app, router.__main__, router.http.routes")
    assert "router" in loaded and not loaded & HEAVY, sorted(loaded & HEAVY)


def test_the_kv_transport_interfaces_and_registry_load_no_torch():
    # What a router or a config could use of kv_transfer, were it ever allowed to.
    loaded = modules_loaded_by("import kv_transfer.interfaces, kv_transfer.transports")
    assert "kv_transfer" in loaded
    assert not loaded & {"torch", "numpy", "grpc", "pyarrow"}, sorted(loaded)


def test_the_subprocess_check_sees_torch_when_something_pulls_it_in():
    # The same check, with one import that loads torch: it must notice.
    loaded = modules_loaded_by("import router.app, kv_transfer.frame")
    assert {"torch", "kv_transfer"} <= loaded


PACKAGES = sorted(
    ".".join(init.relative_to(ROOT).parent.parts)
    for top in PROJECT
    for init in (ROOT / top).rglob("__init__.py")
)


def test_package_inits_import_nothing_heavy():
    # One interpreter for all of them: what any __init__ pulls in shows up here.
    loaded = modules_loaded_by("\n".join(f"import {p}" for p in PACKAGES))
    assert len(PACKAGES) >= len(PROJECT)
    assert not loaded & {"torch", "transformers", "grpc", "ray", "numpy", "pydantic"}, loaded
