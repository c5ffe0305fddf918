"""pdserve over namespace hosts: Ray nodes from cluster_configs/ray_cluster.yaml, and
``pdserve serve`` on the head with a config made from cluster_configs/gpu.yaml (the file that
launcher's comment runs), sized for a CPU and a tiny model, with ``host: null``, the API key,
TLS on the client API and mutual TLS in the cluster.

Hosts: ``head`` (Ray head, controller, router), ``prefill`` (the prefill pool), ``decode_a`` and
``decode_b`` (the decode pool, one worker each), ``outsider`` (on the same bridge, in no Ray
cluster, without the token: clients and attacks run there). Only the head's own namespace can
reach Ray, so every driver and ``pdserve`` command runs inside it.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from pdserve.bench.netns.certs import Certs, make_certs
from pdserve.bench.netns.hosts import Hosts
from pdserve.bench.netns.ray_nodes import RayNodes
from pdserve.config import CONFIG_DIR

# host -> the ray_cluster.yaml node type its Ray node is started as
RAY_HOSTS = {
    "head": "head",
    "prefill": "prefill_gpu",
    "decode_a": "decode_gpu",
    "decode_b": "decode_gpu",
}
OUTSIDER = "outsider"
SERVE_CONFIG = CONFIG_DIR / "gpu.yaml"


def serve_config(model: str, kv_transport: str, certs: Certs, launcher: dict, **over) -> dict:
    """gpu.yaml with what a CPU and a tiny model need changed, and the TLS sections added.
    Kept as gpu.yaml has them: ``host: null``, the ports, the pools' custom resources,
    ``kv_private_network``. Each decode worker asks for a whole decode node's ``decode_node``
    units, so the two land on two hosts."""
    data = yaml.safe_load(SERVE_CONFIG.read_text())
    node_res = launcher["available_node_types"]
    pools = data["pools"]
    for role, node_type in (("prefill", "prefill_gpu"), ("decode", "decode_gpu")):
        (res_name,) = pools[role]["resources"]
        whole = node_res[node_type]["resources"][res_name]
        replicas = 1 if role == "prefill" else 2
        pools[role].update(
            replicas=replicas,
            min=1,
            max=replicas,
            num_cpus=0,
            num_gpus=0,
            threads=1,
            resources={res_name: whole},
        )
    data.update(
        model=model,
        device="cpu",
        kv_transport=kv_transport,
        num_blocks=256,
        max_model_len=2048,
        max_num_batched_tokens=2048,
        max_num_seqs=16,
        autoscaler={"enabled": False},
        health_period_s=0.5,
        worker_start_timeout_s=180,
    )
    data["security"] = {
        **data.get("security", {}),
        "tls": {"cert": certs.cert, "key": certs.key},
        "cluster_tls": {"cert": certs.cert, "key": certs.key, "ca": certs.ca},
    }
    data.update(over)
    return data


class NetnsCluster:
    """Hosts, Ray nodes and one ``pdserve serve`` at a time; ``close()`` removes all of it."""

    def __init__(self, workdir: Path, prefix: str | None = None, link_rate: str | None = None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.hosts = Hosts.make([*RAY_HOSTS, OUTSIDER], prefix)
        self.serve: subprocess.Popen | None = None
        self.api_key = "sk-" + secrets.token_hex(16)
        self.grpc_address = ""
        try:
            if link_rate:
                self.hosts.shape("prefill", link_rate)  # the KV's way: prefill -> decode
            self.certs = make_certs(
                self.workdir / "certs", [h.address for h in self.hosts.hosts.values()]
            )
            self.ray = RayNodes(self.hosts, self.workdir)
            self.ray.start(RAY_HOSTS)
            self.ray.wait_nodes(len(RAY_HOSTS))
        except BaseException:
            self.close()
            raise

    def env(self) -> dict[str, str]:
        return {**os.environ, **self.ray.env, "PDSERVE_API_KEY": self.api_key}

    def start_pdserve(self, model: str, kv_transport: str, timeout_s: float = 300, **over) -> str:
        """``pdserve serve`` on the head; returns the router's gRPC address once it is ready."""
        self.stop_pdserve()
        cfg = serve_config(model, kv_transport, self.certs, self.ray.launcher, **over)
        path = self.workdir / f"serve-{kv_transport}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        log = open(self.workdir / f"serve-{kv_transport}.log", "w")  # noqa: SIM115 - the child's
        argv = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "serve",
            "--config",
            str(path),
            "--address",
            self.ray.head_address,
        ]
        self.serve = self.hosts.popen(
            "head", argv, stdout=subprocess.PIPE, stderr=log, text=True, env=self.env()
        )
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(self.serve.stdout), daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout_s
        while "ready\n" not in lines:
            if self.serve.poll() is not None or time.monotonic() > deadline:
                self.stop_pdserve()
                tail = (self.workdir / f"serve-{kv_transport}.log").read_text()[-4000:]
                raise RuntimeError(f"pdserve serve did not get ready: {lines}\n{tail}")
            time.sleep(0.2)
        self.grpc_address = next(x.split()[1] for x in lines if x.startswith("grpc:"))
        return self.grpc_address

    def stop_pdserve(self, timeout_s: float = 90) -> None:
        if self.serve is None:
            return
        if self.serve.poll() is None:
            self.serve.terminate()  # a graceful stop: streams drain, the actors go
            try:
                self.serve.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.serve.kill()
                self.serve.wait(10)
        self.serve = None

    def _client_env(self) -> dict[str, str]:
        """A client's: the API key, neither Ray's token nor the cluster's."""
        secret = ("RAY_AUTH", "PDSERVE_CLUSTER_TOKEN")
        return {k: v for k, v in self.env().items() if not k.startswith(secret)}

    def status(self) -> dict:
        """``pdserve status --json`` run on the head."""
        argv = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "status",
            "--json",
            "--address",
            self.ray.head_address,
        ]
        out = self.hosts.run("head", argv, timeout=120, env=self.env())
        if out.returncode != 0:
            raise RuntimeError(f"pdserve status failed: {out.stderr[-2000:]}")
        return json.loads(out.stdout)

    def probe(self, host: str, *args: str, timeout_s: float = 300, env=None) -> dict:
        """``python -m pdserve.bench.netns.probe ARGS`` inside ``host``; its JSON answer.
        Without ``env``: the API key, and neither Ray's token nor the cluster's."""
        argv = [sys.executable, "-m", "pdserve.bench.netns.probe", *args]
        if env is None:
            env = self._client_env()
        out = self.hosts.run(host, argv, timeout=timeout_s, env=env)
        if out.returncode != 0:
            raise RuntimeError(f"probe {args[:1]} on {host} failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def generate(
        self, prompts: list[list[int]], max_tokens: int, host: str = OUTSIDER, **extra
    ) -> list[dict]:
        """The prompts through the router's gRPC API (API key, TLS) from ``host``."""
        return self.collect(self.start_generate(prompts, max_tokens, host, **extra), 600)

    def start_generate(
        self, prompts: list[list[int]], max_tokens: int, host: str = OUTSIDER, **extra
    ) -> subprocess.Popen:
        """As ``generate``, without waiting: ``collect`` gets the outputs."""
        spec = self.workdir / f"prompts-{time.monotonic_ns()}.json"
        spec.write_text(json.dumps({"prompts": prompts, "max_tokens": max_tokens, **extra}))
        argv = [sys.executable, "-m", "pdserve.bench.netns.probe", "generate"]
        argv += [self.grpc_address, self.certs.ca, str(spec)]
        env = self._client_env()
        return self.hosts.popen(
            host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )

    @staticmethod
    def collect(proc: subprocess.Popen, timeout_s: float) -> list[dict]:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        if proc.returncode != 0:
            raise RuntimeError(f"generate failed:\n{err[-3000:]}")
        return json.loads(out.strip().splitlines()[-1])["outputs"]

    def close(self) -> None:
        try:
            self.stop_pdserve(timeout_s=30)
        finally:
            self.hosts.destroy()
