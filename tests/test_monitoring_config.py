"""cluster_configs/monitoring: the Grafana dashboard loads as a dashboard, every metric it
queries exists on a live router's /metrics, and the Prometheus scrape config targets it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster.local import ClusterSpec, LocalCluster
from tests.cluster_utils import assert_all_blocks_free
from tests.conftest import tiny_llama_dir
from tests.http_utils import get, post

MONITORING = Path(__file__).resolve().parent.parent / "cluster_configs" / "monitoring"
METRIC = re.compile(r"pdserve:[a-z0-9_]+")


def dashboard() -> dict:
    return json.loads((MONITORING / "grafana-dashboard.json").read_text())


def queried_metrics(dash: dict) -> set[str]:
    return {m for p in dash["panels"] for t in p["targets"] for m in METRIC.findall(t["expr"])}


def test_the_dashboard_has_the_shape_grafana_imports():
    dash = dashboard()
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    [var] = dash["templating"]["list"]
    assert (var["name"], var["type"], var["query"]) == ("datasource", "datasource", "prometheus")
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) >= 10
    for panel in dash["panels"]:
        assert panel["type"] == "timeseries" and panel["title"]
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        assert panel["datasource"]["uid"] == "${datasource}"
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs))
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")") and METRIC.search(expr), expr


def test_the_dashboard_covers_latency_goodput_queues_kv_transfers_migrations_and_breakers():
    names = queried_metrics(dashboard())
    for needed in (
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "request_decode_time_seconds_sum",  # TPOT
        "request_success_total",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "kv_transfer_bytes_total",
        "request_migrations_total",
        "num_workers_circuit_open",
    ):
        assert "pdserve:" + needed in names


def test_the_scrape_config_targets_the_routers_metrics_path():
    config = yaml.safe_load((MONITORING / "prometheus.yaml").read_text())
    [job] = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("dash"), num_heads=4, num_kv_heads=2, seed=7)
    spec = ClusterSpec(model=str(path), num_blocks=128, max_model_len=128, http_port=0)
    with LocalCluster(spec) as c:
        yield c
        assert_all_blocks_free(c)


def test_every_metric_the_dashboard_queries_is_on_a_live_routers_metrics(cluster):
    body = {"prompt": "w5 w6 w7", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    status, out = post(cluster.http_address, "/v1/completions", body)
    assert status == 200, out
    status, text = get(cluster.http_address, "/metrics")
    assert status == 200
    exposed = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    missing = queried_metrics(dashboard()) - exposed
    assert not missing, sorted(missing)
