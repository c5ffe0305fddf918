"""Binding gRPC servers: exclusive ports, TLS when configured, and message-size options."""

from __future__ import annotations

from grpc_plumbing.tls import ClusterTls, TlsFiles

MAX_MESSAGE_BYTES = 8 * 1024 * 1024  # KV frames stay under 4 MiB; this is headroom, not a target

# gRPC servers set SO_REUSEPORT by default: a second server on a taken port then binds too and
# silently splits its traffic (two workers behind one address; a stopped server still
# "answering"). Every pdserve server turns it off, so a taken port is an error.
EXCLUSIVE_PORT = [("grpc.so_reuseport", 0)]


def message_options(max_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Channel or server options that cap both directions' messages at ``max_bytes``."""
    return [
        ("grpc.max_receive_message_length", max_bytes),
        ("grpc.max_send_message_length", max_bytes),
    ]


def bind(server, address: str, tls: TlsFiles | ClusterTls | None = None) -> int:
    """``server.add_insecure_port`` (``add_secure_port`` with a TLS config) that raises OSError
    naming the address when it cannot bind (taken, or not this host's), whichever way this
    gRPC version reports it; returns the bound port."""
    try:
        if tls is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, tls.server_credentials())
    except RuntimeError as e:
        raise OSError(f"cannot bind {address}: {e}") from e
    if bound == 0:
        raise OSError(f"cannot bind {address}")
    return bound


def worker_server(host: str, port: int, token: str | None, max_workers: int = 64, tls=None):
    """A worker's sync gRPC server, bound to ``host:port`` only, with KV-sized message limits
    and the cluster-token check (and mutual TLS with a ClusterTls); returns (server,
    "host:port" actually bound). Without a token it binds loopback only (OpenBindError
    otherwise)."""
    from concurrent import futures

    import grpc

    from grpc_plumbing.auth import require_token_off_loopback, server_interceptors

    require_token_off_loopback(host, token, "worker gRPC API")
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=message_options() + EXCLUSIVE_PORT,
        interceptors=server_interceptors(token),
    )
    return server, f"{host}:{bind(server, f'{host}:{port}', tls)}"
