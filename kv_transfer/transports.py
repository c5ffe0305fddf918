"""The transport registry as workers use it: pick a transport by name, or host gRPC KV."""

from __future__ import annotations

from kv_transfer.sender import TOKEN_TRANSPORTS, TRANSPORTS, make_sender, start_receiver_server


def add_kv_servicer(server, receiver, token: str | None = None) -> None:
    """Host KvTransfer.PushFrames on a worker's existing grpc server (see transport_grpc)."""
    from kv_transfer.transport_grpc import add_kv_servicer as add  # grpc only when used

    add(server, receiver, token)


__all__ = [
    "TOKEN_TRANSPORTS",
    "TRANSPORTS",
    "add_kv_servicer",
    "make_sender",
    "start_receiver_server",
]
