"""Prometheus metrics under the ``pdserve:`` prefix, named as vLLM names them.

Each router owns its own ``CollectorRegistry`` (tests run several routers in one process).
Per-request histograms are observed as a request's deltas go by (``RequestTracker``); pool and
worker gauges are read at scrape time from the workers' last status poll (``PoolCollector``),
so they are exactly as fresh as the router's routing view.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

P = "pdserve:"

# As vLLM does: no ``*_created`` series (process-wide switch in prometheus_client).
disable_created_metrics()

# Seconds: from sub-millisecond gaps between tokens to minutes-long requests.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class Metrics:
    def __init__(self, router, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]

        def hist(name, doc, buckets=LATENCY_BUCKETS):
            return Histogram(P + name, doc, m, buckets=buckets, registry=r).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("inter_token_latency_seconds", "Gap between consecutive output tokens.")
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.")
        self.queue = hist("request_queue_time_seconds", "Prefill queue plus decode queue time.")
        self.prefill = hist("request_prefill_time_seconds", "Prefill compute time.")
        self.decode = hist("request_decode_time_seconds", "Time from first token to the last.")
        self.kv_seconds = hist("kv_transfer_seconds", "KV transfer time not hidden by prefill.")
        self.prompt_len = hist("request_prompt_tokens", "Prompt length.", TOKEN_BUCKETS)
        self.output_len = hist("request_generation_tokens", "Output length.", TOKEN_BUCKETS)
        self.kv_bytes = Counter(P + "kv_transfer_bytes", "KV bytes moved.", m, registry=r).labels(
            model_name
        )
        self.prompt_tokens = Counter(
            P + "prompt_tokens", "Prompt tokens processed.", m, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            P + "generation_tokens", "Tokens generated.", m, registry=r
        ).labels(model_name)
        self.success = Counter(
            P + "request_success",
            "Finished requests by finish reason.",
            m + ["finished_reason"],
            registry=r,
        )
        self.rejected = Counter(
            P + "request_rejected", "Requests refused as overloaded (429).", m, registry=r
        ).labels(model_name)
        self.migrations = Counter(
            P + "request_migrations",
            "Attempts lost to a failed worker and continued on another (finished requests).",
            m,
            registry=r,
        ).labels(model_name)
        r.register(PoolCollector(router))

    def track(self) -> RequestTracker:
        return RequestTracker(self)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTracker:
    """Observes one request: token gaps as deltas arrive, everything else at the end."""

    def __init__(self, metrics: Metrics):
        self.m = metrics
        self.last = time.monotonic()
        self.first_seen = False

    def on_delta(self, delta) -> None:
        now = time.monotonic()
        n = len(delta.token_ids)
        if n and self.first_seen:
            # A chunk of n tokens that arrived together: n gaps sharing the wait.
            for _ in range(n):
                self.m.itl.observe((now - self.last) / n)
        self.first_seen = self.first_seen or n > 0
        self.last = now
        if delta.usage is not None:  # the request's last delta (of its n sequences)
            self._finish(delta)

    def _finish(self, delta) -> None:
        m, t, usage = self.m, delta.timings, delta.usage
        m.ttft.observe(t.ttft_s)
        m.e2e.observe(t.e2e_s)
        m.queue.observe(t.prefill_queue_s + t.decode_queue_s)
        m.prefill.observe(t.prefill_s)
        m.decode.observe(max(0.0, t.e2e_s - t.ttft_s))
        m.kv_seconds.observe(t.kv_transfer_s)
        m.kv_bytes.inc(t.kv_bytes)
        m.prompt_len.observe(usage.prompt_tokens)
        m.output_len.observe(usage.completion_tokens)
        m.prompt_tokens.inc(usage.prompt_tokens)
        m.generation_tokens.inc(usage.completion_tokens)
        m.success.labels(m.model_name, delta.finish_reason).inc()
        m.migrations.inc(getattr(t, "migrations", 0))


class PoolCollector:
    """Pool and worker gauges, plus the workers' own counters, from the last status poll."""

    def __init__(self, router):
        self.router = router

    def collect(self):
        running = GaugeMetricFamily(
            P + "num_requests_running", "Requests running, per pool.", labels=["pool"]
        )
        waiting = GaugeMetricFamily(
            P + "num_requests_waiting", "Requests waiting, per pool.", labels=["pool"]
        )
        ready = GaugeMetricFamily(
            P + "num_workers_ready", "Routable workers, per pool.", labels=["pool"]
        )
        usage = GaugeMetricFamily(
            P + "kv_cache_usage_perc",
            "KV cache usage (0-1), per worker.",
            labels=["pool", "worker"],
        )
        hits = CounterMetricFamily(
            P + "prefix_cache_hits",
            "Prompt tokens found in the prefix cache (decode: prefilled there, or pinned by a "
            "lease and not shipped).",
            labels=["pool", "worker"],
        )
        queries = CounterMetricFamily(
            P + "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            labels=["pool", "worker"],
        )
        preempt = CounterMetricFamily(
            P + "num_preemptions", "Decode preemptions.", labels=["worker"]
        )
        kernels = GaugeMetricFamily(
            P + "cpu_kernel_info",
            "1 per worker, labelled with its CPU kernel build (avx512 | avx2 | torch).",
            labels=["pool", "worker", "variant"],
        )
        circuit_open = GaugeMetricFamily(
            P + "num_workers_circuit_open",
            "Workers out of routing after failing attempts in a row (circuit breaker), per pool.",
            labels=["pool"],
        )
        circuit_trips = CounterMetricFamily(
            P + "worker_circuit_trips",
            "Times a worker's circuit breaker opened.",
            labels=["pool", "worker"],
        )
        for pool in (self.router.prefill, self.router.decode):
            workers = list(pool.workers.values())
            circuit_open.add_metric([pool.role], sum(w.circuit == "open" for w in workers))
            for w in workers:
                circuit_trips.add_metric([pool.role, w.address], w.circuit_trips)
            statuses = [(w, w.last_status) for w in workers if w.last_status is not None]
            running.add_metric([pool.role], sum(s.num_running for _, s in statuses))
            waiting.add_metric([pool.role], sum(s.num_waiting for _, s in statuses))
            ready.add_metric([pool.role], sum(w.routable for w in workers))
            for w, s in statuses:
                total = s.num_total_blocks
                usage.add_metric(
                    [pool.role, w.address], 1 - s.num_free_blocks / total if total else 0.0
                )
                if s.cpu_kernels:
                    kernels.add_metric([pool.role, w.address, s.cpu_kernels], 1)
                hits.add_metric([pool.role, w.address], s.prefix_hit_tokens)
                queries.add_metric([pool.role, w.address], s.prefix_query_tokens)
                if pool.role == "decode":
                    preempt.add_metric([w.address], s.num_preemptions)
        inflight = GaugeMetricFamily(
            P + "num_requests_inflight", "Requests in the router.", value=self.router.inflight
        )
        breaker = [circuit_open, circuit_trips]
        planner = self._planner_prediction()
        return [
            running, waiting, ready, usage, hits, queries, preempt, kernels, inflight, *breaker,
            planner,
        ]  # fmt: skip

    def _planner_prediction(self) -> GaugeMetricFamily:
        """What the planner predicted for the traffic served over what was measured, less 1,
        per figure (the controller computes it with the profile and sets it on the router)."""
        g = GaugeMetricFamily(
            P + "planner_prediction_error",
            "Planner's prediction for the recent traffic / measured - 1, per figure.",
            labels=["metric"],
        )
        pred = getattr(self.router, "planner_prediction", None) or {}
        for metric, value in sorted(pred.get("error", {}).items()):
            g.add_metric([metric], value)
        return g
