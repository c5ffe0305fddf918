"""Node groups under Ray (pdserve/cluster/core_pairs.py): the controller places prefill worker
i and decode worker i in one STRICT_PACK placement group (unit level, without Ray, as
test_controller_health does), and a live Ray cluster serves token-exact with cores shared."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.cluster import core_pairs, ray_controller
from pdserve.cluster.core_pairs import MIN_BUNDLE_CPU, pair_bundles
from pdserve.cluster.ray_controller import Controller
from pdserve.cluster.ray_launcher import format_status
from tests.ray_utils import FakeActorClass, FakeRemote, tiny_config

SHARED = {"enabled": True, "node_cores": 2}


@pytest.fixture
def controller(tmp_path, monkeypatch):
    made, groups = [], []
    monkeypatch.setattr(ray_controller.ray, "remote", lambda cls: FakeActorClass(made))

    def placement_group(bundles, strategy):
        groups.append((bundles, strategy))
        return f"pg{len(groups) - 1}"

    monkeypatch.setattr(core_pairs, "placement_group", placement_group)

    def strategy(pg, placement_group_bundle_index):
        return (pg, placement_group_bundle_index)

    monkeypatch.setattr(core_pairs, "PlacementGroupSchedulingStrategy", strategy)
    pools = {"replicas": 2, "max": 3}
    cfg = tiny_config(tmp_path, share_cores=SHARED, pools={"prefill": pools, "decode": pools})
    ctl = Controller(cfg.model_dump(), str(tmp_path))
    ctl.router = type("Router", (), {"add_worker": FakeRemote(lambda role, address: None)})()
    ctl.made, ctl.groups = made, groups
    return ctl


def _add(ctl: Controller, role: str):
    rec = asyncio.run(ctl._add_worker(role))
    options, args = ctl.made[-1]
    return rec, options["scheduling_strategy"], args


def test_prefill_and_decode_worker_i_share_a_placement_group_on_one_node(controller):
    ctl = controller
    assert ctl.cfg.share_cores.name  # the controller named the cluster's ledgers
    p0, p0_where, p0_args = _add(ctl, "prefill")
    d0, d0_where, d0_args = _add(ctl, "decode")
    p1, p1_where, _ = _add(ctl, "prefill")
    assert (p0.group, d0.group, p1.group) == (0, 0, 1)
    assert (p0_where, d0_where, p1_where) == (("pg0", 0), ("pg0", 1), ("pg1", 0))
    assert p0_args[-1] == d0_args[-1] == 0  # the actors build their group's core share
    assert [strategy for _, strategy in ctl.groups] == ["STRICT_PACK", "STRICT_PACK"]
    # decode-0 dies: its replacement is group 0's missing member, in group 0's bundle.
    del ctl.workers[d0.worker_id]
    d2, d2_where, _ = _add(ctl, "decode")
    assert (d2.group, d2_where) == (0, ("pg0", 1))
    assert len(ctl.groups) == 2


def test_a_bundle_asks_for_the_pools_cpus_and_resources_never_zero(tmp_path):
    pools = {
        "prefill": {"num_cpus": 0},
        "decode": {"num_cpus": 2, "resources": {"fast_node": 1}},
    }
    cfg = tiny_config(tmp_path, share_cores=SHARED, pools=pools)
    assert pair_bundles(cfg) == [{"CPU": MIN_BUNDLE_CPU}, {"CPU": 2, "fast_node": 1}]


def test_scaling_keeps_the_pools_paired(controller):
    with pytest.raises(ValueError, match=r"prefill \(3\) and decode \(2\) must stay equal"):
        asyncio.run(controller.scale(prefill=3))


def test_status_shows_each_workers_thread_share():
    row = {
        "id": "prefill-0",
        "state": "ready",
        "healthy": True,
        "draining": False,
        "address": "127.0.0.1:1",
        "kv_usage": 0.0,
        "running": 0,
        "waiting": 0,
        "served_requests": 3,
    }
    pools = {"prefill": [{**row, "threads": 3, "node_cores": 4}], "decode": [row]}
    st = {"pools": {r: {"workers": w, "target": 1, "min": 1, "max": 1} for r, w in pools.items()}}
    lines = format_status(st).splitlines()
    assert "threads" in lines[2]
    assert next(line for line in lines if "prefill-0" in line).endswith(" 3/4")


@pytest.mark.slow
def test_a_ray_cluster_with_cores_shared_serves_token_exact(tmp_path):
    import ray

    from pdserve.cluster.ray_launcher import launch
    from tests.conftest import tiny_llama_dir
    from tests.ray_utils import engine_reference, generate, init_local_ray, make_prompts, wait_for

    model, _ = tiny_llama_dir(tmp_path, num_kv_heads=2, seed=7)
    prompts = make_prompts(6, seed=2)
    reference = engine_reference(model, prompts)
    init_local_ray()
    try:
        config = tiny_config(model, share_cores=SHARED)
        with launch(config, progress=False) as cluster:
            assert [o.token_ids for o in generate(cluster.grpc_address, prompts)] == reference

            def prefill_has_both_cores() -> bool:  # decode idle again
                rows = [w for p in cluster.status()["pools"].values() for w in p["workers"]]
                by_role = {w["id"].split("-")[0]: w for w in rows}
                return by_role["prefill"]["threads"] == 2 and not any(w["running"] for w in rows)

            wait_for(prefill_has_both_cores, 10, "prefill back at both cores")
            rows = [w for p in cluster.status()["pools"].values() for w in p["workers"]]
            assert len({w["node_id"] for w in rows}) == 1
            assert [(w["group"], w["node_cores"]) for w in rows] == [(0, 2), (0, 2)]
            assert all(w["kv_usage"] == 0 for w in rows)
    finally:
        ray.shutdown()
