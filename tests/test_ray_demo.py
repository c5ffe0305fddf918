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
    line = re.search(
        r"first request after ready: TTFT ([\d.]+) ms; median of the next 10: ([\d.]+) ms; "
        r"ratio ([\d.]+)x",
        out,
    )
    assert line, out
    first, median, ratio = map(float, line.groups())
    assert abs(first / median - ratio) < 0.01 + 0.01 * ratio
    assert "columns:" in out and "p.queue = waiting for the prefill worker" in out


@pytest.mark.slow
@needs_embedded
def test_serve_on_the_embedded_default_answers_health_completions_and_openai(tmp_path):
    """The README's `pdserve serve` and curl, with the official client: the embedded default
    config, on free ports."""
    import httpx
    import openai
    import yaml

    from pdserve.config import load_config
    from tests.test_ray_cluster import _read_until_ready, start_serve

    config = tmp_path / "local.yaml"
    cfg = load_config(None).with_overrides(grpc_port=0, http_port=0)
    config.write_text(yaml.safe_dump(cfg.model_dump()))
    proc = start_serve(config)
    lines: list[str] = []
    try:
        url = "http://" + _read_until_ready(proc, lines)["http"]
        health = httpx.get(f"{url}/health", timeout=30)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 8}
        done = httpx.post(f"{url}/v1/completions", json={**body, "temperature": 0}, timeout=120)
        assert done.status_code == 200, done.text
        assert done.json()["usage"]["completion_tokens"] == 8
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        chat = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Name three fruits."}],
            max_tokens=16,
            temperature=0,
        )
        assert chat.choices[0].message.content and chat.usage.completion_tokens > 0
        proc.terminate()
        assert proc.wait(60) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
