"""``pdserve serve embedded --tensor-parallel-size 3:1`` on the Ray path (issue 49): prefill
workers of 3 ranks (the embedded model has 9 query and 3 KV heads), decode of 1, KV moving
between the degrees over grpc. The official openai client's greedy chat answer is transformers'
greedy text; ``pdserve status`` shows the prefill worker as its 3 ranks; and on SIGTERM every
rank exits with the cluster."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
import yaml

from tests.conftest import needs_embedded

pytestmark = [pytest.mark.slow, needs_embedded]

QUESTION = "What is the capital of France?"
MAX_TOKENS = 24
RANKS_EXIT_S = 30.0


@pytest.fixture(scope="module")
def transformers_text() -> str:
    """transformers' greedy answer to QUESTION (stopping at EOS, as the server does)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.loader import EMBEDDED_GGUF, embedded_gguf_path

    gguf = embedded_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=EMBEDDED_GGUF)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=EMBEDDED_GGUF, dtype=torch.float32
    ).eval()
    messages = [{"role": "user", "content": QUESTION}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS
        )
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _status(ray_address: str) -> tuple[str, dict]:
    """``pdserve status`` as the operator sees it, and the raw status it was made from."""
    import ray

    from pdserve.cluster.ray_launcher import find_controller

    cli = [sys.executable, "-m", "pdserve.cli", "status", "--address", ray_address]
    text = subprocess.run(cli, capture_output=True, text=True, timeout=120, check=True).stdout
    return text, ray.get(find_controller(ray_address).status.remote())


def test_serve_embedded_tp3_prefill_answers_openai_as_transformers(tmp_path, transformers_text):
    import openai
    import ray

    from pdserve.config import load_config
    from tests.ray_utils import init_local_ray
    from tests.test_ray_cluster import _read_until_ready, start_serve

    config = tmp_path / "local.yaml"
    config.write_text(yaml.safe_dump(load_config().with_overrides(grpc_port=0).model_dump()))
    ray_address = init_local_ray()  # 4 CPUs: prefill's 3 bundles and decode's 1
    port = _free_port()
    argv = ["embedded", "--tensor-parallel-size", "3:1", "--port", str(port)]
    proc = start_serve(config, *argv, "--address", ray_address)
    lines: list[str] = []
    try:
        url = "http://" + _read_until_ready(proc, lines)["http"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        chat = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        assert chat.choices[0].message.content == transformers_text
        text, st = _status(ray_address)
        [prefill] = st["pools"]["prefill"]["workers"]
        ranks = prefill["tensor_parallel"]["ranks"]
        assert [(r["rank"], r["alive"]) for r in ranks] == [(0, True), (1, True), (2, True)]
        assert [line.split()[:2] for line in text.splitlines() if "rank " in line] == [
            ["rank", "0/3"],
            ["rank", "1/3"],
            ["rank", "2/3"],
        ], text
        [decode] = st["pools"]["decode"]["workers"]
        assert (decode["tensor_parallel"] or {"size": 1})["size"] == 1
        proc.terminate()
        assert proc.wait(120) == 0, "".join(lines)
        deadline = time.monotonic() + RANKS_EXIT_S
        while time.monotonic() < deadline and any(_alive(r["pid"]) for r in ranks):
            time.sleep(0.5)
        assert not [r for r in ranks if _alive(r["pid"])], "ranks outlived the cluster"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        ray.shutdown()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
