"""``pdserve bench router`` runs end to end against instant fake workers."""

from __future__ import annotations

import asyncio

from pdserve.bench.router_overhead import _measure


def test_router_overhead_benchmark_reports_its_fields():
    result = asyncio.run(_measure(n=20, prompt_tokens=64))
    assert result["prompt_tokens"] == 64
    assert result["routed_p50_ms"] > 0 and result["direct_p50_ms"] > 0
    assert result["router_added_p50_ms"] == result["routed_p50_ms"] - result["direct_p50_ms"]
