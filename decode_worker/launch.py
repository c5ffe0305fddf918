"""A decode worker process's settings and the one way to start it (``python -m
decode_worker``, the local harness and the Ray actors, through pdserve.cluster.workers)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from engine.args import add_engine_args, engine_args, engine_settings_from_args
from engine.core_share import (
    CoreShareSettings,
    add_core_share_args,
    core_share_args,
    core_share_from_args,
)
from engine.settings import EngineSettings, LoadedModel, shared_weights
from grpc_plumbing import worker_process as process
from grpc_plumbing.tracing import start_tracing
from kv_transfer.lease import DEFAULT_LEASE_TTL_S
from kv_transfer.transports import WORKER_TRANSPORTS


@dataclass(frozen=True)
class DecodeSettings:
    engine: EngineSettings = field(default_factory=EngineSettings)
    server: process.ServerSettings = field(default_factory=process.ServerSettings)
    kv_transport: str = "grpc"  # WORKER_TRANSPORTS; in tests also local or faults
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S  # kv_transfer.lease
    max_lease_s: float | None = None  # cap on a requested lease; None: the lease table's own
    # torch_dist's data path is not authenticated: off loopback only on a private network.
    kv_private_network: bool = False
    core_share: CoreShareSettings | None = None  # a node group's cores, lent to its prefill


def start_decode_worker(s: DecodeSettings, loaded: LoadedModel | None = None):
    """Build the engine (on ``loaded``'s shared weights when given) and serve it."""
    from decode_worker.server import serve_decode_worker
    from decode_worker.worker import DecodeWorker
    from engine.llm_engine import build_engine  # torch: only when a worker starts

    if s.engine.tensor_parallel_size > 1 and s.kv_transport in ("nixl", "shm"):
        raise ValueError(
            f"kv_transport {s.kv_transport} writes into rank 0's cache only: a tensor-parallel "
            "decode worker takes grpc, flight or torch_dist"
        )
    srv = s.server
    tracing = start_tracing(srv.otlp_traces_endpoint, "pdserve-decode")
    worker = DecodeWorker(
        build_engine(s.engine, shared_weights(s.engine, loaded)), srv.worker_id, s.lease_ttl_s
    )
    if s.max_lease_s is not None:
        worker.leases.max_ttl_s = s.max_lease_s
    if s.core_share is not None:
        from engine.core_share import DecodeCores

        worker.cores = DecodeCores(s.core_share)
    server, address, kv_server = serve_decode_worker(
        worker,
        srv.host,
        srv.port,
        s.kv_transport,
        cluster_token=srv.cluster_token,
        kv_private_network=s.kv_private_network,
        tls=srv.cluster_tls,
        stall_timeout_s=srv.stall_timeout_s,
        tracing=tracing,
    )
    closers = ((kv_server.stop,) if kv_server else ()) + (
        (tracing.shutdown,) if tracing is not None else ()
    )
    return process.RunningWorker(worker, address, server, closers)


def decode_parser() -> argparse.ArgumentParser:
    d = DecodeSettings()
    parser = argparse.ArgumentParser(prog="python -m decode_worker")
    add_engine_args(parser)
    process.add_server_args(parser)
    add = parser.add_argument
    # faults: the test-only fault-injecting wrapper (tests/test_chaos.py), never in a config
    add("--kv-transport", default=d.kv_transport, choices=(*WORKER_TRANSPORTS, "faults"))
    add("--lease-ttl", type=float, default=d.lease_ttl_s)
    add("--max-lease-seconds", type=float, default=d.max_lease_s)
    add(
        "--kv-private-network",
        action="store_true",
        help="let torch_dist KV listen off loopback (its data path is not authenticated: only "
        "on a network no one but the cluster reaches); the cluster token comes from "
        "$PDSERVE_CLUSTER_TOKEN",
    )
    add_core_share_args(parser)
    return parser


def decode_settings_from_args(args: argparse.Namespace) -> DecodeSettings:
    return DecodeSettings(
        engine=engine_settings_from_args(args),
        server=process.server_settings_from_args(args),
        kv_transport=args.kv_transport,
        lease_ttl_s=args.lease_ttl,
        max_lease_s=args.max_lease_seconds,
        kv_private_network=args.kv_private_network,
        core_share=core_share_from_args(args),
    )


def decode_args(s: DecodeSettings) -> list[str]:
    """The flags ``decode_parser`` reads back as ``s`` (the cluster token travels in
    $PDSERVE_CLUSTER_TOKEN, never on a command line)."""
    out = [*engine_args(s.engine), *process.server_args(s.server)]
    out += ["--kv-transport", s.kv_transport, "--lease-ttl", str(s.lease_ttl_s)]
    if s.max_lease_s is not None:
        out += ["--max-lease-seconds", str(s.max_lease_s)]
    out += ["--kv-private-network"] if s.kv_private_network else []
    return out + core_share_args(s.core_share)
