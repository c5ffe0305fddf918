"""The driver side of a Ray deployment: connect to (or start) Ray, convert the model once with a
progress bar, start the controller, show workers loading, and stop everything again.

``pdserve serve``, ``pdserve demo`` and the tests all go through ``launch``.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
from dataclasses import dataclass

import ray
from typing_extensions import Self

from engine.errors import PdserveError
from engine.model_files import resolve_model_dir
from pdserve.cluster.ray_controller import CONTROLLER_NAME, NAMESPACE, Controller, pinned_here
from pdserve.config import ClusterConfig

LOCAL_OBJECT_STORE_BYTES = 128 * 2**20  # control calls only: KV never goes through it
log = logging.getLogger("pdserve.ray")


class ClusterError(PdserveError):
    """The cluster could not be launched or found."""


def connect(
    address: str | None = None, cfg: ClusterConfig | None = None, log_to_driver: bool = True
) -> bool:
    """Join the Ray cluster at ``address`` ("auto": the one running on this machine), or start a
    local Ray instance sized for ``cfg``. Returns whether this process started Ray."""
    if ray.is_initialized():
        return False
    if address:
        try:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=log_to_driver)
        except ConnectionError as e:
            raise ClusterError(f"cannot reach a Ray cluster at {address!r}: {e}") from None
        return False
    start_local_ray(
        num_cpus=_local_cpus(cfg),
        object_store_memory=LOCAL_OBJECT_STORE_BYTES,
        log_to_driver=log_to_driver,
    )
    return True


def start_local_ray(**init_args):
    """``ray.init`` of a new local instance (no dashboard, pdserve's namespace), tried a
    second time if its raylet did not register within Ray's fixed 30 s: a cold first start on
    a busy small machine (a fresh venv's imports from disk beside other load) can take longer,
    and the second start finds the files cached. Returns ray.init's context."""
    args = {"namespace": NAMESPACE, "include_dashboard": False, **init_args}
    before = _children()
    try:
        return ray.init(**args)
    except Exception as e:  # Ray raises a bare Exception for this one
        if "timed out during startup" not in str(e):
            raise
        log.warning("Ray's node did not start within its 30 s; starting it once more")
        # The failed node's processes (GCS, raylet, reaper) are this process's children and
        # nothing owns them now (ray.shutdown knows no node): stop them, or they run until exit.
        for pid in _children() - before:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        ray.shutdown()
    return ray.init(**args)


def _children() -> set[int]:
    """The pids of this process's children, from /proc (each thread's children: Linux
    with CONFIG_PROC_CHILDREN, as every major distribution builds it; empty elsewhere)."""
    found: set[int] = set()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                found.update(int(pid) for pid in f.read().split())
        except OSError:
            continue  # the thread ended meanwhile
    return found


def _local_cpus(cfg: ClusterConfig | None) -> int:
    # Ray's CPUs are a logical count: on a small machine, give it enough for every pool at its
    # max so actors never wait for CPUs that torch threads share anyway (a TP worker's
    # placement group holds num_cpus for each of its ranks: pdserve/cluster/tp_groups.py).
    cpus = os.cpu_count() or 1
    if cfg is None:
        return cpus
    pools = (cfg.pools.prefill, cfg.pools.decode)
    wanted = sum(p.num_cpus * p.tensor_parallel_size * max(p.max, p.replicas) for p in pools)
    return max(cpus, math.ceil(wanted))


@dataclass
class RayCluster:
    """A launched cluster, seen from the driver."""

    controller: object
    grpc_address: str
    http_address: str
    owns_ray: bool = False
    drain_grace_s: float = 30.0  # the config's: how long shutdown lets streams finish

    def status(self) -> dict:
        return ray.get(self.controller.status.remote())

    def scale(
        self, prefill: int | None = None, decode: int | None = None, wait: bool = True
    ) -> dict:
        return ray.get(self.controller.scale.remote(prefill, decode, wait))

    def shutdown(self) -> None:
        try:
            ray.get(self.controller.shutdown.remote(), timeout=self.drain_grace_s + 60)
        except (ray.exceptions.RayError, TimeoutError):
            pass  # killing the controller takes its actors with it
        finally:
            ray.kill(self.controller)
            if self.owns_ray:
                ray.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def launch(
    cfg: ClusterConfig,
    address: str | None = None,
    progress: bool = True,
    log_to_driver: bool = True,
    stop: threading.Event | None = None,
) -> RayCluster:
    """Start the router and every worker in Ray; returns once the router is ready."""
    owns = connect(address, cfg, log_to_driver)
    controller = None
    try:
        # Convert once here (with a progress bar), not in every actor at the same time.
        model_dir = resolve_model_dir(cfg.model, progress=progress)
        if _find(CONTROLLER_NAME) is not None:
            raise ClusterError(
                "a pdserve cluster is already running in this Ray cluster: "
                "use `pdserve status` / `pdserve scale`, or stop it first"
            )
        controller = pinned_here(Controller, CONTROLLER_NAME, max_concurrency=1000).remote(
            cfg.model_dump(), str(model_dir)
        )
        addresses = _wait_loading(controller, controller.start.remote(), progress, stop)
    except BaseException:
        if controller is not None:
            RayCluster(controller, "", "", owns).shutdown()
        elif owns:
            ray.shutdown()
        raise
    return RayCluster(controller, addresses["grpc"], addresses["http"], owns, cfg.drain_grace_s)


def _wait_loading(controller, start_ref, progress: bool, stop: threading.Event | None) -> dict:
    from tqdm import tqdm

    bar = None
    while True:
        done, _ = ray.wait([start_ref], timeout=0.5)
        if stop is not None and stop.is_set():
            raise KeyboardInterrupt
        if progress:
            state = ray.get(controller.progress.remote())
            if bar is None:
                bar = tqdm(
                    total=state["total"], desc="loading workers", unit="worker", file=sys.stderr
                )
            if (bar.total, bar.n) != (state["total"], state["ready"]) or sys.stderr.isatty():
                bar.total, bar.n = state["total"], state["ready"]
                bar.refresh()
        if done:
            break
    if bar is not None:
        bar.close()
    try:
        return ray.get(start_ref)
    except ray.exceptions.RayTaskError as e:
        raise ClusterError(f"the cluster did not start: {e.cause}") from None


def _find(name: str):
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def find_controller(address: str | None = "auto"):
    """The running cluster's controller (for ``pdserve status`` / ``pdserve scale``)."""
    connect(address or "auto", log_to_driver=False)
    controller = _find(CONTROLLER_NAME)
    if controller is None:
        raise ClusterError(
            "no pdserve cluster is running in this Ray cluster (start one with `pdserve serve`)"
        )
    return controller


def serve_forever(cfg: ClusterConfig, address: str | None = None) -> int:
    """Launch, print the addresses and ``ready``, and stop everything on Ctrl-C or SIGTERM:
    a graceful stop (the router refuses new requests and lets running streams finish, within
    ``drain_grace_s``), then the workers and the router, then exit."""
    owns_ray = connect(address, cfg)
    # After ray.init, which installs a SIGTERM handler of its own that would end us at once.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        cluster = launch(cfg, address, stop=stop)
    except KeyboardInterrupt:
        if owns_ray:
            ray.shutdown()
        return 130
    except BaseException:
        if owns_ray:
            ray.shutdown()
        raise
    cluster.owns_ray = owns_ray
    if stop.is_set():
        cluster.shutdown()
        return 130
    print(f"grpc: {cluster.grpc_address}", flush=True)
    if cluster.http_address:
        print(f"http: {cluster.http_address}", flush=True)
    print("ready", flush=True)
    code = 0
    try:
        while not stop.wait(2.0):
            try:
                ray.get(cluster.controller.progress.remote(), timeout=30)
            except (ray.exceptions.RayError, TimeoutError) as e:
                print(f"error: the controller is gone: {e!r:.200}", file=sys.stderr)
                code = 1
                break
    finally:
        print("shutting down", flush=True)
        cluster.shutdown()
    return code


def _rank_lines(tp: dict | None) -> list[str]:
    """A tensor-parallel worker's ranks under its line (threads above: each rank's)."""
    if not tp or tp.get("size", 1) <= 1:
        return []
    return [
        f"    rank {r['rank']}/{tp['size']}  pid {r['pid']:<8} {'alive' if r['alive'] else 'dead'}"
        for r in tp.get("ranks", [])
    ]


def _threads(row: dict) -> str:
    """Torch threads now; with share_cores, of the node group's cores: '3/4'."""
    threads, cores = row.get("threads", 0), row.get("node_cores", 0)
    return f"{threads}/{cores}" if cores else str(threads or "-")


def format_status(st: dict) -> str:
    """``pdserve status`` as text: one line per worker."""
    router = st.get("router", {})
    lines = [
        (
            f"router  grpc {router.get('grpc', '-')}  http {router.get('http') or '-'}  "
            f"autoscaler {'on' if st.get('autoscaler') else 'off'}"
        )
    ]
    header = (
        f"  {'id':<12} {'state':<9} {'health':<9} {'address':<22} {'KV':>5} "
        f"{'run':>4} {'wait':>4} {'served':>6} {'threads':>7}"
    )
    for role, pool in st["pools"].items():
        lines.append(
            f"{role}: {len(pool['workers'])} workers (target {pool['target']}, "
            f"min {pool['min']}, max {pool['max']})"
        )
        lines.append(header)
        for w in pool["workers"]:
            health = "draining" if w["draining"] else "healthy" if w["healthy"] else "unhealthy"
            # The router's circuit breaker: out of routing (tripped), or on probation (probing).
            health = {"open": "tripped", "half_open": "probing"}.get(w.get("circuit"), health)
            lines.append(
                f"  {w['id']:<12} {w['state']:<9} {health:<9} {w['address']:<22} "
                f"{w['kv_usage']:>5.0%} {w['running']:>4} {w['waiting']:>4} "
                f"{w['served_requests']:>6} {_threads(w):>7}"
            )
            lines += _rank_lines(w.get("tensor_parallel"))
    if st.get("autoscaler") and "planner_prediction" in st:
        from pdserve.planner.drift import format_prediction

        lines.append(format_prediction(st["planner_prediction"]))
    if st.get("events"):
        lines.append("recent events:")
        lines += [f"  {e}" for e in st["events"][-10:]]
    return "\n".join(lines)
