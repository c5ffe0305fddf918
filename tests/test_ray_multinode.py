"""Several Ray nodes on one machine (``ray.cluster_utils.Cluster``), each with its own custom
resource: the prefill pool lands on one node, the decode pool on another, and the KV cache
crosses between them over gRPC, and over nixl (one-sided WRITEs into the decode workers'
blocks) where NIXL is installed, with outputs equal to the single-process engine's and every
block free after."""

from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster

from pdserve.cluster.ray_controller import NAMESPACE
from pdserve.cluster.ray_launcher import launch
from tests.conftest import tiny_llama_dir
from tests.ray_utils import engine_reference, generate, make_prompts, tiny_config, wait_for
from tests.transport_params import transport_params


@pytest.fixture(scope="module")
def nodes():
    args = {"include_dashboard": False, "object_store_memory": 80 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, **args})
    prefill_node = cluster.add_node(num_cpus=1, resources={"prefill_node": 2}, **args)
    decode_node = cluster.add_node(num_cpus=1, resources={"decode_node": 2}, **args)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    yield {"prefill": prefill_node.node_id, "decode": decode_node.node_id}
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.parametrize("transport", transport_params(["grpc", "nixl"]))
def test_pools_on_their_own_nodes_with_kv_over_the_transport(nodes, tmp_path, transport):
    model, _ = tiny_llama_dir(tmp_path, num_kv_heads=2, layers=2, seed=5)
    prompts = make_prompts(6, seed=1)
    reference = engine_reference(model, prompts)
    pools = {
        role: {
            "num_cpus": 0,
            "threads": 1,
            "replicas": n,
            "max": 2,
            "resources": {f"{role}_node": 1},
        }
        for role, n in (("prefill", 1), ("decode", 2))
    }
    config = tiny_config(model, pools=pools, kv_transport=transport)
    with launch(config, progress=False) as cluster:
        st = cluster.status()
        for role, node_id in nodes.items():
            workers = st["pools"][role]["workers"]
            assert len(workers) == (1 if role == "prefill" else 2)
            assert {w["node_id"] for w in workers} == {node_id}, role
        outs = generate(cluster.grpc_address, prompts)
        assert [o.token_ids for o in outs] == reference
        assert all(o.timings.kv_bytes > 0 for o in outs)
        for pool in cluster.status()["pools"].values():
            assert sum(w["served_requests"] for w in pool["workers"]) >= len(prompts)

        def every_block_free() -> bool:  # as the workers' last status reports say
            rows = [w for p in cluster.status()["pools"].values() for w in p["workers"]]
            return all(w["kv_usage"] == 0 and not w["running"] for w in rows)

        wait_for(every_block_free, 10, "every block free")
