"""The cluster token on worker servers: every call must carry ``x-pdserve-token`` metadata.

Worker-to-worker and router-to-worker calls (Reserve, Prefill, Decode, Status, PushFrames)
are refused with UNAUTHENTICATED without it. The token comes from the worker's config or the
``PDSERVE_CLUSTER_TOKEN`` environment variable; with neither, workers accept any caller (bind
them to a private address then).
"""

from __future__ import annotations

import hmac
import os

import grpc

TOKEN_KEY = "x-pdserve-token"
TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"


def resolve_cluster_token(token: str | None = None) -> str | None:
    """The explicit token, else the environment's, else None (no check)."""
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


def worker_server(host: str, port: int, token: str | None, max_workers: int = 64):
    """A worker's sync gRPC server, bound to ``host:port`` only, with KV-sized message limits
    and the cluster-token check; returns (server, "host:port" actually bound)."""
    from concurrent import futures

    from kv_transfer.transport_grpc import EXCLUSIVE_PORT, bind, message_options

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=message_options() + EXCLUSIVE_PORT,
        interceptors=server_interceptors(token),
    )
    return server, f"{host}:{bind(server, f'{host}:{port}')}"
