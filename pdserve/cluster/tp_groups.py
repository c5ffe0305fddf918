"""Placement of tensor-parallel workers under Ray: a worker of ``tensor_parallel_size`` k is one
actor (rank 0: the engine's process) whose k - 1 followers are its own child processes
(engine/tp_ranks.py spawns them), not Ray actors. Ray still has to keep the node's room for
them, and keep them on the actor's node: each TP worker gets a placement group of k bundles,
STRICT_PACK (one node), one bundle per rank, and its actor is scheduled into bundle 0.

Each bundle holds one rank's ``num_cpus`` and custom ``resources``. GPUs: rank r runs on
``cuda:r`` of the devices its process sees, and the followers inherit the actor's
CUDA_VISIBLE_DEVICES, which Ray sets to the GPUs the actor itself asked for. So the actor asks
for every rank's GPU (k x ``num_gpus``, ``num_gpus`` being 0 or 1 at k > 1: the config refuses
fractions), and bundle 0 holds them all; bundles 1..k-1 hold the other ranks' CPUs and
resources only. Every bundle is on the one node either way. (Not run on GPUs here.)

A worker of TP=1 gets no group: its actor is placed exactly as before. The group goes with its
worker (replaced, drained, failed to start, or the cluster shut down).
"""

from __future__ import annotations

from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.cluster.core_pairs import MIN_BUNDLE_CPU

STRATEGY = "STRICT_PACK"  # every rank on one node: the all-reduces stay on the host


def rank_bundles(pool) -> list[dict[str, float]]:
    """The bundles of one worker of ``pool`` (a PoolConfig): one per rank, bundle 0 the
    actor's, with every rank's GPUs."""
    k = pool.tensor_parallel_size
    rank = {"CPU": pool.num_cpus or MIN_BUNDLE_CPU, **pool.resources}
    first = {**rank, "GPU": k * pool.num_gpus} if pool.num_gpus else rank
    return [first] + [dict(rank) for _ in range(k - 1)]


def actor_gpus(pool) -> float:
    """The GPUs the worker's actor asks for: every rank's (its followers see the same)."""
    return pool.tensor_parallel_size * pool.num_gpus


def dead_rank_reason(status: dict) -> str | None:
    """Why a TP worker whose actor answers is dead anyway: one of its ranks has exited (or
    broke its group), so its engine cannot step again; None while every rank lives. The
    controller replaces it at once rather than waiting for a request to fail there."""
    tp = status.get("tensor_parallel") or {}
    dead = [r for r in tp.get("ranks", []) if not r["alive"]]
    if not dead:
        return None
    names = ", ".join(f"{r['rank']} (pid {r['pid']})" for r in dead)
    return f"its tensor-parallel rank {names} is gone"


class RankGroups:
    """The placement groups of a cluster's TP workers, by worker id."""

    def __init__(self, cfg):
        self.cfg = cfg  # a ClusterConfig
        self.groups: dict[str, PlacementGroup] = {}

    def options(self, worker_id: str, role: str) -> dict:
        """Actor options for worker ``worker_id`` of ``role``'s pool: ``{}`` at TP=1, else a
        new placement group's bundle 0 and the GPUs of every rank."""
        pool = self.cfg.pools[role]
        if pool.tensor_parallel_size == 1:
            return {}
        pg = placement_group(rank_bundles(pool), STRATEGY)
        self.groups[worker_id] = pg
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
        return {"scheduling_strategy": strategy, "num_gpus": actor_gpus(pool)}

    def remove(self, worker_id: str) -> None:
        """Give back ``worker_id``'s group (its actor is gone or going); none: nothing."""
        pg = self.groups.pop(worker_id, None)
        if pg is not None:
            remove_placement_group(pg)

    def remove_all(self) -> None:
        for worker_id in list(self.groups):
            self.remove(worker_id)
