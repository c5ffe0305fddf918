"""Routing policies: pure functions over worker handles."""

from __future__ import annotations

import pytest

from router.policies import get_policy, least_queued_tokens, most_free_blocks, prefix_affinity
from router.pool import WorkerHandle


def handle(address, **kw) -> WorkerHandle:
    return WorkerHandle(
        address=address, role="prefill", channel=None, stub=None, healthy=True, **kw
    )


def test_least_queued_prefers_fewest_inflight_tokens():
    a, b = handle("a", inflight_tokens=500), handle("b", inflight_tokens=20)
    assert least_queued_tokens([a, b], [1, 2])[0] is b


def test_prefix_affinity_is_sticky_per_prefix_and_spreads_prefixes():
    workers = [handle(f"w{i}") for i in range(4)]
    system = list(range(100, 164))
    picks = {prefix_affinity(workers, system + [i])[0].address for i in range(20)}
    assert len(picks) == 1, "one shared system prompt must land on one worker"
    spread = {prefix_affinity(workers, [i] * 64)[0].address for i in range(40)}
    assert len(spread) > 1, "different prefixes spread over workers"


def test_prefix_affinity_yields_to_load():
    workers = [handle("w0"), handle("w1")]
    prompt = list(range(64))
    preferred = prefix_affinity(workers, prompt)[0]
    preferred.inflight_tokens = 10_000
    assert prefix_affinity(workers, prompt)[0] is not preferred


def test_most_free_blocks_orders_by_room_and_keeps_full_ones_last():
    a, b, c = handle("a", free_blocks=5), handle("b", free_blocks=90), handle("c", free_blocks=40)
    assert [w.address for w in most_free_blocks([a, b, c], num_blocks=10)] == ["b", "c", "a"]


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ValueError, match="least_queued"):
        get_policy("prefill", "random")
