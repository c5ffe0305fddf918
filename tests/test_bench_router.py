"""``pdserve bench router`` runs end to end: fake workers, the router and the client each in
their own process, as deployed."""

from __future__ import annotations

import asyncio

from pdserve.bench.router_overhead import PATTERNS, _measure


def test_router_overhead_benchmark_reports_its_fields():
    result = asyncio.run(_measure(n=20, prompt_tokens=64))
    assert result["prompt_tokens"] == 64 and result["separate_processes"]
    assert [r["pattern"] for r in result["rows"]] == list(PATTERNS)
    for r in result["rows"]:
        assert r["routed_p50_ms"] > 0 and r["direct_p50_ms"] > 0
        assert r["router_added_p50_ms"] == r["routed_p50_ms"] - r["direct_p50_ms"]
    assert result["router_added_p50_ms"] == max(r["router_added_p50_ms"] for r in result["rows"])
