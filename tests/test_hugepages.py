"""Huge pages for torch's large CPU tensors: requested by every process entry point."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import hugepages

REPO = Path(__file__).resolve().parents[1]
THP_POSSIBLE = hugepages.kernel_mode() in ("always", "madvise")


def _python(code: str, **env) -> str:
    full = {
        k: v for k, v in os.environ.items() if k not in (hugepages.TORCH_ENV, hugepages.OPT_OUT_ENV)
    }
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**full, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip()


def test_request_sets_torchs_variable_unless_opted_out(monkeypatch):
    monkeypatch.delenv(hugepages.TORCH_ENV, raising=False)
    monkeypatch.setenv(hugepages.OPT_OUT_ENV, "0")
    hugepages.request()
    assert hugepages.TORCH_ENV not in os.environ
    assert hugepages.env_vars() == {}
    monkeypatch.delenv(hugepages.OPT_OUT_ENV)
    assert not hugepages.request()  # torch is loaded in this process: too late for it
    assert os.environ[hugepages.TORCH_ENV] == "1"  # but child processes inherit it
    assert hugepages.request()  # already set, as when inherited from a parent process
    assert hugepages.env_vars() == {hugepages.TORCH_ENV: "1"}


@pytest.mark.parametrize(
    "entry", ["pdserve.cli", "prefill_worker.__main__", "decode_worker.__main__"]
)
def test_entry_points_request_huge_pages_before_torch_loads(entry):
    # Importing the entry module runs its request(); torch must not be loaded before it.
    code = (
        "import importlib, os, sys\n"
        f"importlib.import_module({entry!r})\n"
        f"print(os.environ.get({hugepages.TORCH_ENV!r}, ''))\n"
    )
    assert _python(code) == "1"


@pytest.mark.skipif(not THP_POSSIBLE, reason="the kernel's transparent huge pages are off")
def test_large_tensors_land_on_huge_pages_only_when_requested():
    code = "from engine import hugepages; hugepages.request(); print(hugepages.active())"
    assert _python(code) == "True"
    if hugepages.kernel_mode() == "madvise":  # with "always" every process gets them anyway
        assert _python(code, **{hugepages.OPT_OUT_ENV: "0"}) == "False"
