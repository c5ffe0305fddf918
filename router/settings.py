"""The router's settings: one frozen object per router process, and the home of every router
default (``pdserve/config.py``, ``python -m router`` and the local harness read them from here).
Torch-free, like the rest of the router."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import CacheConfig
from grpc_plumbing.tls import ClusterTls
from router.limits import RequestLimits


@dataclass(frozen=True)
class RouterSettings:
    model_dir: str  # for the tokenizer and chat template
    model_name: str = "smollm2"  # what /v1/models lists and requests name
    max_model_len: int = 2048
    block_size: int = CacheConfig.block_size  # the workers' (to estimate a request's blocks)
    # Both pools route by what each worker's prefix cache holds against its load (policy
    # kv_aware, router/policies.py): against least_queued / most_free_blocks, the defaults
    # before it, it attained as much or more at the SLO with a lower TTFT and fewer KV bytes
    # shipped on every recorded run (docs/BENCHMARKS.md, "KV-aware routing"). Those two stay
    # selectable by name.
    prefill_policy: str = "kv_aware"
    decode_policy: str = "kv_aware"
    max_inflight_requests: int = 256  # admission: beyond this, 429 at once
    # Admission: while the oldest request still waiting for its first token has waited longer
    # than this, new ones get 429 at once (router.limits.FirstTokenQueue). Under the KV lease
    # TTL, so no admitted request's lease expires in the queue.
    max_queue_wait_s: float = 10.0
    default_max_tokens: int = 128
    reserve_timeout_s: float = 30.0
    status_poll_s: float = 0.1
    # Prompts up to this many tokens are prefilled on the decode worker (no KV transfer). Pick
    # it from measured latencies: where local prefill costs less than the transfer round trip.
    local_prefill_max_tokens: int = 0
    # KV-aware routing (policy kv_aware): where the chosen decode worker's prefix cache holds
    # all of a prompt but at most this many tokens (a chat's next turn: the history is there),
    # it prefills that tail itself: no prefill round trip, no KV shipped.
    kv_local_tail_tokens: int = 64
    # Reserve decode blocks and prefill at once while a decode worker (as last polled, less the
    # router's own reservations since) keeps this share of its blocks free after the request;
    # < 0: always reserve first.
    concurrent_reserve_headroom: float = 0.1
    api_key: str | None = None  # clients must send it (HTTP Bearer, gRPC metadata) when set
    cluster_token: str | None = None  # sent to workers as x-pdserve-token when set
    cluster_tls: ClusterTls | None = None  # mutual TLS to the workers
    limits: RequestLimits = field(default_factory=RequestLimits)  # caps, named in their 400s
    # Liveness: a worker that stops answering is treated as a dead one (its attempt ends HUNG
    # and the request migrates with its tokens). A first token (a Prefill's, or a Decode's
    # first chunk) may take first_token_timeout_s + first_token_s_per_token x the prompt tokens
    # the worker has to prefill before it (its queue at this router, and the prompt itself):
    # 60 s + 20 s for a 2,000-token queue, far past any healthy worker's, also a slow CPU's
    # (a 135M model prefills thousands of tokens a second on one core; at 0.01 s per token
    # the budget allows 100 tokens/s). Each later Decode chunk may take token_timeout_s: a
    # running sequence gets a token every step, and a step, even with a prefill chunk mixed
    # in, takes well under a second on a CPU; 20 s tolerates a 20x stall.
    first_token_timeout_s: float = 60.0
    first_token_s_per_token: float = 0.01
    token_timeout_s: float = 20.0
    # The circuit breaker never takes more than this share of a pool out of routing at once
    # (Envoy's max_ejection_percent): past it a failing worker stays in (router.pool).
    max_ejection_percent: float = 50.0
    # OpenTelemetry: where the router exports its spans (grpc_plumbing/tracing.py); None: off.
    otlp_traces_endpoint: str | None = None
