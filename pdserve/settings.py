"""Every process's settings, derived from one ``ClusterConfig`` in one function.

The cluster config (YAML, pydantic) is the edge; inside a process each role runs on its own
frozen settings: ``RouterSettings`` (router/settings.py), ``PrefillSettings`` and
``DecodeSettings`` (prefill_worker/launch.py, decode_worker/launch.py), each holding its
defaults. The Ray actors and
the local harness both call ``settings_from_config``, so a field added to the config reaches a
process through one line here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from decode_worker.launch import DecodeSettings
from engine.settings import EngineSettings
from grpc_plumbing.worker_process import ServerSettings
from pdserve.config import ClusterConfig
from pdserve.security_config import api_security, cluster_tls, request_limits
from prefill_worker.launch import PrefillSettings
from router.settings import RouterSettings

# What a ClusterConfig field of the same name sets; model and the pool's own (threads: per
# rank, tensor_parallel_size) come from elsewhere.
_PER_POOL = ("model", "threads", "tensor_parallel_size")
ENGINE_FIELDS = tuple(f.name for f in fields(EngineSettings) if f.name not in _PER_POOL)


@dataclass(frozen=True)
class ClusterSettings:
    router: RouterSettings
    prefill: PrefillSettings
    decode: DecodeSettings
    host: str  # where the router's front doors and the workers bind
    grpc_port: int  # the router's client gRPC port (0: a free one)
    http_port: int | None  # None: no HTTP server
    api_security: object  # router.security.ApiSecurity: client TLS, /metrics, exposure

    def worker(self, role: str) -> PrefillSettings | DecodeSettings:
        return self.prefill if role == "prefill" else self.decode


def settings_from_config(cfg: ClusterConfig, host: str, model_dir: str | None = None):
    """The settings of every process of ``cfg``'s cluster. ``host``: the address this node's
    processes bind (the config's, else the node's own); ``model_dir``: the model folder as
    resolved on this node (default: the config's model, which each worker resolves)."""
    tls = cluster_tls(cfg)
    model = model_dir or cfg.model

    def worker_engine(role: str) -> EngineSettings:
        # Every engine knob the config names the same way (block_size, weights, kv_dtype...)
        # is copied: a new one reaches the workers by being declared on both.
        same = {k: getattr(cfg, k) for k in ENGINE_FIELDS if k in ClusterConfig.model_fields}
        pool = cfg.pools[role]
        return EngineSettings(
            **same,
            model=model,
            threads=pool.threads,
            tensor_parallel_size=pool.tensor_parallel_size,
        )

    server = ServerSettings(
        host=host,
        cluster_token=cfg.cluster_token,
        cluster_tls=tls,
        stall_timeout_s=cfg.step_stall_timeout_s,
        drain_grace_s=cfg.drain_grace_s,
        otlp_traces_endpoint=cfg.otlp_traces_endpoint,
    )
    return ClusterSettings(
        router=_router_settings(cfg, model, tls),
        prefill=PrefillSettings(
            engine=worker_engine("prefill"), server=server, layerwise_kv=cfg.prefill_layerwise_kv
        ),
        decode=DecodeSettings(
            engine=worker_engine("decode"),
            server=server,
            kv_transport=cfg.kv_transport,
            lease_ttl_s=cfg.lease_ttl_s,
            max_lease_s=cfg.limits.max_lease_seconds,
            kv_private_network=cfg.security.kv_private_network,
        ),
        host=host,
        grpc_port=cfg.grpc_port,
        http_port=cfg.http_port,
        api_security=api_security(cfg),
    )


def _router_settings(cfg: ClusterConfig, model_dir: str, tls) -> RouterSettings:
    r = cfg.router
    return RouterSettings(
        model_dir=model_dir,
        model_name=cfg.model_name,
        max_model_len=cfg.max_model_len,
        block_size=cfg.block_size,
        prefill_policy=r.prefill_policy,
        decode_policy=r.decode_policy,
        max_inflight_requests=r.max_inflight_requests,
        default_max_tokens=r.default_max_tokens,
        local_prefill_max_tokens=r.local_prefill_max_tokens,
        kv_local_tail_tokens=r.kv_local_tail_tokens,
        concurrent_reserve_headroom=r.concurrent_reserve_headroom,
        first_token_timeout_s=r.first_token_timeout_s,
        first_token_s_per_token=r.first_token_s_per_token,
        token_timeout_s=r.token_timeout_s,
        max_ejection_percent=r.max_ejection_percent,
        api_key=cfg.api_key,
        cluster_token=cfg.cluster_token,
        cluster_tls=tls,
        limits=request_limits(cfg),
        otlp_traces_endpoint=cfg.otlp_traces_endpoint,
    )
