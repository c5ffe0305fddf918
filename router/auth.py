"""The optional API key of the public API: ``Authorization: Bearer <key>`` as an HTTP header
or as gRPC metadata. Without a configured key, everything is open.

On gRPC only ``Health`` and the standard ``grpc.health.v1.Health`` stay open (probes carry
no key); every other method needs it,
server reflection included (the schema is no secret, but an open door is one more to audit:
``grpcurl -H 'authorization: Bearer KEY'`` sends it to reflection too). On HTTP every route
but ``/health`` needs it (``/metrics`` optionally open): see router/http/guard.py.
"""

from __future__ import annotations

import hmac

import grpc

from grpc_plumbing.auth import HEALTH_METHODS

OPEN_GRPC_METHODS = ("/pdserve.v1.Generation/Health", *HEALTH_METHODS)
OPEN_GRPC_PREFIXES: tuple[str, ...] = ()


def bearer_ok(authorization: str | None, api_key: str) -> bool:
    """True when the header value is ``Bearer <api_key>`` (compared in constant time)."""
    if not isinstance(authorization, str):
        return False
    scheme, _, key = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        key.strip().encode(), api_key.encode()
    )


_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuse calls without the API key with UNAUTHENTICATED."""

    def __init__(self, api_key: str):
        self.api_key = api_key

    def _is_open(self, method: str) -> bool:
        return method in OPEN_GRPC_METHODS or method.startswith(OPEN_GRPC_PREFIXES)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if (
            handler is None
            or self._is_open(handler_call_details.method)
            or bearer_ok(metadata.get("authorization"), self.api_key)
        ):
            return handler
        streaming = (handler.request_streaming, handler.response_streaming)
        return _HANDLER_KINDS[streaming](
            _deny_stream if streaming[1] else _deny,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


_DENIED = "missing or invalid API key (send metadata 'authorization: Bearer <key>')"


async def _deny(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)


async def _deny_stream(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)
    yield  # pragma: no cover - abort raises; this makes the function an async generator
