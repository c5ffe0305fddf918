"""The namespace cluster for the tests: made once per module, skipped with the reason where
namespaces cannot be made, removed by a finalizer whatever the tests did."""

from __future__ import annotations

import json
import time

import pytest

from pdserve.bench.netns.cluster import NetnsCluster
from pdserve.bench.netns.hosts import cleanup_stale, list_namespaces, unavailable_reason
from tests.conftest import tiny_llama_dir
from tests.ray_utils import WAIT_SCALE, engine_reference, make_prompts

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def netns(tmp_path_factory):
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no network namespaces here: {reason}")
    cleanup_stale()  # a run killed before its finalizer (a CI timeout) left these
    root = tmp_path_factory.mktemp("netns")
    cluster = NetnsCluster(root / "run")
    try:
        model, _ = tiny_llama_dir(root, num_kv_heads=2, layers=2, seed=5)
        prompts = make_prompts(6, seed=1)
        cluster.model = str(model)
        cluster.prompts, cluster.reference = prompts, engine_reference(model, prompts)
        yield cluster
    finally:
        cluster.close()
        # Nothing of the run is left: no namespace (so no veth, bridge or process in one).
        assert list_namespaces(f"{cluster.hosts.prefix}-") == []


def serve(cluster: NetnsCluster, transport: str, **over) -> None:
    """``pdserve serve`` with ``transport`` unless the running one already matches."""
    key = (transport, json.dumps(over, sort_keys=True))
    if getattr(cluster, "serving", None) != key or cluster.serve is None:
        cluster.start_pdserve(cluster.model, transport, **over)
        cluster.serving = key


def wait_all_blocks_free(cluster: NetnsCluster, timeout_s: float = 30) -> dict:
    """Until every worker of both pools reports no block in use (leases released), within
    ``timeout_s`` (scaled for a loaded machine); returns that status."""
    deadline = time.monotonic() + timeout_s * WAIT_SCALE
    while True:
        st = cluster.status()
        used = {
            w["id"]: w["kv_usage"]
            for p in st["pools"].values()
            for w in p["workers"]
            if w["kv_usage"] > 0
        }
        if not used:
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still in use after {timeout_s}s: {used}")
        time.sleep(0.5)
