"""The transport registry's names, torch-free: the config, the CLIs and the workers read them.

Picking one by name is ``kv_transfer.sender.make_sender`` / ``start_receiver_server`` (they
import the named module, and torch, when used).
"""

from __future__ import annotations

# name -> the module that implements it (``connect(endpoint, **opts)``, ``serve(...)``)
TRANSPORTS = {
    "local": "kv_transfer.transport_local",
    "grpc": "kv_transfer.transport_grpc",
    "flight": "kv_transfer.transport_flight",
    "torch_dist": "kv_transfer.transport_dist",
    "faults": "kv_transfer.transport_faults",  # tests: wraps another, injects faults
}
# What a worker can be configured with (cluster YAML ``kv_transport``, ``--kv-transport``):
# the transports that cross a socket between processes.
WORKER_TRANSPORTS = ("grpc", "flight", "torch_dist")
# Transports whose servers check the cluster token (their senders and servers take ``token``):
# every one that crosses a socket (torch_dist at its rendezvous), and faults (its inner one's).
TOKEN_TRANSPORTS = frozenset({*WORKER_TRANSPORTS, "faults"})
# Transports that take a grpc_plumbing.tls.ClusterTls (``tls``); torch_dist has no TLS.
TLS_TRANSPORTS = frozenset({"grpc", "flight"})


def add_kv_servicer(server, receiver, token: str | None = None) -> None:
    """Host KvTransfer.PushFrames on a worker's existing grpc server (see transport_grpc)."""
    from kv_transfer.transport_grpc import add_kv_servicer as add  # grpc only when used

    add(server, receiver, token)
