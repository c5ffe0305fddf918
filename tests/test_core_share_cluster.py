"""Core sharing in a cluster: the config's ``share_cores`` section (pdserve/share_cores.py) and
a local cluster whose prefill and decode worker lend each other cores, token-exact."""

from __future__ import annotations

import os
import time

import pytest

from engine.core_share import ledger_path
from pdserve.cluster.local import ClusterSpec, LocalCluster
from pdserve.config import ConfigError, load_config, validate_config
from pdserve.settings import settings_from_config
from pdserve.share_cores import core_share_settings, with_core_share, with_share_name
from tests.cluster_utils import assert_all_blocks_free, generate_concurrently, worker_statuses
from tests.conftest import tiny_llama_dir
from tests.test_disagg import NEW_TOKENS, engine_reference, mixed_prompts

SHARED = {"enabled": True, "node_cores": 2}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("share"), num_kv_heads=2, seed=6)
    return path


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"pools": {"prefill": {"replicas": 2, "max": 2}}},
            r"pools.prefill.replicas \(2\) must equal pools.decode.replicas \(1\)",
        ),
        ({"autoscaler": {"enabled": True}}, "share_cores needs autoscaler.enabled: false"),
        ({"pools": {"decode": {"num_gpus": 1}}}, "GPU SM shares .* are not built"),
        ({"device": "cuda"}, "GPU SM shares .* are not built"),
        ({"share_cores": {"node_cores": 1}}, "1 core cannot be shared"),
        ({"share_cores": {"decode_threads": 3}}, r"decode_threads \(3\) must be <= .*\(2\)"),
        ({"share_cores": {"name": "../x"}}, "share_cores.name: '../x': up to 64 letters"),
        ({"share_cores": {"headroom": 0}}, "share_cores.headroom: must be > 0"),
    ],
)
def test_a_config_that_cannot_share_cores_is_refused_naming_why(data, message):
    merged = {**data, "share_cores": {**SHARED, **data.get("share_cores", {})}}
    with pytest.raises(ConfigError, match=message):
        validate_config(merged)


def test_sharing_is_off_by_default_and_its_settings_follow_the_config():
    assert not load_config(None).share_cores.enabled
    cfg = validate_config({"share_cores": SHARED, "autoscaler": {"tpot_target_s": 0.05}})
    with pytest.raises(ValueError, match="the launcher names the ledgers first"):
        core_share_settings(cfg, 0)
    named = with_share_name(cfg)
    assert named.share_cores.name and with_share_name(named) == named  # named once
    s = core_share_settings(named, 3)
    assert s.ledger == ledger_path(named.share_cores.name, 3)
    assert (s.node_cores, s.tpot_target_s, s.headroom) == (2, 0.05, 0.8)  # the autoscaler's
    decode = settings_from_config(named, "127.0.0.1").decode
    assert decode.core_share is None  # a worker in no group shares nothing
    assert with_core_share(decode, named, 3).core_share == s
    assert with_core_share(decode, validate_config({}), 3).core_share is None


def test_a_local_cluster_pairs_as_many_prefill_as_decode_workers(tiny_model):
    spec = ClusterSpec(model=str(tiny_model), num_prefill=2, share_cores=SHARED)
    with pytest.raises(ConfigError, match=r"num_prefill \(2\) must equal num_decode \(1\)"):
        LocalCluster(spec)


def _wait_for_prefill_threads(cluster, threads: int) -> list:
    deadline = time.monotonic() + 10
    while True:
        statuses = worker_statuses(cluster)
        prefill = [s for s in statuses if s.role == "prefill"]
        if all(s.threads == threads for s in prefill) or time.monotonic() > deadline:
            return statuses
        time.sleep(0.05)


@pytest.mark.parametrize("separate_processes", [False, True])
def test_greedy_outputs_are_token_exact_with_cores_shared(tiny_model, separate_processes):
    prompts = mixed_prompts(12, seed=4)
    reference = engine_reference(tiny_model, prompts)
    spec = ClusterSpec(
        model=str(tiny_model),
        num_blocks=512,
        max_model_len=256,
        separate_processes=separate_processes,
        share_cores=SHARED,
    )
    with LocalCluster(spec) as cluster:
        name = cluster.spec.config.share_cores.name
        requests = [{"token_ids": p, "max_tokens": NEW_TOKENS, "ignore_eos": True} for p in prompts]
        outs = generate_concurrently(cluster, requests)
        assert_all_blocks_free(cluster)
        # Decode idle again: prefill runs with both cores; decode kept its last share.
        statuses = _wait_for_prefill_threads(cluster, 2)
        assert os.path.exists(ledger_path(name, 0))
    assert [o.token_ids for o in outs] == reference
    assert {s.role: s.node_cores for s in statuses} == {"prefill": 2, "decode": 2}
    assert {s.role: s.threads for s in statuses}["prefill"] == 2
    assert 1 <= {s.role: s.threads for s in statuses}["decode"] <= 2
    assert not os.path.exists(ledger_path(name, 0))  # removed at the end
