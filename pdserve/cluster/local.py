"""A whole cluster without Ray: workers in this process (threads) or in child processes, and
the router on an asyncio loop in a background thread. Tests, the demo and benchmarks use it.

It runs the same ``ClusterConfig`` a Ray cluster does, and derives every process's settings the
same way (``pdserve.settings.settings_from_config``); ``ClusterSpec`` adds what only this
harness decides.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from typing_extensions import Self

from engine.model_files import resolve_model_dir
from grpc_plumbing.auth import TOKEN_ENV
from grpc_plumbing.worker_process import STOP_WITH_PARENT_ENV, RunningWorker
from kv_transfer.transports import TRANSPORTS, WORKER_TRANSPORTS
from pdserve.cluster.workers import build_worker, worker_args
from pdserve.config import ClusterConfig, ConfigError, validate_config, with_cluster_token
from pdserve.security_config import cluster_tls
from pdserve.settings import ClusterSettings, settings_from_config
from pdserve.share_cores import group_ledgers, with_core_share, with_share_name

REPO_ROOT = Path(__file__).resolve().parents[2]

# Where the config's defaults are for a deployment, the harness picks loopback, free ports, no
# HTTP server unless asked, the CPU, and torch's own thread count.
LOCAL_DEFAULTS = {
    "host": "127.0.0.1",
    "grpc_port": 0,
    "http_port": None,
    "device": "cpu",
    "pools": {"prefill": {"threads": 0}, "decode": {"threads": 0}},
    # Worker processes drain on SIGTERM; the harness stops its router first, so a worker still
    # busy then holds only leftovers (a lease nobody attaches): 5 s, within stop()'s wait.
    "drain_grace_s": 5.0,
}
TEST_TRANSPORTS = tuple(t for t in TRANSPORTS if t not in WORKER_TRANSPORTS)
# The harness's short names for config fields that sit deeper in ClusterConfig.
SHORT_NAMES = {
    "router_port": ("grpc_port",),
    "prefill_policy": ("router", "prefill_policy"),
    "decode_policy": ("router", "decode_policy"),
    "local_prefill_max_tokens": ("router", "local_prefill_max_tokens"),
    "kv_local_tail_tokens": ("router", "kv_local_tail_tokens"),
    "concurrent_reserve_headroom": ("router", "concurrent_reserve_headroom"),
    "allow_unauthenticated": ("security", "allow_unauthenticated"),
    "open_metrics": ("security", "open_metrics"),
    "api_tls": ("security", "tls"),  # a grpc_plumbing.tls.TlsFiles
    "cluster_tls": ("security", "cluster_tls"),  # a grpc_plumbing.tls.ClusterTls
    "threads_per_worker": (("pools", "prefill", "threads"), ("pools", "decode", "threads")),
}


@dataclass(frozen=True, init=False)
class ClusterSpec:
    """A local cluster: the ``ClusterConfig`` it runs, plus what only this harness decides."""

    config: ClusterConfig
    num_prefill: int  # 0: decode workers prefill every prompt themselves
    num_decode: int
    decode_num_blocks: int | None  # the decode pool's own KV size (default: config.num_blocks)
    separate_processes: bool  # workers as child processes (else threads of this process)
    extra_env: dict  # added to the child processes' environment
    # A test-only transport the config cannot name (local: one process; faults: a wrapper).
    test_transport: str | None

    def __init__(
        self,
        config: ClusterConfig | None = None,
        *,
        num_prefill: int = 1,
        num_decode: int = 1,
        decode_num_blocks: int | None = None,
        separate_processes: bool = False,
        extra_env: dict | None = None,
        **fields,
    ):
        """``fields``: ClusterConfig fields over ``config`` (default: the config's defaults with
        LOCAL_DEFAULTS), top-level names as the config spells them, deeper ones by their
        SHORT_NAMES; ``limits`` a router.limits.RequestLimits. An unknown name is an error."""
        transport = fields.get("kv_transport")
        test_transport = transport if transport in TEST_TRANSPORTS else None
        if test_transport:
            del fields["kv_transport"]
        base = config.model_dump() if config is not None else _merged(LOCAL_DEFAULTS, {})
        cfg = validate_config(_merged(base, _config_fields(fields)), "ClusterSpec")
        set_ = object.__setattr__
        set_(self, "config", cfg)
        set_(self, "num_prefill", num_prefill)
        set_(self, "num_decode", num_decode)
        set_(self, "decode_num_blocks", decode_num_blocks)
        set_(self, "separate_processes", separate_processes)
        set_(self, "extra_env", dict(extra_env or {}))
        set_(self, "test_transport", test_transport)

    def with_config(self, config: ClusterConfig) -> ClusterSpec:
        out = copy.copy(self)  # not dataclasses.replace: __init__ takes config fields by name
        object.__setattr__(out, "config", config)
        return out

    def settings(self, model_dir: str) -> ClusterSettings:
        """Every process's settings: the config's, with the harness's own decode KV size and
        test transport."""
        s = settings_from_config(self.config, self.config.host, model_dir)
        decode = s.decode
        if self.decode_num_blocks is not None:
            engine = dataclasses.replace(decode.engine, num_blocks=self.decode_num_blocks)
            decode = dataclasses.replace(decode, engine=engine)
        if self.test_transport is not None:
            decode = dataclasses.replace(decode, kv_transport=self.test_transport)
        return dataclasses.replace(s, decode=decode)

    # The fields tests and callers read most, as the config holds them.
    model = property(lambda self: self.config.model)
    host = property(lambda self: self.config.host)
    api_key = property(lambda self: self.config.api_key)
    cluster_token = property(lambda self: self.config.cluster_token)
    cluster_tls = property(lambda self: cluster_tls(self.config))


def _config_fields(fields: dict) -> dict:
    out: dict = {}
    for name, value in fields.items():
        if dataclasses.is_dataclass(value):  # TlsFiles, ClusterTls, RequestLimits
            value = dataclasses.asdict(value)
        paths = SHORT_NAMES.get(name, (name,))
        for path in paths if isinstance(paths[0], tuple) else (paths,):
            out = _merged(out, _nested(path, value))
    return out


def _nested(path: tuple, value) -> dict:
    for key in reversed(path):
        value = {key: value}
    return value


def _merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        both_dicts = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both_dicts else value
    return out


class LocalCluster:
    def __init__(self, spec: ClusterSpec):
        from grpc_plumbing.auth import is_loopback

        if not spec.cluster_token and not is_loopback(spec.host):
            # Off loopback the workers refuse to serve without one: make one for this cluster.
            spec = spec.with_config(with_cluster_token(spec.config))
        spec = spec.with_config(with_share_name(spec.config))  # one ledger name per cluster
        if spec.config.share_cores.enabled and spec.num_prefill != spec.num_decode:
            raise ConfigError(
                "share_cores pairs prefill worker i with decode worker i: "
                f"num_prefill ({spec.num_prefill}) must equal num_decode ({spec.num_decode})"
            )
        self.spec = spec
        self.model_dir = resolve_model_dir(spec.model, progress=True)
        self.settings = spec.settings(str(self.model_dir))
        self.running: list[RunningWorker] = []  # in-process workers, prefill first
        self._procs: list[subprocess.Popen] = []
        self.prefill_addresses: list[str] = []
        self.decode_addresses: list[str] = []
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self.loop.run_forever, name="router-loop", daemon=True
        )
        self.router = None
        self.address = ""
        self.http_address = ""

    @property
    def prefill_workers(self) -> list:
        return [r.worker for r in self.running[: self._in_process_prefill]]

    @property
    def decode_workers(self) -> list:
        return [r.worker for r in self.running[self._in_process_prefill :]]

    @property
    def _in_process_prefill(self) -> int:
        return 0 if self.spec.separate_processes else self.spec.num_prefill

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> LocalCluster:
        if self.spec.separate_processes:
            self._start_processes()
        else:
            self._start_in_process()
        self._loop_thread.start()
        self.run(self._start_router())
        return self

    def stop(self) -> None:
        if self.router is not None:
            self.run(self._stop_router())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(5)
        for running in self.running:
            running.stop(grace=None)
        for proc in self._procs:
            proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for path in group_ledgers(self.spec.config, self.spec.num_decode):
            Path(path).unlink(missing_ok=True)  # a decode worker that stopped removed its own

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def run(self, coro, timeout: float | None = None):
        """Run a coroutine on the router's loop from this thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # ---- workers -----------------------------------------------------------------------
    def _roles(self) -> list[str]:
        return ["prefill"] * self.spec.num_prefill + ["decode"] * self.spec.num_decode

    def _members(self) -> list[tuple[str, int]]:
        """Each worker's role and index in its pool (node group i: the two workers i)."""
        spec = self.spec
        return [("prefill", i) for i in range(spec.num_prefill)] + [
            ("decode", i) for i in range(spec.num_decode)
        ]

    def _worker_settings(self, role: str, index: int):
        return with_core_share(self.settings.worker(role), self.spec.config, index)

    def _start_in_process(self) -> None:
        from engine.settings import load_model_once

        # Weights are read-only during inference: in-process workers share one copy. They
        # share this process's torch threads too (a worker's own count is a process's); a
        # tensor-parallel worker's ranks load their own shards (engine.settings.shared_weights).
        loaded = load_model_once(self.settings.prefill.engine)
        for role, index in self._members():
            s = self._worker_settings(role, index)
            engine = dataclasses.replace(s.engine, threads=0)
            server = dataclasses.replace(s.server, worker_id=f"{role}-{index}")
            s = dataclasses.replace(s, engine=engine, server=server)
            running = build_worker(role, s, loaded)
            self.running.append(running)
            self._addresses(role).append(running.address)

    def _addresses(self, role: str) -> list[str]:
        return self.prefill_addresses if role == "prefill" else self.decode_addresses

    def _start_processes(self) -> None:
        # The repo first, then whatever the caller's PYTHONPATH already held (packages
        # installed with --target, say).
        path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path, **self.spec.extra_env}
        env[STOP_WITH_PARENT_ENV] = "1"
        if self.spec.cluster_token:
            env[TOKEN_ENV] = self.spec.cluster_token
        started = []
        for role, index in self._members():
            cmd = [sys.executable, "-m", f"{role}_worker"]
            cmd += worker_args(role, self._worker_settings(role, index))
            # stdin stays open while this process lives: a worker stops at its EOF.
            proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
            )
            self._procs.append(proc)
            started.append((proc, self._addresses(role)))
        for proc, addresses in started:
            addresses.append(wait_ready(proc)[0])

    # ---- router ------------------------------------------------------------------------
    async def _start_router(self) -> None:
        from router.app import start_router

        s = self.settings
        self.servers = await start_router(
            s.router,
            self.prefill_addresses,
            self.decode_addresses,
            s.host,
            s.grpc_port,
            s.http_port,
            security=s.api_security,
        )
        self.router = self.servers.router
        self.address = self.servers.grpc_address
        self.http_address = self.servers.http_address

    async def _stop_router(self) -> None:
        await self.servers.stop()


def wait_ready(proc: subprocess.Popen) -> list[str]:
    """The words after ``READY`` on a child's stdout (its addresses), once it prints them."""
    for line in proc.stdout:
        if line.startswith("READY "):
            # Keep draining stdout so the child never blocks on a full pipe.
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return line.split()[1:]
    raise RuntimeError(f"process {proc.args} exited with {proc.wait()} before READY")
