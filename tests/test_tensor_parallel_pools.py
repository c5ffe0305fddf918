"""Tensor-parallel pools around the workers (issue 49): ``tensor_parallel_size`` per pool in the
cluster YAML, checked against the model's heads and refused by name; ``pdserve serve
--tensor-parallel-size K|P:D`` setting the pools; each worker's settings and command line
carrying its pool's degree, ``threads`` per rank; under Ray one STRICT_PACK placement group of
k bundles per TP worker, its actor in bundle 0, the group gone with the worker (unit level with
fake actors, and, slow, on a live Ray); and ``pdserve status`` showing a TP worker's ranks."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.cli import build_parser
from pdserve.cluster import ray_controller, tp_groups
from pdserve.cluster.core_pairs import MIN_BUNDLE_CPU
from pdserve.cluster.ray_controller import Controller, _worker_row
from pdserve.cluster.ray_launcher import format_status
from pdserve.cluster.tp_groups import RankGroups, rank_bundles
from pdserve.cluster.workers import worker_args
from pdserve.config import ConfigError, load_config
from pdserve.serve_args import FlagError, apply_serve_args
from pdserve.settings import settings_from_config
from protos import pdserve_pb2 as pb
from tests.conftest import needs_embedded, tiny_llama_dir
from tests.ray_utils import FakeActorClass, FakeRemote, tiny_config


@pytest.fixture(scope="module")
def model_4q_2kv(tmp_path_factory):
    """A tiny Llama of 4 query heads and 2 KV heads (MLP 128 columns): TP 1, 2 and 4 fit."""
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("tp_pools"), num_heads=4, num_kv_heads=2)
    return path


def tp_config(model, prefill: int = 1, decode: int = 1, **pool_fields):
    """tiny_config's cluster (pools of num_cpus 0, 1 thread) with these degrees."""
    pool = {"num_cpus": 0, "threads": 1, "min": 1, "max": 3, **pool_fields}
    pools = {
        "prefill": {**pool, "tensor_parallel_size": prefill},
        "decode": {**pool, "tensor_parallel_size": decode},
    }
    return tiny_config(model, pools=pools)


# ---- the config --------------------------------------------------------------------------


def test_each_pool_takes_its_own_degree_and_each_worker_gets_it(model_4q_2kv):
    cfg = tp_config(model_4q_2kv, prefill=2, decode=4, threads=3)
    s = settings_from_config(cfg, "127.0.0.1")
    assert (s.prefill.engine.tensor_parallel_size, s.decode.engine.tensor_parallel_size) == (2, 4)
    # threads is per rank: the engine's ranks each run this many (engine/tp_ranks.py).
    assert s.prefill.engine.threads == s.decode.engine.threads == 3
    for role, size in (("prefill", "2"), ("decode", "4")):
        argv = worker_args(role, s.worker(role))
        assert argv[argv.index("--tensor-parallel-size") + 1] == size


@pytest.mark.parametrize(
    ("role", "size", "says"),
    [
        ("decode", 3, "pools.decode.tensor_parallel_size 3: must divide the model's 4 attention"),
        ("prefill", 8, "pools.prefill.tensor_parallel_size 8: must divide the model's 4 attention"),
    ],
)
def test_a_degree_that_does_not_divide_the_heads_is_refused_by_name(model_4q_2kv, role, size, says):
    with pytest.raises(ConfigError, match=says):
        tp_config(model_4q_2kv, **{role: size})


@needs_embedded
def test_the_embedded_model_splits_three_ways_not_two():
    cfg = load_config()  # the embedded default: 9 query heads, 3 KV heads
    pools = cfg.model_dump()["pools"]
    pools["prefill"]["tensor_parallel_size"] = 3
    assert cfg.with_overrides(pools=pools).pools.prefill.tensor_parallel_size == 3
    pools["decode"]["tensor_parallel_size"] = 2
    with pytest.raises(ConfigError, match="pools.decode.tensor_parallel_size 2: must divide the"):
        cfg.with_overrides(pools=pools)


def test_a_rank_takes_a_whole_gpu_and_share_cores_pairs_single_ranks(model_4q_2kv):
    with pytest.raises(ConfigError, match="pools.decode: num_gpus 0.5 with tensor_parallel_size 2"):
        tp_config(model_4q_2kv, decode=2, num_gpus=0.5)
    assert tp_config(model_4q_2kv, decode=2, num_gpus=1).pools.decode.num_gpus == 1
    with pytest.raises(ConfigError, match="share_cores pairs single-rank workers"):
        tiny_config(
            model_4q_2kv,
            share_cores={"enabled": True, "node_cores": 2},
            pools={"decode": {"tensor_parallel_size": 2}},
        )


# ---- pdserve serve --tensor-parallel-size --------------------------------------------------


def _serve(*argv: str):
    return apply_serve_args(load_config(), build_parser().parse_args(["serve", *argv]), {})


@pytest.mark.parametrize(("flag", "sizes"), [("2", (2, 2)), ("1:4", (1, 4)), ("4:2", (4, 2))])
def test_the_serve_flag_sets_each_pools_degree(model_4q_2kv, flag, sizes):
    cfg = _serve(str(model_4q_2kv), "--tensor-parallel-size", flag)
    assert (cfg.pools.prefill.tensor_parallel_size, cfg.pools.decode.tensor_parallel_size) == sizes


def test_the_serve_flag_is_blamed_for_a_degree_the_model_refuses(model_4q_2kv):
    with pytest.raises(FlagError) as e:
        _serve(str(model_4q_2kv), "--decode", "2", "-tp", "2:3")
    assert e.value.flag == "--tensor-parallel-size"
    assert e.value.message.startswith("pools.decode.tensor_parallel_size 3: must divide")


# ---- Ray: a placement group per TP worker --------------------------------------------------


def test_a_tp_workers_bundles_are_one_per_rank_with_its_gpus_in_the_actors(model_4q_2kv):
    cpu = tp_config(model_4q_2kv, decode=4, num_cpus=0, resources={"big": 1}).pools.decode
    assert rank_bundles(cpu) == [{"CPU": MIN_BUNDLE_CPU, "big": 1}] * 4
    gpu = tp_config(model_4q_2kv, decode=2, num_cpus=2, num_gpus=1).pools.decode
    assert rank_bundles(gpu) == [{"CPU": 2, "GPU": 2}, {"CPU": 2}]
    assert tp_groups.actor_gpus(gpu) == 2  # CUDA_VISIBLE_DEVICES: both ranks' devices


@pytest.fixture
def tp_controller(model_4q_2kv, monkeypatch):
    """A controller of prefill TP=1 and decode TP=2 whose actors and groups are recorded."""
    made, groups, removed, killed = [], [], [], []
    monkeypatch.setattr(ray_controller.ray, "remote", lambda cls: FakeActorClass(made))
    monkeypatch.setattr(ray_controller.ray, "kill", killed.append)

    def placement_group(bundles, strategy):
        groups.append((bundles, strategy))
        return f"pg{len(groups) - 1}"

    monkeypatch.setattr(tp_groups, "placement_group", placement_group)
    monkeypatch.setattr(tp_groups, "remove_placement_group", removed.append)
    monkeypatch.setattr(
        tp_groups,
        "PlacementGroupSchedulingStrategy",
        lambda pg, placement_group_bundle_index: (pg, placement_group_bundle_index),
    )
    cfg = tp_config(model_4q_2kv, prefill=1, decode=2)
    ctl = Controller(cfg.model_dump(), str(model_4q_2kv))
    ctl.router = type("Router", (), {"add_worker": FakeRemote(lambda role, address: None)})()
    ctl.made, ctl.groups, ctl.removed, ctl.killed = made, groups, removed, killed
    return ctl


def test_a_tp_worker_is_placed_in_its_own_group_and_the_group_goes_with_it(tp_controller):
    ctl = tp_controller
    prefill = asyncio.run(ctl._add_worker("prefill"))
    options, _ = ctl.made[-1]
    assert "scheduling_strategy" not in options and options["num_gpus"] == 0  # TP=1 as before
    decode = asyncio.run(ctl._add_worker("decode"))
    options, _ = ctl.made[-1]
    assert options["scheduling_strategy"] == ("pg0", 0)  # the actor is rank 0, in bundle 0
    assert ctl.groups == [([{"CPU": MIN_BUNDLE_CPU}] * 2, "STRICT_PACK")]
    asyncio.run(ctl._add_worker("decode"))
    assert ctl.made[-1][0]["scheduling_strategy"] == ("pg1", 0)  # each worker its own group
    ctl._kill(decode)  # replaced, drained or shut down: every path kills through _kill
    assert ctl.removed == ["pg0"] and decode.actor in ctl.killed
    ctl._kill(prefill)
    assert ctl.removed == ["pg0"]  # a TP=1 worker had none
    ctl.router = None  # shutdown: the workers left (decode-1) stop, and their groups go
    asyncio.run(ctl.shutdown())
    assert ctl.removed == ["pg0", "pg1"]


@pytest.mark.slow
def test_a_live_ray_places_a_tp2_workers_ranks_in_one_strict_pack_group(model_4q_2kv):
    import ray
    from ray.util import placement_group_table

    from tests.ray_utils import init_local_ray

    init_local_ray()
    try:
        groups = RankGroups(tp_config(model_4q_2kv, decode=2, num_cpus=1))
        options = groups.options("decode-0", "decode")
        pg = groups.groups["decode-0"]
        assert ray.get(pg.ready(), timeout=60) is not None

        @ray.remote
        class Rank0:
            def group(self) -> str:
                return ray.get_runtime_context().get_placement_group_id()

        actor = Rank0.options(num_cpus=1, **options).remote()
        assert ray.get(actor.group.remote(), timeout=60) == pg.id.hex()
        table = placement_group_table(pg)
        assert table["strategy"] == "STRICT_PACK" and len(table["bundles"]) == 2
        assert all(b == {"CPU": 1.0} for b in table["bundles"].values())
        ray.kill(actor)
        groups.remove("decode-0")
        assert placement_group_table(pg)["state"] == "REMOVED"
    finally:
        ray.shutdown()


# ---- pdserve status ------------------------------------------------------------------------

TP2 = {
    "size": 2,
    "ranks": [{"rank": 0, "pid": 4100, "alive": True}, {"rank": 1, "pid": 4107, "alive": False}],
}


def _status(*rows: dict) -> dict:
    workers = [_worker_row(type("Rec", (), row)(), {"healthy": True}) for row in rows]
    return {"pools": {"decode": {"workers": workers, "target": 2, "min": 1, "max": 2}}}


def _record(worker_id: str, status: dict) -> dict:
    return {
        "worker_id": worker_id,
        "address": "127.0.0.1:1",
        "node_id": "n",
        "state": "ready",
        "group": None,
        "status": {"threads": 1, **status},
    }


def test_status_shows_a_tp_worker_as_its_ranks():
    st = _status(_record("decode-0", {"tensor_parallel": TP2}), _record("decode-1", {}))
    lines = format_status(st).splitlines()
    at = next(i for i, line in enumerate(lines) if "decode-0" in line)
    assert lines[at + 1].split() == ["rank", "0/2", "pid", "4100", "alive"]
    assert lines[at + 2].split() == ["rank", "1/2", "pid", "4107", "dead"]
    assert "decode-1" in lines[at + 3]  # a TP=1 worker: one line, as before
    assert st["pools"]["decode"]["workers"][1]["tensor_parallel"] is None


def test_the_worker_status_message_carries_the_ranks():
    msg = pb.WorkerStatus(role="decode", num_running=1, tensor_parallel=TP2)
    back = pb.WorkerStatus.FromString(msg.SerializeToString())
    assert back.tensor_parallel.size == 2
    assert [(r.rank, r.pid, r.alive) for r in back.tensor_parallel.ranks] == [
        (0, 4100, True),
        (1, 4107, False),
    ]
    assert not pb.WorkerStatus(role="decode").HasField("tensor_parallel")


def test_a_worker_with_a_dead_rank_is_dead_though_its_actor_answers():
    assert tp_groups.dead_rank_reason({"tensor_parallel": TP2}) == (
        "its tensor-parallel rank 1 (pid 4107) is gone"
    )
    alive = {"size": 2, "ranks": [{**r, "alive": True} for r in TP2["ranks"]]}
    assert tp_groups.dead_rank_reason({"tensor_parallel": alive}) is None
    assert tp_groups.dead_rank_reason({"num_running": 0}) is None  # TP=1
