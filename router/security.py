"""What the router's client API needs before it may listen: an API key off loopback (or the
operator's explicit --allow-unauthenticated), and optional TLS (HTTPS and gRPC over TLS).

The check runs before any port is bound, so a refused start leaves nothing listening.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpc_plumbing.auth import OpenBindError, is_loopback
from grpc_plumbing.tls import TlsFiles


@dataclass(frozen=True)
class ApiSecurity:
    tls: TlsFiles | None = None  # the client API's certificate, key and optional client CA
    allow_unauthenticated: bool = False  # serve off loopback without an API key
    open_metrics: bool = False  # /metrics without the key (it lists worker addresses)


def check_api_exposure(host: str, api_key: str | None, security: ApiSecurity) -> None:
    """OpenBindError when the client API would listen off loopback with no API key and the
    operator did not say --allow-unauthenticated."""
    if api_key or security.allow_unauthenticated or is_loopback(host):
        return
    raise OpenBindError(
        f"refusing to serve the client API on {host} without an API key: anyone who can reach "
        "it could use the cluster. Set --api-key (or $PDSERVE_API_KEY, config api_key), bind "
        "127.0.0.1, or pass --allow-unauthenticated (config security.allow_unauthenticated) "
        "when something in front of the router authenticates clients."
    )


__all__ = ["ApiSecurity", "OpenBindError", "TlsFiles", "check_api_exposure", "is_loopback"]
