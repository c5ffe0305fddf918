"""The router's circuit breaker: a worker whose attempts keep failing leaves routing for a
cool-down, is probed after it, and comes back on a success; shown in /metrics."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster.local import ClusterSpec, LocalCluster
from pdserve.cluster.ray_launcher import format_status
from router import pool as pool_module
from router.pool import BreakerSettings, WorkerHandle
from tests.cluster_utils import assert_all_blocks_free, generate_concurrently
from tests.conftest import tiny_llama_dir
from tests.test_disagg import engine_reference, mixed_prompts

NEW_TOKENS = 8


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(pool_module.time, "monotonic", c)
    return c


def _handle() -> WorkerHandle:
    breaker = BreakerSettings(failures=3, cooldown_s=10.0)
    return WorkerHandle("w:1", "prefill", None, None, healthy=True, breaker=breaker)


def test_failures_in_a_row_open_the_circuit_for_the_cool_down(clock):
    w = _handle()
    for _ in range(2):
        w.mark_failed()
        clock.now += pool_module.SUSPECT_S  # past the short suspicion of one failure
        assert w.circuit == "closed" and w.routable
    w.mark_failed()
    assert w.circuit == "open" and w.circuit_trips == 1
    clock.now += 9.9
    assert not w.routable  # the suspicion of one failure is long over; the circuit is not
    clock.now += 0.2
    assert w.circuit == "half_open" and w.routable  # probation: the next attempt decides


def test_a_failed_probe_opens_the_circuit_again_and_a_success_closes_it(clock):
    w = _handle()
    for _ in range(3):
        w.mark_failed()
    clock.now += 10.1
    w.mark_failed()  # the probe
    assert w.circuit == "open" and w.circuit_trips == 2 and not w.routable
    clock.now += 10.1
    w.mark_succeeded()
    assert w.circuit == "closed" and w.routable
    w.mark_failed()  # a single failure after a success is only a suspicion again
    assert w.circuit == "closed"


def test_a_success_between_failures_resets_the_count(clock):
    w = _handle()
    for _ in range(5):
        w.mark_failed()
        w.mark_failed()
        w.mark_succeeded()
    assert w.circuit == "closed" and w.circuit_trips == 0


def test_pdserve_status_shows_a_tripped_circuit():
    row = {
        "id": "decode-1",
        "state": "ready",
        "healthy": True,
        "draining": False,
        "address": "127.0.0.1:1",
        "kv_usage": 0.0,
        "running": 0,
        "waiting": 0,
        "served_requests": 7,
    }
    pools = {
        "prefill": [],
        "decode": [{**row, "circuit": "open"}, {**row, "id": "decode-2", "circuit": "half_open"}],
    }
    st = {"pools": {r: {"workers": w, "target": 2, "min": 1, "max": 3} for r, w in pools.items()}}
    lines = format_status(st).splitlines()
    assert "tripped" in next(line for line in lines if "decode-1" in line)
    assert "probing" in next(line for line in lines if "decode-2" in line)


def _samples(router) -> dict[tuple[str, tuple], float]:
    text, _ = router.metrics.render()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def test_a_prefill_worker_whose_steps_fail_leaves_routing_until_it_recovers(tmp_path):
    """Prefill worker 0's every step raises. Each request it takes fails there and goes on
    to worker 1 with the same greedy output; after 3 failures in a row worker 0's circuit
    opens and it gets no request for the cool-down, though its Status answers fine. Repaired,
    it is probed after the cool-down, succeeds, and routing comes back."""
    model, _ = tiny_llama_dir(tmp_path, num_kv_heads=2, seed=9)
    prompts = [p[:30] for p in mixed_prompts(13, seed=31)]
    reference = engine_reference(model, prompts, new_tokens=NEW_TOKENS)
    # The probe's prompt is sent nowhere before it: under the default kv_aware routing a
    # prompt worker 1 already served has its blocks cached there, and goes to worker 1 on
    # that merit (correctly), not to the half-open worker 0. With no cache hit anywhere the
    # two cost alike and the half-open worker, first in the pool, gets it, as under least_queued.
    probe = len(prompts) - 1
    spec = ClusterSpec(model=str(model), num_prefill=2, num_blocks=256, max_model_len=256)
    with LocalCluster(spec) as cluster:
        broken_worker = cluster.prefill_workers[0]
        runner = broken_worker.engine.runner
        execute = runner.execute

        def failing_step(*args, **kw):
            raise RuntimeError("injected: this worker's steps fail")

        runner.execute = failing_step
        w0 = cluster.router.prefill.workers[cluster.prefill_addresses[0]]
        w0.breaker = BreakerSettings(failures=3, cooldown_s=3.0)

        def send(i: int) -> None:
            req = {"token_ids": prompts[i], "max_tokens": NEW_TOKENS, "ignore_eos": True}
            (out,) = generate_concurrently(cluster, [req])
            assert out.token_ids == reference[i], i

        sent, deadline = 0, time.monotonic() + 20
        while w0.circuit != "open":  # each failure keeps worker 0 away for SUSPECT_S only
            assert time.monotonic() < deadline, "the circuit never opened"
            send(sent % probe)  # never the probe's prompt
            sent += 1
            time.sleep(0.1)
        assert w0.consecutive_failures == 3 and w0.circuit_trips == 1
        samples = _samples(cluster.router)
        assert samples[("pdserve:num_workers_circuit_open", (("pool", "prefill"),))] == 1
        trips = (
            "pdserve:worker_circuit_trips_total",
            (("pool", "prefill"), ("worker", w0.address)),
        )
        assert samples[trips] == 1

        (row,) = [r for r in cluster.router.pool_status()["prefill"] if r["address"] == w0.address]
        assert row["circuit"] == "open"  # what `pdserve status` shows (as "tripped")
        served = w0.served_requests
        time.sleep(pool_module.SUSPECT_S + 0.1)  # past the per-failure suspicion
        cluster.run(cluster.router.prefill.poll())
        assert w0.healthy and not w0.routable  # it answers Status, but the circuit holds it
        for i in range(3):
            send(i)
        assert w0.served_requests == served

        runner.execute = execute  # repaired; after the cool-down one request probes it
        while w0.circuit == "open":
            time.sleep(0.1)
        send(probe)
        assert w0.served_requests == served + 1  # the probe went to worker 0 ...
        assert w0.circuit == "closed" and w0.consecutive_failures == 0  # ... and succeeded
        assert _samples(cluster.router)[trips] == 1
        assert_all_blocks_free(cluster)
