"""Fuzz the public HTTP API from its own OpenAPI schema (issue 19): schemathesis generates
requests for every operation, bodies that fit the schema and bodies that break it, and sends
them to a live tiny cluster. None may get a 5xx, the server stays up, and every KV block is
free at the end.

About 350 requests run in the normal suite (seconds); the slow marker runs thousands (at
least 4,000 asserted; 4 minutes here).
"""

from __future__ import annotations

import collections

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.cluster_utils import assert_all_blocks_free, http_cluster
from tests.conftest import tiny_llama_dir


@pytest.fixture(scope="module")
def fuzzed_cluster(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("fuzz"), seed=9)
    with http_cluster(path) as cluster:  # asserts every block free at the end
        yield cluster


def _fuzz(cluster, examples: int) -> collections.Counter:
    """Every operation of the served schema, ``examples`` generated requests per operation
    and mode (valid bodies; invalid ones for operations that take a body); returns the
    requests sent per (operation, mode)."""
    schema = schemathesis.openapi.from_url(f"http://{cluster.http_address}/openapi.json")
    sent: collections.Counter = collections.Counter()
    for result in schema.get_all_operations():
        op = result.ok()
        modes = [GenerationMode.POSITIVE]
        if op.method.upper() == "POST":
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:
            _fuzz_operation(op, mode, examples, sent)
    return sent


def _fuzz_operation(op, mode: GenerationMode, examples: int, sent: collections.Counter) -> None:
    @given(case=op.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def send(case):
        response = case.call(timeout=60)
        sent[op.label, mode.value] += 1
        assert response.status_code < 500, (
            f"{op.label} -> {response.status_code}: {response.text[:300]}\n"
            f"body: {str(case.body)[:500]}"
        )

    send()


def _assert_fuzzed_and_still_serving(cluster, sent: collections.Counter, examples: int) -> None:
    bodies = {k: n for k, n in sent.items() if k[0].startswith("POST")}
    assert len(bodies) == 8, sent  # 4 POST operations, valid and invalid bodies each
    assert all(n >= examples // 2 for n in bodies.values()), sent
    base = f"http://{cluster.http_address}"
    assert httpx.get(f"{base}/health").status_code == 200
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}
    resp = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
    assert_all_blocks_free(cluster)


def test_generated_requests_never_get_a_5xx(fuzzed_cluster):
    sent = _fuzz(fuzzed_cluster, examples=40)
    _assert_fuzzed_and_still_serving(fuzzed_cluster, sent, examples=40)


@pytest.mark.slow
def test_thousands_of_generated_requests_never_get_a_5xx(fuzzed_cluster):
    sent = _fuzz(fuzzed_cluster, examples=1000)
    assert sum(sent.values()) >= 4000, sent
    _assert_fuzzed_and_still_serving(fuzzed_cluster, sent, examples=1000)
