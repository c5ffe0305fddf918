"""/metrics: Prometheus text with the field's names under ``pdserve:``; the request histograms
move after requests (HTTP and gRPC alike), pool and worker gauges follow the status polls."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kernels import cpu_extension
from pdserve.client import Client
from pdserve.cluster.local import ClusterSpec, LocalCluster
from tests.cluster_utils import assert_all_blocks_free
from tests.conftest import tiny_llama_dir
from tests.http_utils import get, post

HISTOGRAMS = [
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "kv_transfer_seconds",
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path, _ = tiny_llama_dir(
        tmp_path_factory.mktemp("metrics"), num_heads=4, num_kv_heads=2, seed=5
    )
    spec = ClusterSpec(model=str(path), num_blocks=256, max_model_len=128, http_port=0)
    with LocalCluster(spec) as c:
        yield c
        assert_all_blocks_free(c)


def scrape(cluster) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from /metrics."""
    status, text = get(cluster.http_address, "/metrics")
    assert status == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples, name: str, **labels) -> float:
    return samples.get(("pdserve:" + name, tuple(sorted(labels.items()))), 0.0)


def generate_http(cluster, **kw):
    body = {"prompt": "w5 w6 w7 w8", "max_tokens": 6, "temperature": 0, "ignore_eos": True, **kw}
    status, out = post(cluster.http_address, "/v1/completions", body)
    assert status == 200, out
    return out


def test_histograms_move_after_requests(cluster):
    model = cluster.router.cfg.model_name
    before = scrape(cluster)
    generate_http(cluster)
    with Client(cluster.address) as client:  # the gRPC front door feeds the same metrics
        client.generate(token_ids=[5, 6, 7], max_tokens=6, ignore_eos=True)
    after = scrape(cluster)
    for name in HISTOGRAMS:
        n = value(after, name + "_count", model_name=model) - value(
            before, name + "_count", model_name=model
        )
        assert n >= 2, f"{name} observed {n} times for 2 requests"
        assert value(after, name + "_sum", model_name=model) >= 0
    assert value(after, "time_to_first_token_seconds_sum", model_name=model) > value(
        before, "time_to_first_token_seconds_sum", model_name=model
    )
    gained = value(after, "kv_transfer_bytes_total", model_name=model) - value(
        before, "kv_transfer_bytes_total", model_name=model
    )
    assert gained > 0
    assert (
        value(after, "generation_tokens_total", model_name=model)
        - value(before, "generation_tokens_total", model_name=model)
        == 12
    )


def test_success_counted_by_finish_reason(cluster):
    model = cluster.router.cfg.model_name
    before = scrape(cluster)
    text = generate_http(cluster)["choices"][0]["text"]
    generate_http(cluster, stop=[text.split()[2]])
    after = scrape(cluster)
    for reason in ("length", "stop"):
        labels = {"model_name": model, "finished_reason": reason}
        assert (
            value(after, "request_success_total", **labels)
            == value(before, "request_success_total", **labels) + 1
        )


def test_pool_and_worker_gauges(cluster):
    samples = scrape(cluster)
    for pool in ("prefill", "decode"):
        assert ("pdserve:num_requests_running", (("pool", pool),)) in samples
        assert ("pdserve:num_requests_waiting", (("pool", pool),)) in samples
        assert value(samples, "num_workers_ready", pool=pool) == 1
    for pool, addresses in (
        ("prefill", cluster.prefill_addresses),
        ("decode", cluster.decode_addresses),
    ):
        for address in addresses:
            usage = value(samples, "kv_cache_usage_perc", pool=pool, worker=address)
            assert 0.0 <= usage <= 1.0
            variant = cpu_extension.selected_variant()  # in-process workers share it
            labels = {"pool": pool, "worker": address, "variant": variant}
            assert value(samples, "cpu_kernel_info", **labels) == 1
    assert ("pdserve:num_preemptions_total", (("worker", cluster.decode_addresses[0]),)) in samples


def test_prefix_cache_counters_follow_the_workers(cluster):
    worker = cluster.prefill_addresses[0]
    before = scrape(cluster)
    prompt = " ".join(f"w{i}" for i in range(10, 50))  # over two full blocks: a cache lookup
    generate_http(cluster, prompt=prompt, max_tokens=2)
    generate_http(cluster, prompt=prompt, max_tokens=2)  # hits the first one's blocks
    deadline = time.monotonic() + 5
    while True:  # the router sees worker counters at its next status poll
        samples = scrape(cluster)
        hits = [
            value(s, "prefix_cache_hits_total", pool="prefill", worker=worker)
            for s in (before, samples)
        ]
        if hits[1] > hits[0]:
            break
        assert time.monotonic() < deadline, "prefix cache hits never moved"
        time.sleep(0.05)
    queries = [
        value(s, "prefix_cache_queries_total", pool="prefill", worker=worker)
        for s in (before, samples)
    ]
    assert queries[1] - queries[0] >= hits[1] - hits[0]


def test_overload_is_counted(cluster):
    router = cluster.router
    before = value(scrape(cluster), "request_rejected_total", model_name=router.cfg.model_name)
    router.inflight += 10**6  # as if saturated; restored below
    try:
        assert post(cluster.http_address, "/v1/completions", {"prompt": "w5"})[0] == 429
    finally:
        router.inflight -= 10**6
    after = value(scrape(cluster), "request_rejected_total", model_name=router.cfg.model_name)
    assert after == before + 1
