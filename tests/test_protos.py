"""The committed generated modules are what protos/generate.sh makes from the .proto today."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ["pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py"]


def test_generated_modules_are_up_to_date(tmp_path):
    (tmp_path / "protos").mkdir()
    shutil.copy(ROOT / "protos" / "pdserve.proto", tmp_path / "protos")
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        "-I.",
        "--python_out=.",
        "--pyi_out=.",
        "--grpc_python_out=.",
        "protos/pdserve.proto",
    ]
    subprocess.run(cmd, cwd=tmp_path, check=True)
    for name in GENERATED:
        fresh = (tmp_path / "protos" / name).read_text()
        committed = (ROOT / "protos" / name).read_text()
        assert fresh == committed, f"protos/{name} is stale: run bash protos/generate.sh"


def test_services_are_defined():
    from protos import pdserve_pb2

    names = set(pdserve_pb2.DESCRIPTOR.services_by_name)
    assert {"Generation", "DecodeWorker", "PrefillWorker", "KvTransfer"} <= names
