"""The controller: a named async Ray actor that owns the pools.

It places one actor per worker with the pool's resources, starts the router, checks health and
replaces dead workers, and resizes pools at runtime (by hand or from the autoscaler). Every
membership change goes through the router's admin calls, so routing follows scaling:

  scale-up   -> actor starts (engine loads, gRPC binds) -> router.add_worker -> takes traffic
  scale-down -> router.drain_worker + worker draining (no new requests) -> running requests,
                leases and KV transfers finish -> router.remove_worker -> actor stopped
  dead actor -> router.remove_worker -> a replacement starts (the pool returns to its target)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time
from collections import deque
from dataclasses import dataclass, field

import ray

from engine import hugepages
from pdserve.cluster.autoscaler import Autoscaler, planner_profile
from pdserve.cluster.core_pairs import NodePairs, free_group
from pdserve.cluster.ray_actors import RouterActor, WorkerActor
from pdserve.cluster.ray_autoscaling import ROLES, PoolAutoscaling
from pdserve.cluster.router_supervisor import supervise_router
from pdserve.cluster.tp_groups import RankGroups, dead_rank_reason
from pdserve.config import ClusterConfig, with_cluster_token
from pdserve.share_cores import with_share_name

log = logging.getLogger("pdserve.controller")

NAMESPACE = "pdserve"
CONTROLLER_NAME = "pdserve-controller"
ROUTER_NAME = "pdserve-router"
# A worker whose attempts failed this many times in a row is replaced: the router's circuit
# breaker opened (3) and the probes after two cool-downs failed too.
REPLACE_AFTER_FAILURES = 6
# An actor that does not answer its status within this is hung (frozen) and replaced; a hung
# engine in a live actor shows as unhealthy in the router's view (_unreachable_reason).
ACTOR_STATUS_TIMEOUT_S = 30.0
# Of a stop's drain_grace_s, what the servers' and workers' own stop after the drain may take.
STOP_RESERVE_S = 8.0


@dataclass
class WorkerRecord:
    worker_id: str
    role: str
    actor: object
    state: str = "starting"  # starting | ready | draining | stopping
    address: str = ""
    node_id: str = ""
    status: dict = field(default_factory=dict)
    unreachable_since: float | None = None  # when the router last found its gRPC server down
    group: int | None = None  # its node group (share_cores), else None


class Controller(PoolAutoscaling):
    def __init__(self, cfg: dict, model_dir: str):
        # One random cluster token per cluster unless the config names one: every worker and
        # the router get it with the config, so no worker serves unauthenticated.
        self.cfg = with_share_name(with_cluster_token(ClusterConfig.model_validate(cfg)))
        # share_cores: prefill worker i and decode worker i placed on one node (core_pairs.py)
        self.pairs = NodePairs(self.cfg) if self.cfg.share_cores.enabled else None
        self.ranks = RankGroups(self.cfg)  # a placement group per TP worker (tp_groups.py)
        self.model_dir = model_dir
        self.targets = {role: self.cfg.pools[role].replicas for role in ROLES}
        self.workers: dict[str, WorkerRecord] = {}
        self.router = None
        self.addresses: dict = {}
        self.events: deque = deque(maxlen=50)
        self.drained: deque = deque(maxlen=20)  # served counts at drain and at stop, per worker
        bounds = {role: (self.cfg.pools[role].min, self.cfg.pools[role].max) for role in ROLES}
        self.autoscaler = Autoscaler(self.cfg.autoscaler, bounds)
        self._profile = planner_profile(self.cfg.autoscaler.planner_profile)
        self.prediction: dict | None = None  # the planner's, for the recent traffic (drift.py)
        self._ids = {role: itertools.count() for role in ROLES}
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task] = set()
        self._loops: list[asyncio.Task] = []

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> dict:
        """Start the router and every worker; returns the router's addresses once it is ready."""
        # The router lives next to the controller, where the driver resolved the model folder.
        self.router = self.router_actor_class().remote()
        self.addresses = await self.router.start.remote(self.cfg.model_dump(), self.model_dir)
        results = await asyncio.gather(*(self._reconcile(role) for role in ROLES))
        errors = [e for errs in results for e in errs]
        if errors:
            raise RuntimeError("; ".join(errors))
        await self.router.warm_up.remote()  # before the driver prints ready
        self._loops = [asyncio.ensure_future(self._health_loop())]
        if self.cfg.autoscaler.enabled:
            self._loops.append(asyncio.ensure_future(self._autoscale_loop()))
        return self.addresses

    def progress(self) -> dict:
        """Workers started and ready so far (the driver's loading bar)."""
        recs = list(self.workers.values())
        return {"total": sum(self.targets.values()), "ready": sum(r.state == "ready" for r in recs)}

    async def shutdown(self) -> None:
        for task in self._loops:
            task.cancel()
        if self.router is not None:
            # A graceful stop: no new requests, running streams finish (drain_grace_s).
            grace = stream_grace_s(self.cfg.drain_grace_s)
            await _quietly(self.router.drain.remote(grace), grace + 15)
            await _quietly(self.router.stop.remote(), 15)
        await asyncio.gather(*(self._stop_actor(r) for r in list(self.workers.values())))
        self.workers.clear()
        if self.pairs is not None:
            self.pairs.remove()
        self.ranks.remove_all()
        if self.router is not None:
            ray.kill(self.router)
            self.router = None

    # ---- pool size -----------------------------------------------------------------------
    async def scale(
        self, prefill: int | None = None, decode: int | None = None, wait: bool = True
    ) -> dict:
        """Set pool targets; with ``wait`` return once new workers serve and drained ones
        stopped."""
        wanted = {r: n for r, n in (("prefill", prefill), ("decode", decode)) if n is not None}
        for role, n in wanted.items():
            pool = self.cfg.pools[role]
            if n < 1:
                raise ValueError(f"{role}: a pool needs at least 1 worker, got {n}")
            if self.cfg.autoscaler.enabled and not pool.min <= n <= pool.max:
                raise ValueError(
                    f"{role}: {n} is outside the autoscaler's bounds {pool.min}..{pool.max}"
                )
        after = {**self.targets, **wanted}
        if self.pairs is not None and after["prefill"] != after["decode"]:
            raise ValueError(
                f"share_cores pairs the pools' workers: prefill ({after['prefill']}) and decode "
                f"({after['decode']}) must stay equal"
            )
        for role, n in wanted.items():
            self._set_target(role, n, "scale command")
        results = await asyncio.gather(*(self._reconcile(r) for r in wanted))
        if wait:
            await self.wait_drained()
        errors = [e for errs in results for e in errs]
        if errors:
            raise RuntimeError("; ".join(errors))
        return await self.status()

    async def wait_drained(self) -> None:
        while any(r.state in ("draining", "stopping") for r in self.workers.values()):
            await asyncio.sleep(0.1)

    def _set_target(self, role: str, n: int, why: str) -> None:
        if self.targets[role] != n:
            self._event(f"{role}: {self.targets[role]} -> {n} workers ({why})")
        self.targets[role] = n

    async def _reconcile(self, role: str) -> list[str]:
        """Start or drain workers until the live ones match the target; returns errors."""
        lock = self._locks.setdefault(role, asyncio.Lock())
        async with lock:
            live = [r for r in self._pool(role) if r.state in ("starting", "ready")]
            missing = self.targets[role] - len(live)
            if missing < 0:
                # Newest first: the oldest workers keep their warm prefix caches.
                for rec in sorted(live, key=lambda r: _index(r.worker_id))[missing:]:
                    rec.state = "draining"  # no longer counts toward the target, from now
                    self._spawn(self._drain(rec))
                return []
            added = await asyncio.gather(
                *(self._add_worker(role) for _ in range(missing)), return_exceptions=True
            )
            return [str(e) for e in added if isinstance(e, BaseException)]

    # ---- one worker ----------------------------------------------------------------------
    async def _add_worker(self, role: str) -> WorkerRecord:
        worker_id = f"{role}-{next(self._ids[role])}"
        pool = self.cfg.pools[role]
        group, placement = None, {"num_gpus": pool.num_gpus}
        if self.pairs is not None:  # the group missing this role's member, on its node
            group = free_group(role, {r.group for r in self._pool(role)})
            placement |= self.pairs.options(group, role)
        placement |= self.ranks.options(worker_id, role)  # TP: its ranks' group (tp_groups.py)
        actor = (
            ray.remote(WorkerActor)
            .options(
                name=f"pdserve-{worker_id}",
                namespace=NAMESPACE,
                num_cpus=pool.num_cpus,
                resources=dict(pool.resources) or None,
                max_concurrency=8,
                runtime_env={"env_vars": hugepages.env_vars()},  # set before torch loads
                **placement,
            )
            .remote(role, worker_id, self.cfg.model_dump(), group)
        )
        rec = WorkerRecord(worker_id, role, actor, group=group)
        self.workers[worker_id] = rec
        try:
            info = await asyncio.wait_for(actor.ready.remote(), self.cfg.worker_start_timeout_s)
            rec.address, rec.node_id = info["address"], info["node_id"]
            await self.router.add_worker.remote(role, rec.address)
        except Exception as e:  # noqa: BLE001 - any start failure: report it, keep serving
            self.workers.pop(worker_id, None)
            self._kill(rec)
            self._event(f"{worker_id} failed to start: {root_cause(e)}")
            raise RuntimeError(f"{worker_id} failed to start: {root_cause(e)}") from None
        rec.state = "ready"
        self._event(f"{worker_id} ready at {rec.address}")
        return rec

    async def _drain(self, rec: WorkerRecord) -> None:
        rec.state = "draining"
        # The worker first (a decode worker refuses reservations from here on, so a request
        # that picked it just before the router's mark goes elsewhere), then the router.
        await _quietly(rec.actor.set_draining.remote())
        await _quietly(self.router.drain_worker.remote(rec.role, rec.address))
        await asyncio.sleep(0.2)  # reservations answered before the marks are counted too
        served = await _quietly(self.router.served_on.remote(rec.role, rec.address))
        self._event(f"{rec.worker_id} draining (served {served} requests)")
        await self._wait_idle(rec)
        rec.state = "stopping"
        served_at_stop = await _quietly(self.router.served_on.remote(rec.role, rec.address))
        await _quietly(self.router.remove_worker.remote(rec.role, rec.address))
        await self._stop_actor(rec)
        self.workers.pop(rec.worker_id, None)
        self.drained.append(
            {"id": rec.worker_id, "served_at_drain": served, "served_at_stop": served_at_stop}
        )
        self._event(f"{rec.worker_id} stopped after draining (served {served_at_stop})")

    async def _wait_idle(self, rec: WorkerRecord) -> None:
        """Until the router has nothing in flight there and the worker has no running request,
        open lease or unfinished KV transfer (twice in a row), or the drain timeout."""
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        idle_polls = 0
        while idle_polls < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            inflight = await _quietly(self.router.inflight_on.remote(rec.role, rec.address))
            st = await _quietly(rec.actor.status.remote())
            if st is None:  # died while draining: nothing left to wait for
                return
            rec.status = st
            idle_polls = idle_polls + 1 if not inflight and not st["busy"] else 0

    async def _stop_actor(self, rec: WorkerRecord) -> None:
        await _quietly(rec.actor.stop.remote(), 15)
        self._kill(rec)

    def _kill(self, rec: WorkerRecord) -> None:
        """The actor, its followers (its children) with it, and its ranks' placement group."""
        ray.kill(rec.actor)
        self.ranks.remove(rec.worker_id)

    # ---- health --------------------------------------------------------------------------
    @staticmethod
    def router_actor_class():
        """The router's named actor class, pinned to this node (a restart makes it anew)."""
        return pinned_here(RouterActor, ROUTER_NAME, max_concurrency=16)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_period_s)
            if not await supervise_router(self):  # dead or hung: restarted on its ports
                continue
            routed = await self._routed_workers()
            ready = [r for r in self.workers.values() if r.state == "ready"]
            await asyncio.gather(*(self._check(r, routed.get(r.address)) for r in ready))

    async def _routed_workers(self) -> dict:
        """The router's view of each worker (by address): whether its gRPC server answers."""
        if self.router is None:
            return {}
        pools = await _quietly(self.router.pool_status.remote()) or {}
        return {w["address"]: w for role in ROLES for w in pools.get(role, [])}

    async def _check(self, rec: WorkerRecord, routed: dict | None) -> None:
        try:
            status = rec.actor.status.remote()
            rec.status = await asyncio.wait_for(status, ACTOR_STATUS_TIMEOUT_S)
            reason = dead_rank_reason(rec.status) or self._unreachable_reason(rec, routed)
        except asyncio.TimeoutError:
            reason = f"hung: its actor has not answered for {ACTOR_STATUS_TIMEOUT_S:.0f} s"
        except ray.exceptions.RayError as e:
            reason = type(e).__name__
        if reason is None or rec.state != "ready":  # drained or stopped meanwhile: no failure
            return
        self._event(f"{rec.worker_id} at {rec.address} is dead ({reason}); replacing it")
        self.workers.pop(rec.worker_id, None)
        self._kill(rec)
        await _quietly(self.router.remove_worker.remote(rec.role, rec.address))
        self._spawn(self._reconcile(rec.role))

    def _unreachable_reason(self, rec: WorkerRecord, routed: dict | None) -> str | None:
        """The actor answers; is its gRPC server (what clients use) reachable and healthy? A
        worker the router has not polled yet, or saw answer, is fine. One whose attempts keep
        failing (it answers, but its steps or transfers fail) is not, nor one unreachable or
        unhealthy (its watchdog: a hung engine) for unreachable_after_s, the grace period."""
        failing = (routed or {}).get("failed_in_a_row", 0)
        if failing >= REPLACE_AFTER_FAILURES:
            return f"its last {failing} attempts failed (circuit breaker open)"
        if routed is None or routed.get("healthy", True):
            rec.unreachable_since = None
            return None
        now = time.monotonic()
        if rec.unreachable_since is None:
            rec.unreachable_since = now
        down = now - rec.unreachable_since
        if down < self.cfg.unreachable_after_s:
            return None
        return f"its actor answers but its gRPC server has not for {down:.0f} s (or is hung)"

    # ---- status --------------------------------------------------------------------------
    async def status(self) -> dict:
        by_address = await self._routed_workers()
        out = {
            "router": dict(self.addresses),
            "autoscaler": self.cfg.autoscaler.enabled,
            "planner_prediction": self.prediction,
            "events": list(self.events),
            "drained": list(self.drained),
            "pools": {},
        }
        for role in ROLES:
            pool = self.cfg.pools[role]
            rows = [_worker_row(r, by_address.get(r.address, {})) for r in self._pool(role)]
            out["pools"][role] = {
                "target": self.targets[role],
                "min": pool.min,
                "max": pool.max,
                "workers": rows,
            }
        return out

    # ---- helpers -------------------------------------------------------------------------
    def _pool(self, role: str) -> list[WorkerRecord]:
        return [r for r in self.workers.values() if r.role == role]

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _event(self, text: str) -> None:
        log.info(text)
        self.events.append(f"{time.strftime('%H:%M:%S')} {text}")


def _worker_row(rec: WorkerRecord, routed: dict) -> dict:
    st = rec.status
    total = st.get("num_total_blocks", 0)
    return {
        "id": rec.worker_id,
        "address": rec.address,
        "node_id": rec.node_id,
        "state": rec.state,
        "healthy": routed.get("healthy", False),
        "draining": rec.state in ("draining", "stopping") or routed.get("draining", False),
        "circuit": routed.get("circuit", "closed"),
        "kv_usage": 1 - st.get("num_free_blocks", 0) / total if total else 0.0,
        "running": st.get("num_running", 0),
        "waiting": st.get("num_waiting", 0),
        "served_requests": routed.get("served_requests", 0),
        "threads": st.get("threads", 0),  # torch threads now (a node group's share of its cores)
        "node_cores": st.get("node_cores", 0),  # 0: shares no cores
        "group": rec.group,
        "tensor_parallel": st.get("tensor_parallel"),  # its ranks; None at TP=1
    }


def pinned_here(actor_cls, name: str, max_concurrency: int):
    """A named actor class of pdserve's namespace, placed on this node, taking no CPU slot (the
    controller and the router: cheap, and next to the model folder the driver resolved)."""
    here = ray.get_runtime_context().get_node_id()
    return ray.remote(actor_cls).options(
        name=name,
        namespace=NAMESPACE,
        num_cpus=0,
        max_concurrency=max_concurrency,
        scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
            here, soft=False
        ),
    )


def stream_grace_s(drain_grace_s: float) -> float:
    """How long running streams get in a stop of ``drain_grace_s`` (the rest: the stop)."""
    return max(drain_grace_s - STOP_RESERVE_S, drain_grace_s / 2)


def root_cause(error: BaseException) -> str:
    """The innermost ``SomeError: message`` line of a Ray error (it nests remote tracebacks)."""
    text = str(error).replace("\\n", "\n")
    found = re.findall(r"^\s*([\w.]+(?:Error|Exception): .*?)['\"]?\)*$", text, re.MULTILINE)
    return found[-1] if found else f"{error!r:.300}"


def _index(worker_id: str) -> int:
    return int(worker_id.rsplit("-", 1)[1])


async def _quietly(ref, timeout: float = 10.0):
    """Await a Ray call; None if the actor is gone or slow (best effort during teardown)."""
    try:
        return await asyncio.wait_for(ref, timeout)
    except (ray.exceptions.RayError, asyncio.TimeoutError):
        return None
