"""Fuzz the public HTTP API from its own OpenAPI schema (issue 19): schemathesis generates
requests for every operation, bodies that fit the schema and bodies that break it, and sends
them to a live tiny cluster. None may get a 5xx, the server stays up, and every KV block is
free at the end.

About 350 requests run in the normal suite (seconds); the slow marker runs thousands (at
least 4,000 asserted). Two processes beside the server's generate and send them
(tests/http_fuzz_cases.py): generation is the larger part, and in the server's process it
waited for the server's turn on the interpreter lock with a core idle.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import schemathesis
from schemathesis import GenerationMode

from tests.cluster_utils import assert_all_blocks_free, http_cluster
from tests.conftest import tiny_llama_dir
from tests.http_fuzz_cases import check_stream, fuzz_operation

ROOT = Path(__file__).resolve().parents[1]
FUZZ_PROCESSES = 2  # beside the server's: generating the requests is the larger part


@pytest.fixture(scope="module")
def fuzzed_cluster(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("fuzz"), seed=9)
    with http_cluster(path) as cluster:  # asserts every block free at the end
        yield cluster


def _fuzz(cluster, examples: int, claims: Path) -> collections.Counter:
    """Every operation of the served schema, ``examples`` generated requests per operation
    and mode (valid bodies; invalid ones for operations that take a body), each checked
    (tests/http_fuzz_cases.py), sent by FUZZ_PROCESSES processes that share the pairs out;
    returns the requests sent per (operation, mode)."""
    argv = [sys.executable, "-m", "tests.http_fuzz_cases", f"http://{cluster.http_address}"]
    argv += [str(examples), str(claims)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(FUZZ_PROCESSES)
    ]
    sent: collections.Counter = collections.Counter()
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=1800)
            assert proc.returncode == 0, err.decode()[-6000:]
            for *key, n in json.loads(out.decode().strip().splitlines()[-1]):
                sent[tuple(key)] += n
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return sent


def _assert_fuzzed_and_still_serving(cluster, sent: collections.Counter, examples: int) -> None:
    assert sent["POST /ping", "positive"] >= 1, sent  # no body to generate: one request
    bodies = {k: n for k, n in sent.items() if k[0].startswith("POST") and k[0] != "POST /ping"}
    assert len(bodies) == 8, sent  # 4 POST operations with a body, valid and invalid each
    assert all(n >= examples // 2 for n in bodies.values()), sent
    base = f"http://{cluster.http_address}"
    assert httpx.get(f"{base}/health").status_code == 200
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}
    resp = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
    assert_all_blocks_free(cluster)


def test_generated_requests_never_get_a_5xx(fuzzed_cluster, tmp_path):
    sent = _fuzz(fuzzed_cluster, examples=40, claims=tmp_path)
    _assert_fuzzed_and_still_serving(fuzzed_cluster, sent, examples=40)


# Valid streamed bodies of each kind the generator rarely reaches: most schema-valid generated
# bodies are still refused (400: an empty prompt, a float where the server wants an integer).
KNOWN_STREAMED = {
    "/v1/completions": [
        {"prompt": "w5 w6 w7", "max_tokens": 5},
        {"prompt": [5, 6, 7], "max_tokens": 4, "n": 2, "seed": 2**63 - 1, "temperature": 1.0},
        {"prompt": ["w5 w6", "w7"], "max_tokens": 3, "logprobs": 2, "echo": True},
        {"prompt": "w5", "max_tokens": 6, "stop": ["w9"], "stream_options": {"include_usage": True}},
    ],
    "/v1/chat/completions": [
        {"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 5},
        {"messages": [{"role": "user", "content": "w5"}], "max_tokens": 4, "n": 2, "logprobs": True,
         "top_logprobs": 2, "stream_options": {"include_usage": True}},
    ],
}  # fmt: skip


def test_generated_streamed_requests_end_with_done_and_no_error_event(fuzzed_cluster):
    """Valid generated bodies of the streaming operations, each with ``stream: true``, and the
    known ones above: every 200 is an event stream that ends with ``data: [DONE]`` and carries
    no error event."""
    schema = schemathesis.openapi.from_url(f"http://{fuzzed_cluster.http_address}/openapi.json")
    sent: collections.Counter = collections.Counter()
    for result in schema.get_all_operations():
        op = result.ok()
        if op.method.upper() == "POST" and op.path.endswith("completions"):
            fuzz_operation(op, GenerationMode.POSITIVE, 20, sent, stream=True)
    posts = {k: n for k, n in sent.items() if k[0].startswith("POST")}
    assert len(posts) == 2 and all(n >= 10 for n in posts.values()), sent
    base = f"http://{fuzzed_cluster.http_address}"
    for path, bodies in KNOWN_STREAMED.items():
        for body in bodies:
            response = httpx.post(base + path, json={**body, "stream": True}, timeout=60)
            assert response.status_code == 200, response.text[:300]
            assert check_stream(response, "POST " + path, body)
            sent["streamed 200", "POST " + path] += 1
    streamed = {k: n for k, n in sent.items() if k[0] == "streamed 200"}
    assert len(streamed) == 2 and all(n >= 3 for n in streamed.values()), sent  # both checked
    assert_all_blocks_free(fuzzed_cluster)


@pytest.mark.slow
def test_thousands_of_generated_requests_never_get_a_5xx(fuzzed_cluster, tmp_path):
    sent = _fuzz(fuzzed_cluster, examples=1000, claims=tmp_path)
    assert sum(sent.values()) >= 4000, sent
    _assert_fuzzed_and_still_serving(fuzzed_cluster, sent, examples=1000)
