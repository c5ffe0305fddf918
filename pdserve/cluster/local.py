"""A whole cluster without Ray: workers in this process (threads) or in child processes, and
the router on an asyncio loop in a background thread. Tests, the demo and benchmarks use it."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from engine.model_files import resolve_model_dir

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class ClusterSpec:
    model: str = "embedded"
    num_prefill: int = 1
    num_decode: int = 1
    kv_transport: str = "grpc"
    block_size: int = 16
    num_blocks: int = 2048
    decode_num_blocks: int | None = None  # default: num_blocks
    max_model_len: int = 2048
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    prefill_chunk_size: int = 0
    threads_per_worker: int = 0
    device: str = "cpu"  # where workers run the model: cpu, cuda[:N], auto
    lease_ttl_s: float = 30.0
    local_prefill_max_tokens: int = 0  # prompts up to this are prefilled on the decode worker
    concurrent_reserve_headroom: float = 0.1  # router.flow.FlowConfig; < 0: reserve first
    prefill_policy: str = "least_queued"
    decode_policy: str = "most_free_blocks"
    separate_processes: bool = False
    host: str = "127.0.0.1"
    router_port: int = 0
    http_port: int | None = None  # None: no HTTP server
    api_key: str | None = None  # clients must send it (HTTP Bearer / gRPC metadata) when set
    cluster_token: str | None = None  # router and workers authenticate each other with it
    # Security (see docs/SECURITY.md): TLS on the client API (grpc_plumbing.tls.TlsFiles), mutual
    # TLS between router and in-process workers (grpc_plumbing.tls.ClusterTls), request limits
    # (router.limits.RequestLimits), and the router's exposure switches.
    api_tls: object | None = None
    cluster_tls: object | None = None
    limits: object | None = None
    allow_unauthenticated: bool = False
    open_metrics: bool = False
    extra_env: dict = field(default_factory=dict)


class LocalCluster:
    def __init__(self, spec: ClusterSpec):
        from grpc_plumbing.auth import is_loopback

        if not spec.cluster_token and not is_loopback(spec.host):
            # Off loopback the workers refuse to serve without one: make one for this cluster.
            spec = dataclasses.replace(spec, cluster_token=secrets.token_urlsafe(32))
        self.spec = spec
        self.model_dir = resolve_model_dir(spec.model, progress=True)
        self.prefill_workers = []  # in-process worker objects
        self.decode_workers = []
        self._servers = []  # (grpc server, extra closer)
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
        for server, closer in self._servers:
            server.stop(grace=None)
            if closer is not None:
                closer()
        for worker in self.prefill_workers + self.decode_workers:
            worker.stop()
        for proc in self._procs:
            proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def run(self, coro, timeout: float | None = None):
        """Run a coroutine on the router's loop from this thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # ---- workers -----------------------------------------------------------------------
    def _num_blocks(self, role: str) -> int:
        s = self.spec
        return (s.decode_num_blocks or s.num_blocks) if role == "decode" else s.num_blocks

    def _engine_kwargs(self, role: str):
        from engine.config import CacheConfig, SchedulerConfig

        s = self.spec
        return dict(
            cache=CacheConfig(block_size=s.block_size, num_blocks=self._num_blocks(role)),
            scheduler=SchedulerConfig(
                s.max_num_batched_tokens, s.max_num_seqs, s.prefill_chunk_size
            ),
            max_model_len=s.max_model_len,
        )

    def _start_in_process(self) -> None:
        from decode_worker.server import serve_decode_worker
        from decode_worker.worker import DecodeWorker
        from engine.llm_engine import LLMEngine
        from engine.loader import load_config, load_model
        from engine.tokenizer import Tokenizer
        from prefill_worker.server import serve_prefill_worker
        from prefill_worker.worker import PrefillWorker

        s = self.spec
        cfg = load_config(self.model_dir)
        # Weights are read-only during inference: in-process workers share one copy.
        model = load_model(self.model_dir, cfg, s.max_model_len, s.device)
        tok = Tokenizer(self.model_dir) if (self.model_dir / "tokenizer.json").is_file() else None

        def engine(role: str):
            from engine.config import EngineConfig

            kw = self._engine_kwargs(role)
            return LLMEngine(
                EngineConfig(cfg, kw["cache"], kw["scheduler"], s.max_model_len), model, tok
            )

        for i in range(s.num_prefill):
            worker = PrefillWorker(engine("prefill"), f"prefill-{i}")
            server, address, senders = serve_prefill_worker(
                worker, s.host, cluster_token=s.cluster_token, tls=s.cluster_tls
            )
            self.prefill_workers.append(worker)
            self.prefill_addresses.append(address)
            self._servers.append((server, senders.close))
        for i in range(s.num_decode):
            worker = DecodeWorker(engine("decode"), f"decode-{i}", s.lease_ttl_s)
            server, address, kv_server = serve_decode_worker(
                worker,
                s.host,
                kv_transport=s.kv_transport,
                cluster_token=s.cluster_token,
                tls=s.cluster_tls,
            )
            self.decode_workers.append(worker)
            self.decode_addresses.append(address)
            self._servers.append((server, kv_server.stop if kv_server else None))

    def _worker_cmd(self, module: str) -> list[str]:
        s = self.spec
        role = module.split("_")[0]
        cmd = [
            sys.executable,
            "-m",
            module,
            "--model",
            str(self.model_dir),
            "--host",
            s.host,
            "--block-size",
            str(s.block_size),
            "--num-blocks",
            str(self._num_blocks(role)),
            "--max-model-len",
            str(s.max_model_len),
            "--max-num-batched-tokens",
            str(s.max_num_batched_tokens),
            "--max-num-seqs",
            str(s.max_num_seqs),
            "--prefill-chunk-size",
            str(s.prefill_chunk_size),
            "--threads",
            str(s.threads_per_worker),
            "--device",
            s.device,
        ]
        if module == "decode_worker":
            cmd += ["--kv-transport", s.kv_transport, "--lease-ttl", str(s.lease_ttl_s)]
        tls = s.cluster_tls
        if tls is not None:
            cmd += ["--cluster-tls-cert", tls.cert, "--cluster-tls-key", tls.key]
            cmd += ["--cluster-tls-ca", tls.ca]
            if tls.server_name:
                cmd += ["--cluster-tls-server-name", tls.server_name]
        return cmd

    def _start_processes(self) -> None:
        # The repo first, then whatever the caller's PYTHONPATH already held (packages
        # installed with --target, say).
        path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path, **self.spec.extra_env}
        if self.spec.cluster_token:
            env["PDSERVE_CLUSTER_TOKEN"] = self.spec.cluster_token
        specs = [("prefill_worker", self.prefill_addresses)] * self.spec.num_prefill
        specs += [("decode_worker", self.decode_addresses)] * self.spec.num_decode
        started = []
        for module, addresses in specs:
            proc = subprocess.Popen(
                self._worker_cmd(module), stdout=subprocess.PIPE, env=env, text=True
            )
            self._procs.append(proc)
            started.append((proc, addresses))
        for proc, addresses in started:
            addresses.append(wait_ready(proc)[0])

    # ---- router ------------------------------------------------------------------------
    async def _start_router(self) -> None:
        from router.app import start_router
        from router.core import RouterConfig
        from router.security import ApiSecurity

        s = self.spec
        cfg = RouterConfig(
            model_dir=str(self.model_dir),
            max_model_len=s.max_model_len,
            block_size=s.block_size,
            prefill_policy=s.prefill_policy,
            decode_policy=s.decode_policy,
            local_prefill_max_tokens=s.local_prefill_max_tokens,
            concurrent_reserve_headroom=s.concurrent_reserve_headroom,
            cluster_tls=s.cluster_tls,
            **({"limits": s.limits} if s.limits is not None else {}),
        )
        security = ApiSecurity(s.api_tls, s.allow_unauthenticated, s.open_metrics)
        self.servers = await start_router(
            cfg,
            self.prefill_addresses,
            self.decode_addresses,
            s.host,
            s.router_port,
            s.http_port,
            s.api_key,
            s.cluster_token,
            security,
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
