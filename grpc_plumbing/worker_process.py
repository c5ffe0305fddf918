"""What every worker process shares, whatever its role: where its gRPC server listens and how
peers authenticate (``ServerSettings``, with its command-line flags), the running worker's
handle (``RunningWorker``), and serving until a signal. Torch-free; the roles' own settings
and start functions are ``prefill_worker.launch`` and ``decode_worker.launch``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from grpc_plumbing.health import DEFAULT_STALL_TIMEOUT_S
from grpc_plumbing.tls import ClusterTls, add_cluster_tls_args, cluster_tls_from_args
from grpc_plumbing.tracing import add_tracing_arg

log = logging.getLogger("pdserve.worker")

DEFAULT_DRAIN_GRACE_S = 30.0


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"  # the address the worker's gRPC server binds
    port: int = 0  # 0: a free port
    # Every caller must send it; None: $PDSERVE_CLUSTER_TOKEN, and without either the worker
    # serves loopback only. Never on a command line (server_args leaves it out).
    cluster_token: str | None = None
    cluster_tls: ClusterTls | None = None  # mutual TLS on the worker API and on KV
    worker_id: str | None = None  # what it reports in Status and logs; None: it makes one
    # The watchdog: an engine step running longer than this turns health NOT_SERVING and
    # Status UNAVAILABLE (grpc_plumbing/health.py); the router then routes around the worker.
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    # On SIGTERM: no new work (health NOT_SERVING, a decode worker refuses reservations), and
    # running requests, leases and KV transfers get this long to end before the server stops.
    drain_grace_s: float = DEFAULT_DRAIN_GRACE_S
    # OpenTelemetry: where the worker exports its spans (grpc_plumbing/tracing.py); None: off.
    otlp_traces_endpoint: str | None = None


def add_server_args(parser: argparse.ArgumentParser) -> None:
    d = ServerSettings()
    parser.add_argument("--host", default=d.host)
    parser.add_argument("--port", type=int, default=d.port)
    parser.add_argument("--worker-id", default=d.worker_id)
    parser.add_argument("--stall-timeout-s", type=float, default=d.stall_timeout_s)
    parser.add_argument("--drain-grace-s", type=float, default=d.drain_grace_s)
    add_cluster_tls_args(parser)
    add_tracing_arg(parser)


def server_settings_from_args(args: argparse.Namespace) -> ServerSettings:
    tls = cluster_tls_from_args(args)
    return ServerSettings(
        args.host,
        args.port,
        None,
        tls,
        args.worker_id,
        args.stall_timeout_s,
        args.drain_grace_s,
        args.otlp_traces_endpoint,
    )


def server_args(s: ServerSettings) -> list[str]:
    """The flags ``server_settings_from_args`` reads back as ``s``, less the cluster token."""
    out = ["--host", s.host, "--port", str(s.port), "--stall-timeout-s", str(s.stall_timeout_s)]
    out += ["--drain-grace-s", str(s.drain_grace_s)]
    if s.worker_id is not None:
        out += ["--worker-id", s.worker_id]
    if s.otlp_traces_endpoint:
        out += ["--otlp-traces-endpoint", s.otlp_traces_endpoint]
    tls = s.cluster_tls
    if tls is not None:
        out += ["--cluster-tls-cert", tls.cert, "--cluster-tls-key", tls.key]
        out += ["--cluster-tls-ca", tls.ca]
        if tls.server_name:
            out += ["--cluster-tls-server-name", tls.server_name]
    return out


@dataclass
class RunningWorker:
    """A worker with its gRPC server up; ``stop`` closes the server, then its KV side, then
    the worker's engine thread."""

    worker: object  # PrefillWorker | DecodeWorker
    address: str  # the worker's gRPC address
    server: object  # grpc.Server
    closers: tuple[Callable[[], None], ...] = ()  # the KV sender pool or receiver server

    def drain(self, grace_s: float) -> bool:
        """Take no new work (health NOT_SERVING: routing and probes go elsewhere; a decode
        worker refuses reservations) and wait up to ``grace_s`` for its running requests,
        leases and KV transfers to end. True once idle; False at the deadline."""
        self.worker.draining = True
        deadline = time.monotonic() + grace_s
        while _busy(self.worker.status()):
            if time.monotonic() >= deadline:
                log.warning("worker %s: drain grace over, stopping busy", self.worker.worker_id)
                return False
            time.sleep(0.1)
        return True

    def stop(self, grace: float | None = 2.0) -> None:
        self.server.stop(grace).wait((grace or 0.0) + 5.0)
        for close in self.closers:
            try:
                close()
            except Exception:  # stopping anyway: the worker must still stop
                log.exception("closing a part of worker %s", self.worker.worker_id)
        self.worker.stop()


def _busy(st: dict) -> bool:
    keys = ("num_running", "num_waiting", "num_leases", "num_transfers")
    return any(st.get(k, 0) for k in keys)


# Set by a parent that holds this process's stdin open for as long as it lives (LocalCluster):
# the worker stops, draining as on SIGTERM, once it reads EOF there, so a parent killed with
# SIGKILL (or any exit that skips its cleanup) leaves no orphaned worker holding a port.
STOP_WITH_PARENT_ENV = "PDSERVE_STOP_WITH_PARENT"


def _stop_at_stdin_eof(done: threading.Event) -> None:
    # The raw descriptor, not sys.stdin: a daemon thread blocked inside a buffered reader's
    # lock aborts the interpreter's shutdown ("could not acquire lock ... at shutdown").
    fd = sys.stdin.fileno()
    while os.read(fd, 4096):  # the parent writes nothing: this returns b"" at EOF
        pass
    log.warning("the parent process is gone (stdin closed): stopping")
    done.set()


def serve_until_signalled(
    start: Callable[[], RunningWorker], drain_grace_s: float = DEFAULT_DRAIN_GRACE_S
) -> None:
    """A worker process's life: start, print ``READY <address>``, serve until SIGTERM/SIGINT,
    then drain (up to ``drain_grace_s``) and stop."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    running = start()
    print(f"READY {running.address}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    if os.environ.get(STOP_WITH_PARENT_ENV) == "1":
        threading.Thread(target=_stop_at_stdin_eof, args=(done,), daemon=True).start()
    while not done.wait(1.0):  # bounded: the signal handlers run between waits
        pass
    running.drain(drain_grace_s)
    running.stop()
