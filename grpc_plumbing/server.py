"""Binding gRPC servers: exclusive ports, TLS when configured, and message-size options."""

from __future__ import annotations

from grpc_plumbing.tls import ClusterTls, TlsFiles

MAX_MESSAGE_BYTES = 8 * 1024 * 1024  # KV frames stay under 4 MiB; this is headroom, not a target

# gRPC servers set SO_REUSEPORT by default: a second server on a taken port then binds too and
# silently splits its traffic (two workers behind one address; a stopped server still
# "answering"). Every pdserve server turns it off, so a taken port is an error.
EXCLUSIVE_PORT = [("grpc.so_reuseport", 0)]


# Keepalive: a peer that stops answering (frozen, partitioned) without closing its socket is
# found by HTTP/2 pings, and the calls on its connection fail (UNAVAILABLE): the router's
# channels to workers ping every KEEPALIVE_TIME_MS and give up after KEEPALIVE_TIMEOUT_MS
# without an answer; a worker's server pings its callers the same way, so the threads of a
# vanished router's calls come back.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
# The servers let a client ping this often, calls or not (gRPC's default, 5 min, would answer
# the router's pings with GOAWAY too_many_pings); no strikes: a too-eager pinger is not an
# attacker worth cutting off on a cluster-token-guarded port.
MIN_PING_INTERVAL_MS = KEEPALIVE_TIME_MS // 2


def client_keepalive_options() -> list[tuple[str, int]]:
    """Channel options: ping an idle or silent connection, with or without calls on it."""
    return [
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # 0: no limit
    ]


def server_keepalive_options() -> list[tuple[str, int]]:
    """Server options: accept the clients' keepalive pings, and ping the clients too."""
    return [
        ("grpc.keepalive_time_ms", 3 * KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 0),  # 0: no limit
        ("grpc.http2.max_pings_without_data", 0),
    ]


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
        options=message_options() + EXCLUSIVE_PORT + server_keepalive_options(),
        interceptors=server_interceptors(token),
    )
    return server, f"{host}:{bind(server, f'{host}:{port}', tls)}"
