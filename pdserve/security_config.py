"""The cluster config's security and limits sections as the objects the servers take (frozen
dataclasses inside a process; pydantic stays at the edge)."""

from __future__ import annotations

from grpc_plumbing.tls import ClusterTls, TlsFiles
from pdserve.config import ClusterConfig


def cluster_tls(c: ClusterConfig) -> ClusterTls | None:
    t = c.security.cluster_tls
    return None if t is None else ClusterTls(t.cert, t.key, t.ca, t.server_name)


def api_security(c: ClusterConfig):
    from router.security import ApiSecurity

    t = c.security.tls
    tls = None if t is None else TlsFiles(t.cert, t.key, t.client_ca)
    return ApiSecurity(tls, c.security.allow_unauthenticated, c.security.open_metrics)


def request_limits(c: ClusterConfig):
    from router.limits import RequestLimits

    lim = c.limits
    return RequestLimits(
        max_request_bytes=lim.max_request_bytes,
        max_prompt_tokens=lim.max_prompt_tokens,
        max_tokens=lim.max_tokens,
        max_stop_strings=lim.max_stop_strings,
        max_stop_string_chars=lim.max_stop_string_chars,
        max_logit_bias=lim.max_logit_bias,
        max_stop_token_ids=lim.max_stop_token_ids,
        max_sequences=lim.max_sequences,
        max_total_tokens=lim.max_total_tokens,
        max_logprobs=lim.max_logprobs,
    )
