"""Tensor-parallel workers on the Ray path (issue 49). ``pdserve serve embedded`` with a
cluster YAML of prefill tensor_parallel_size 3 and decode 1: prefill workers of 3 ranks (the embedded model has 9 query and 3 KV
heads), decode of 1, KV moving between the degrees over grpc; the official openai client's
greedy chat answer is transformers' greedy text, ``pdserve status`` shows the prefill worker as
its 3 ranks, and on SIGTERM every rank exits with the cluster. And a decode worker of 2 ranks
whose follower is killed -9 is replaced whole: a new worker in a new placement group, the old
group and the old ranks gone, the answers token-exact again."""

from __future__ import annotations

import os
import signal
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

    # The degrees in the cluster YAML, as an operator writes them (the flag sets the same).
    base = load_config()
    pools = base.pools.model_dump()
    pools["prefill"]["tensor_parallel_size"] = 3
    config = tmp_path / "local.yaml"
    config.write_text(yaml.safe_dump(base.with_overrides(grpc_port=0, pools=pools).model_dump()))
    assert "tensor_parallel_size: 3" in config.read_text()
    ray_address = init_local_ray()  # 4 CPUs: prefill's 3 bundles and decode's 1
    port = _free_port()
    argv = ["embedded", "--port", str(port)]
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


def test_a_decode_worker_that_loses_a_rank_comes_back_whole(tmp_path):
    import ray
    from ray.util import placement_group_table

    from pdserve.cluster.ray_launcher import launch
    from tests.conftest import tiny_llama_dir
    from tests.ray_utils import (
        engine_reference,
        generate,
        init_local_ray,
        make_prompts,
        tiny_config,
        wait_for,
    )

    model, _ = tiny_llama_dir(tmp_path, num_kv_heads=2, seed=5)
    prompts = make_prompts(4, seed=1)
    reference = engine_reference(model, prompts)
    pool = {"num_cpus": 0, "threads": 1, "min": 1, "max": 2}
    pools = {"prefill": pool, "decode": {**pool, "tensor_parallel_size": 2}}
    init_local_ray()
    try:
        with launch(tiny_config(model, pools=pools), progress=False) as cluster:
            assert [o.token_ids for o in generate(cluster.grpc_address, prompts)] == reference

            def decode_row() -> dict | None:  # once the health loop has read its status
                [row] = cluster.status()["pools"]["decode"]["workers"]
                return row if row["tensor_parallel"] else None

            old = wait_for(decode_row, 10, "the decode worker's ranks in the status")
            old_ranks = old["tensor_parallel"]["ranks"]
            os.kill(old_ranks[1]["pid"], signal.SIGKILL)

            def replaced() -> dict | None:
                workers = cluster.status()["pools"]["decode"]["workers"]
                new = [w for w in workers if w["id"] != old["id"] and w["state"] == "ready"]
                ranks = (new[0]["tensor_parallel"] or {}).get("ranks") if new else None
                return (
                    new[0]
                    if len(workers) == 1 and ranks and all(r["alive"] for r in ranks)
                    else None
                )

            new = wait_for(replaced, 120, "a whole decode worker in the lost one's place")
            events = "\n".join(cluster.status()["events"])
            assert f"{old['id']} at {old['address']} is dead (its tensor-parallel rank 1" in events
            wait_for(
                lambda: not any(_alive(r["pid"]) for r in old_ranks), RANKS_EXIT_S, "old ranks"
            )
            created = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
            assert len(created) == 1 and len(created[0]["bundles"]) == 2  # the new worker's only
            assert {r["pid"] for r in new["tensor_parallel"]["ranks"]}.isdisjoint(
                r["pid"] for r in old_ranks
            )
            assert [o.token_ids for o in generate(cluster.grpc_address, prompts)] == reference
    finally:
        ray.shutdown()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
