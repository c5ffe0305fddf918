"""Node groups under Ray (``share_cores``, pdserve/share_cores.py): prefill worker i and decode
worker i run on one node, where they lend each other its cores.

Each group is a placement group of two bundles, STRICT_PACK (one node): bundle 0 holds the
prefill worker, bundle 1 the decode worker, each with its pool's CPUs and custom resources. A
worker that dies leaves its bundle free, and its replacement takes the group's missing member,
so it lands on its partner's node and finds the same ledger there.
"""

from __future__ import annotations

from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

BUNDLE_INDEX = {"prefill": 0, "decode": 1}
# Ray refuses a bundle of zeros: a pool of ``num_cpus: 0`` (packing actors on a small machine)
# asks this sliver of a CPU for its bundle, which its actor (0 CPUs) fits in.
MIN_BUNDLE_CPU = 0.001


def pair_bundles(cfg) -> list[dict[str, float]]:
    """The two bundles of a node group of ``cfg`` (a ClusterConfig), prefill's first."""
    bundles = []
    for role in BUNDLE_INDEX:
        pool = cfg.pools[role]
        bundles.append({"CPU": pool.num_cpus or MIN_BUNDLE_CPU, **pool.resources})
    return bundles


def free_group(role: str, taken: set[int]) -> int:
    """The lowest node group without a ``role`` member (``taken``: those with one)."""
    group = 0
    while group in taken:
        group += 1
    return group


class NodePairs:
    """The placement groups of a cluster's node groups, made as their first member starts."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.groups: dict[int, PlacementGroup] = {}

    def options(self, group: int, role: str) -> dict:
        """Actor options that put the ``role`` worker of ``group`` on the group's node."""
        pg = self.groups.get(group)
        if pg is None:
            pg = self.groups[group] = placement_group(pair_bundles(self.cfg), "STRICT_PACK")
        strategy = PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=BUNDLE_INDEX[role]
        )
        return {"scheduling_strategy": strategy}

    def remove(self) -> None:
        for pg in self.groups.values():
            remove_placement_group(pg)
        self.groups.clear()
