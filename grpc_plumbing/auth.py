"""The cluster token on worker servers: every call must carry ``x-pdserve-token`` metadata.

Worker-to-worker and router-to-worker calls (Reserve, Prefill, Decode, Status, PushFrames)
are refused with UNAUTHENTICATED without it. The token comes from the worker's config or the
``PDSERVE_CLUSTER_TOKEN`` environment variable (the Ray controller makes a random one per
cluster). Without one a worker serves on a loopback address only: it refuses to bind anything
else, since anyone who reached its port could reserve, prefill or push KV.
"""

from __future__ import annotations

import hmac
import ipaddress
import os

import grpc
from grpc_health.v1 import health

TOKEN_KEY = "x-pdserve-token"  # the gRPC metadata key (lower case, as gRPC requires)
TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"

# The standard health service's methods: open without the token, since probes carry none.
HEALTH_METHODS = frozenset(f"/{health.SERVICE_NAME}/{method}" for method in ("Check", "Watch"))


class OpenBindError(RuntimeError):
    """A server would listen off loopback without the authentication that makes that safe."""


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``; False for 0.0.0.0, ::, names and other IPs
    (a name may resolve anywhere, so it counts as exposed)."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def require_token_off_loopback(host: str, token: str | None, what: str) -> None:
    """Raise OpenBindError, before anything binds, for an unauthenticated server off loopback."""
    if not token and not is_loopback(host):
        raise OpenBindError(
            f"refusing to serve the {what} on {host} without a cluster token: anyone who can "
            f"reach the port could call it. Set {TOKEN_ENV} (the Ray controller makes one per "
            "cluster) or bind 127.0.0.1."
        )


def resolve_cluster_token(token: str | None = None) -> str | None:
    """The explicit token, else the environment's, else None (no check: loopback only)."""
    return token or os.environ.get(TOKEN_ENV) or None


def token_matches(sent, token: str) -> bool:
    return isinstance(sent, str) and hmac.compare_digest(sent.encode(), token.encode())


_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class ClusterTokenInterceptor(grpc.ServerInterceptor):
    """For sync ``grpc.server``: refuse calls without the cluster token."""

    def __init__(self, token: str):
        self.token = token

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if handler is None or token_matches(metadata.get(TOKEN_KEY), self.token):
            return handler
        if handler_call_details.method in HEALTH_METHODS:  # probes carry no token
            return handler

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"missing or bad {TOKEN_KEY}")

        make = _HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)]
        return make(
            deny,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def server_interceptors(token: str | None) -> list[grpc.ServerInterceptor]:
    return [ClusterTokenInterceptor(token)] if token else []
