"""Ray nodes in the namespaces, started the way cluster_configs/ray_cluster.yaml starts them.

The launcher file's own commands are read and run: ``head_start_ray_commands`` on the head and
``worker_start_ray_commands`` on the others, with ``$RAY_HEAD_IP`` filled in, Ray's token
authentication (``RAY_AUTH_MODE=token``) as the file sets it, and the custom resources of the
file's node types (``prefill_node``, ``decode_node``). What only an autoscaling cloud cluster
needs is left out (``--autoscaling-config``, ``ray stop``, which would stop every Ray on this
machine); what a small shared machine needs is added: each node's own address
(``--node-ip-address``), a CPU count, a small object store and a temp folder of its own.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import sys
import time
from pathlib import Path

import yaml

from pdserve.bench.netns.hosts import UCX_ENV, Hosts
from pdserve.config import CONFIG_DIR

RAY_CLUSTER_FILE = CONFIG_DIR / "ray_cluster.yaml"
OBJECT_STORE_BYTES = 80 * 2**20  # control calls only: KV never goes through Ray
DROPPED_FLAGS = ("--autoscaling-config",)


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


def launcher_command(launcher: dict, key: str) -> tuple[dict[str, str], list[str]]:
    """The ``ray start`` line of the launcher file's ``key`` commands: (its env vars, its args
    after ``ray start``) with the dropped flags removed."""
    for line in launcher[key]:
        words = shlex.split(line)
        env = {}
        while words and "=" in words[0] and not words[0].startswith("-"):
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        if words[:2] == ["ray", "start"]:
            args = [w for w in words[2:] if not w.startswith(DROPPED_FLAGS)]
            return env, args
    raise ValueError(f"{key}: no `ray start` command in {RAY_CLUSTER_FILE}")


def node_type_resources(launcher: dict, node_type: str) -> dict[str, float]:
    """A node type's custom resources (CPU and GPU are this machine's to decide)."""
    res = launcher["available_node_types"][node_type].get("resources", {})
    return {k: v for k, v in res.items() if k not in ("CPU", "GPU")}


class RayNodes:
    """A Ray head and workers in ``hosts``; ``env``: what every Ray client needs (the token)."""

    def __init__(self, hosts: Hosts, workdir: Path, launcher_file: Path = RAY_CLUSTER_FILE):
        self.hosts, self.workdir = hosts, Path(workdir)
        self.launcher = yaml.safe_load(Path(launcher_file).read_text())
        token_file = self.workdir / "ray_auth_token"
        token_file.write_text(secrets.token_hex(32))
        token_file.chmod(0o600)
        head_env, _ = launcher_command(self.launcher, "head_start_ray_commands")
        # The file's RAY_AUTH_MODE (token), the token from this run's file, not ~/.ray's.
        self.env = {**head_env, "RAY_AUTH_TOKEN_PATH": str(token_file)}
        self.env.update(
            RAY_USAGE_STATS_ENABLED="0",
            # A node cut off for this long is declared dead (the partition test): Ray's default
            # is 5 missed checks of 3 s.
            RAY_health_check_period_ms="1000",
            RAY_health_check_failure_threshold="5",
            **UCX_ENV,
        )
        self.head_address = ""
        # Short: Ray's socket paths under it must stay within AF_UNIX's 107 bytes.
        self.temp_dir = Path("/tmp") / hosts.prefix

    def _start(self, host: str, key: str, resources: dict, head_ip: str, cpus: int) -> None:
        _, args = launcher_command(self.launcher, key)
        args = [a.replace("$RAY_HEAD_IP", head_ip) for a in args]
        ip = self.hosts[host].address
        args += [
            f"--node-ip-address={ip}",
            f"--num-cpus={cpus}",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            f"--resources={json.dumps(resources)}",
        ]
        if key == "head_start_ray_commands":
            args.append(f"--temp-dir={self.temp_dir}")
        env = {**os.environ, **self.env}
        out = self.hosts.run(host, [_ray_bin(), "start", *args], timeout=180, env=env)
        if out.returncode != 0:
            raise RuntimeError(
                f"ray start on {host} failed:\n{out.stdout[-2000:]}{out.stderr[-3000:]}"
            )

    def start(self, roles: dict[str, str], cpus: int = 2) -> str:
        """``roles``: host name -> the launcher file's node type (the head type once, first).
        Returns the GCS address."""
        head_type = self.launcher["head_node_type"]
        head = next(h for h, t in roles.items() if t == head_type)
        head_ip = self.hosts[head].address
        self._start(
            head,
            "head_start_ray_commands",
            node_type_resources(self.launcher, head_type),
            head_ip,
            cpus,
        )
        port = _flag(launcher_command(self.launcher, "head_start_ray_commands")[1], "--port")
        self.head_address = f"{head_ip}:{port or 6379}"
        for host, node_type in roles.items():
            if host != head:
                self._start(
                    host,
                    "worker_start_ray_commands",
                    node_type_resources(self.launcher, node_type),
                    head_ip,
                    cpus,
                )
        return self.head_address

    def restart_worker(self, host: str, node_type: str, cpus: int = 2) -> None:
        """Start a Ray node on ``host`` again (after a partition Ray declared it dead)."""
        self.hosts.kill_all(host)
        head_ip = self.head_address.split(":")[0]
        self._start(
            host,
            "worker_start_ray_commands",
            node_type_resources(self.launcher, node_type),
            head_ip,
            cpus,
        )

    def alive_ips(self, timeout_s: float = 120) -> list[str]:
        """The addresses of the Ray nodes the head's GCS holds alive."""
        code = (
            "import ray,sys,json;ray.init(address=sys.argv[1],log_to_driver=False);"
            "print(json.dumps([n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]))"
        )
        head = next(iter(self.hosts.hosts))
        out = self.hosts.run(
            head,
            [sys.executable, "-c", code, self.head_address],
            timeout=timeout_s,
            env={**os.environ, **self.env},
        )
        if out.returncode != 0:
            raise RuntimeError(f"ray.nodes() on the head failed: {out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def wait_nodes(self, count: int, timeout_s: float = 120) -> None:
        """Until ``count`` nodes are alive, seen from the head."""
        deadline = time.monotonic() + timeout_s
        while True:
            alive = len(self.alive_ips(timeout_s))
            if alive >= count:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{alive} of {count} Ray nodes alive after {timeout_s}s")
            time.sleep(1)


def _flag(args: list[str], name: str) -> str | None:
    for a in args:
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None
