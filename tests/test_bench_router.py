"""``pdserve bench router`` runs end to end: fake workers, the router and the client each in
their own process, as deployed."""

from __future__ import annotations

import asyncio

from pdserve.measure.router_overhead import PATTERNS, measure


def test_router_overhead_benchmark_reports_its_fields():
    result = asyncio.run(measure(n=20, prompt_tokens=64))
    assert result["prompt_tokens"] == 64 and result["separate_processes"]
    assert [r["pattern"] for r in result["rows"]] == list(PATTERNS)
    for r in result["rows"]:
        assert r["routed_p50_ms"] > 0 and r["direct_p50_ms"] > 0
        assert r["router_added_p50_ms"] == r["routed_p50_ms"] - r["direct_p50_ms"]
        # The bare relay (the floor) was measured in the same rounds.
        relay_p50 = r["direct_p50_ms"] + r["relay_added_p50_ms"]
        assert relay_p50 > 0
        assert abs(r["router_beyond_relay_p50_ms"] - (r["routed_p50_ms"] - relay_p50)) < 1e-9
    assert result["router_added_p50_ms"] == max(r["router_added_p50_ms"] for r in result["rows"])
    assert result["relay_added_p50_ms"] == max(r["relay_added_p50_ms"] for r in result["rows"])


def test_bare_relay_answers_with_the_prefill_workers_first_token():
    """The floor is a real hop: a Generate through the relay returns the fake's first token."""
    import grpc

    from pdserve.measure.router_overhead import _spawn
    from protos import pdserve_pb2 as pb
    from protos import pdserve_pb2_grpc as pb_grpc

    fakes, (p_addr, _) = _spawn(["-m", "pdserve.measure.router_overhead"])
    relay, (relay_addr,) = _spawn(["-m", "pdserve.measure.router_overhead", "--relay", p_addr])
    try:
        with grpc.insecure_channel(relay_addr) as ch:
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]))
            [resp] = list(pb_grpc.GenerationStub(ch).Generate(req, timeout=30))
        assert list(resp.token_ids) == [5]  # InstantPrefill's first token
    finally:
        for proc in (fakes, relay):
            proc.stdin.close()
            proc.terminate()
            proc.wait(timeout=10)


def test_the_benchmark_runs_a_traced_router_beside_the_untraced_one():
    """Tracing on vs off in the same rounds: the traced router really exports (the sink took
    batches), and each row says both and their difference."""
    import pytest

    pytest.importorskip("opentelemetry.sdk", reason="needs pip install 'pdserve[tracing]'")
    result = asyncio.run(measure(n=20, prompt_tokens=64, traced=True))
    assert result["traced_exports"] >= 1
    for r in result["rows"]:
        traced = r["traced_added_p50_ms"]
        assert abs(r["routed_minus_traced_p50_ms"] - (r["router_added_p50_ms"] - traced)) < 1e-9
