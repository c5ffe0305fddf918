"""No deserializer that runs code on the data plane: the packages that read bytes off sockets
(router, workers, KV transfer, wire contracts, the engine they feed, the client) never import
pickle, cloudpickle, dill, marshal or shelve, nor call eval or exec (vLLM CVE-2025-32444 and
CVE-2025-47277, SGLang CVE-2025-10164 were pickle on a socket). torch.load is allowed only with
weights_only=True."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DATA_PLANE = ["router", "prefill_worker", "decode_worker", "kv_transfer", "protos", "engine"]
DATA_PLANE_FILES = [
    "pdserve/client.py",
    "pdserve/cluster/local.py",
    "pdserve/cluster/ray_actors.py",
]
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve"}
BANNED_CALLS = {"eval", "exec", "__import__"}


def data_plane_sources() -> list[Path]:
    files = [p for pkg in DATA_PLANE for p in sorted((REPO / pkg).rglob("*.py"))]
    return files + [REPO / f for f in DATA_PLANE_FILES]


def problems(source: str, name: str) -> list[str]:
    tree = ast.parse(source, name)
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        found += [f"imports {n}" for n in names if n.split(".")[0] in BANNED_MODULES]
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else getattr(fn, "attr", None)
            if isinstance(fn, ast.Name) and name in BANNED_CALLS:
                found.append(f"calls {name}()")
            if name == "load" and _is_torch_load(fn) and not _weights_only(node):
                found.append("calls torch.load without weights_only=True")
    return [f"{name}: {p}" for p in found]


def _is_torch_load(fn) -> bool:
    return isinstance(fn, ast.Attribute) and getattr(fn.value, "id", None) == "torch"


def _weights_only(call: ast.Call) -> bool:
    return any(
        k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
        for k in call.keywords
    )


def test_the_data_plane_has_no_pickle_marshal_eval_or_exec():
    sources = data_plane_sources()
    assert len(sources) > 40  # the scan really covers the packages
    bad = [p for f in sources for p in problems(f.read_text(), str(f.relative_to(REPO)))]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "code",
    [
        "import pickle",
        "import cloudpickle as cp",
        "from marshal import loads",
        "from pickle import loads",
        "eval('1')",
        "exec('x = 1')",
        "torch.load(f)",
    ],
)
def test_the_scan_catches(code):
    assert problems(code, "probe.py")
    assert not problems("torch.load(f, weights_only=True)", "ok.py")
