"""The KV link as a shared resource: transfers queue, and TTFT rises as a D/D/1 queue says."""

from __future__ import annotations

import pytest

from pdserve.planner.kv_link import KvLink, LinkQueue
from pdserve.planner.sim import SimConfig, Split, simulate
from pdserve.planner.workload import TraceRequest
from tests.test_planner_sim import toy_profile

PROMPT = 64
SERVICE_S = 0.5  # one prompt's KV on the link (the toy prefills 64 tokens in 0.13 s)


def _ttfts(gap_s: float, n: int = 40):
    """``n`` equal prompts ``gap_s`` apart on 8 prefill workers (no prefill queue), one link
    the whole cluster shares, the first token out once the KV is committed."""
    prof = toy_profile(router_s=0.001)
    nbytes = PROMPT * prof.kv_bytes_per_token  # the prompt's KV
    link = KvLink(nbytes / SERVICE_S, latency_s=0.0005, scope="cluster")
    cfg = SimConfig(Split(8, 2), kv_link=link, first_token_waits_for_kv=True)
    trace = [TraceRequest(i * gap_s, PROMPT, 2) for i in range(n)]
    run = simulate(prof, trace, cfg)
    return prof, link, run.result.ttfts


def test_a_saturated_link_raises_ttft_by_the_queue_bound():
    gap = SERVICE_S / 2  # arrivals twice as fast as the link drains them
    prof, link, ttfts = _ttfts(gap)
    prefill = prof.prefill_seconds(PROMPT, 0)
    assert prefill + SERVICE_S / prof.num_layers < SERVICE_S  # the link, not compute, binds
    base = prof.router_overhead_s + SERVICE_S + link.latency_s
    for k, ttft in enumerate(ttfts):
        # D/D/1: the k-th transfer waits k x (service - gap) behind the ones before it.
        assert ttft == pytest.approx(base + k * (SERVICE_S - gap), rel=1e-6)
    assert ttfts[-1] > 10 * ttfts[0]


def test_an_unsaturated_link_adds_only_its_own_service_time():
    prof, link, ttfts = _ttfts(SERVICE_S * 2)
    base = prof.router_overhead_s + SERVICE_S + link.latency_s
    assert ttfts == pytest.approx([base] * len(ttfts), rel=1e-6)


def _spread(link: KvLink) -> SimConfig:
    """4 prefill workers taking turns (least-queued would send every prompt to the first: it
    is idle again before the next arrives, its NIC still busy)."""
    return SimConfig(
        Split(4, 2), kv_link=link, first_token_waits_for_kv=True, prefill_policy="round_robin"
    )


def test_one_link_per_prefill_worker_queues_only_its_own_transfers():
    prof = toy_profile()
    nbytes = PROMPT * prof.kv_bytes_per_token
    trace = [TraceRequest(i * SERVICE_S / 2, PROMPT, 2) for i in range(40)]
    per_worker = KvLink(nbytes / SERVICE_S, 0.0, "prefill_worker")
    shared = KvLink(nbytes / SERVICE_S, 0.0, "cluster")
    runs = {
        link.scope: simulate(prof, trace, _spread(link)).result for link in (per_worker, shared)
    }
    # 4 NICs drain 2x the arrival rate: no queue; one shared link is 2x oversubscribed.
    assert runs["prefill_worker"].ttft_ms.p99 < 2 * runs["prefill_worker"].ttft_ms.median
    assert runs["cluster"].ttft_ms.p99 > 5 * runs["prefill_worker"].ttft_ms.p99


def test_the_link_of_a_transfer_table_and_bad_links_are_named():
    link = KvLink.from_table((1e6, 1e9), (1e-3 + 1e6 / 4e10, 1e-3 + 1e9 / 4e10))
    assert link.bandwidth_bytes_per_s == pytest.approx(4e10)
    assert link.latency_s == pytest.approx(1e-3)
    q = LinkQueue(link)
    assert q.push(0.0, 0.0, 4e10 * 0.01, 1) == pytest.approx(0.011)
    assert q.push(0.0, 0.0, 4e10 * 0.01, 1) == pytest.approx(0.021)  # queued behind
    with pytest.raises(ValueError, match="bandwidth"):
        KvLink(0.0)
    with pytest.raises(ValueError, match="scope"):
        KvLink(1.0, scope="rack")
