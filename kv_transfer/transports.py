"""The transport registry's names, torch-free: the config, the CLIs and the workers read them.

``transport_module`` imports the one named (and what it needs: grpc, pyarrow, torch) when
used; ``kv_transfer.sender.make_sender`` / ``start_receiver_server`` pick one by name with it.
A worker's gRPC server hosts the grpc transport's service with
``kv_transfer.transport_grpc.add_kv_servicer``.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kv_transfer.interfaces import Transport

# name -> the module that implements it (``connect(endpoint, **opts)``, ``serve(...)``)
TRANSPORTS = {
    "local": "kv_transfer.transport_local",
    "grpc": "kv_transfer.transport_grpc",
    "flight": "kv_transfer.transport_flight",
    "torch_dist": "kv_transfer.torch_dist.transport",
    "nixl": "kv_transfer.nixl.transport",  # needs NIXL (pdserve[nixl])
    "shm": "kv_transfer.shm.transport",  # prefill and decode on one node: a shared cache
    "faults": "kv_transfer.transport_faults",  # tests: wraps another, injects faults
}
# What a worker can be configured with (cluster YAML ``kv_transport``, ``--kv-transport``):
# the transports that cross a socket between processes (shm: its control connection; its KV
# goes through shared memory, so both workers must run on one node).
WORKER_TRANSPORTS = ("grpc", "flight", "torch_dist", "nixl", "shm")
# Transports whose servers check the cluster token (their senders and servers take ``token``):
# every one that crosses a socket (torch_dist at its rendezvous), and faults (its inner one's).
TOKEN_TRANSPORTS = frozenset({*WORKER_TRANSPORTS, "faults"})
# Transports that take a grpc_plumbing.tls.ClusterTls (``tls``); torch_dist, nixl and shm
# have none.
TLS_TRANSPORTS = frozenset({"grpc", "flight"})


# Transports that need an optional package: name -> (its import names, any one will do; the
# pdserve extra that installs it).
OPTIONAL = {"nixl": (("nixl_cu12", "nixl_cu13", "nixl"), "nixl")}


def transport_missing(name: str) -> str | None:
    """Why transport ``name`` cannot run here (its optional package is not installed), or
    None. Looks for the package without importing it (NIXL imports torch)."""
    if name not in OPTIONAL:
        return None
    modules, extra = OPTIONAL[name]
    if any(importlib.util.find_spec(m) is not None for m in modules):
        return None
    return (
        f"kv_transport {name!r} needs {extra}: pip install 'pdserve[{extra}]' "
        "(wheels for Linux x86_64 and aarch64)"
    )


def transport_module(name: str) -> Transport:
    """The module that implements transport ``name`` (``connect``, ``serve``), imported now."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}; known: {', '.join(sorted(TRANSPORTS))}")
    return importlib.import_module(TRANSPORTS[name])
