"""A prefill worker process's settings and the one way to start it (``python -m
prefill_worker``, the local harness and the Ray actors, through pdserve.cluster.workers)."""

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


@dataclass(frozen=True)
class PrefillSettings:
    engine: EngineSettings = field(default_factory=EngineSettings)
    server: process.ServerSettings = field(default_factory=process.ServerSettings)
    layerwise_kv: bool = True  # PrefillWorker.layerwise_kv
    core_share: CoreShareSettings | None = None  # a node group's cores, lent by its decode


def start_prefill_worker(s: PrefillSettings, loaded: LoadedModel | None = None):
    """Build the engine (on ``loaded``'s shared weights when given) and serve it."""
    from engine.llm_engine import build_engine  # torch: only when a worker starts
    from prefill_worker.server import serve_prefill_worker
    from prefill_worker.worker import PrefillWorker

    srv = s.server
    tracing = start_tracing(srv.otlp_traces_endpoint, "pdserve-prefill")
    worker = PrefillWorker(
        build_engine(s.engine, shared_weights(s.engine, loaded)), srv.worker_id, s.layerwise_kv
    )
    if s.core_share is not None:
        from engine.core_share import PrefillCores

        worker.cores = PrefillCores(s.core_share)
    server, address, senders = serve_prefill_worker(
        worker,
        srv.host,
        srv.port,
        cluster_token=srv.cluster_token,
        tls=srv.cluster_tls,
        stall_timeout_s=srv.stall_timeout_s,
        tracing=tracing,
    )
    closers = (senders.close,) + ((tracing.shutdown,) if tracing is not None else ())
    return process.RunningWorker(worker, address, server, closers)


def prefill_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m prefill_worker")
    add_engine_args(parser)
    process.add_server_args(parser)
    parser.add_argument(
        "--no-layerwise-kv",
        dest="layerwise_kv",
        action="store_false",
        help="send the KV after the whole forward instead of layer by layer (to measure it)",
    )
    add_core_share_args(parser)
    return parser


def prefill_settings_from_args(args: argparse.Namespace) -> PrefillSettings:
    return PrefillSettings(
        engine_settings_from_args(args),
        process.server_settings_from_args(args),
        getattr(args, "layerwise_kv", True),
        core_share_from_args(args),
    )


def prefill_args(s: PrefillSettings) -> list[str]:
    """The flags ``prefill_parser`` reads back as ``s`` (the cluster token travels in
    $PDSERVE_CLUSTER_TOKEN, never on a command line)."""
    layerwise = [] if s.layerwise_kv else ["--no-layerwise-kv"]
    sharing = core_share_args(s.core_share)
    return [*engine_args(s.engine), *process.server_args(s.server), *layerwise, *sharing]
