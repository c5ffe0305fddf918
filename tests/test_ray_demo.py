"""``pdserve demo`` end to end on the embedded model: the README's "run the main job" command."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from pdserve.config import REPO_ROOT
from tests.conftest import needs_embedded


@pytest.mark.slow
@needs_embedded
def test_demo_streams_through_the_disaggregated_path_and_stops():
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "demo", "--max-tokens", "16"],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "p.queue" in out and "kv xfer" in out and "d.queue" in out and "KV bytes" in out
    rows = [line for line in out.splitlines() if re.match(r"\s*\d+\s+\d+\s+\d+\s", line)]
    assert len(rows) == 6, out
    assert "6 requests" in out
