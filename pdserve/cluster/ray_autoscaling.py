"""The controller's autoscaling rounds (pdserve/cluster/ray_controller.py): each period, the
autoscaler's per-pool decision from the router's signals, or, with a planner profile, both
pools to the split the window's traffic needs, with the planner's prediction for the pools as
they serve beside what the router measured."""

from __future__ import annotations

import asyncio
import logging
import time

from pdserve.cluster.autoscaler import PoolSignal

log = logging.getLogger("pdserve.controller")

ROLES = ("prefill", "decode")


class PoolAutoscaling:
    """Controller's autoscaling half (it sets cfg, router, autoscaler, targets, _profile,
    prediction, and the _pool, _set_target, _spawn, _reconcile methods)."""

    async def _autoscale_loop(self) -> None:
        a = self.cfg.autoscaler
        while True:
            await asyncio.sleep(a.period_s)
            try:
                await self._autoscale_once(a.window_s)
            except Exception:  # a failed round must not end autoscaling
                log.exception("autoscaler round failed")

    async def _autoscale_once(self, window_s: float) -> None:
        if self.cfg.autoscaler.planner_profile:
            return await self._plan_pools()
        pools = await self.router.pool_status.remote()
        ttft, tpot = await self.router.latency.remote(window_s)
        for role in ROLES:
            if any(r.state == "starting" for r in self._pool(role)):
                continue  # the last change has not landed yet
            serving = [w for w in pools[role] if w["healthy"] and not w["draining"]]
            signal = PoolSignal(
                size=len(serving),
                queued_prompt_tokens=sum(w["queued_prompt_tokens"] for w in serving),
                kv_usage=sum(w["kv_usage"] for w in serving) / max(len(serving), 1),
                ttft_s=ttft,
                tpot_s=tpot,
            )
            self._apply(self.autoscaler.decide(role, self.targets[role], signal, time.monotonic()))

    async def _plan_pools(self) -> None:
        """The planner mode: both pools to the split the window's traffic needs."""
        from pdserve.planner.autoscale import plan_pools  # the planner loads only in this mode

        if any(r.state == "starting" for r in self.workers.values()):
            return  # the last change has not landed yet
        observations, now = await self.router.recent_requests.remote()
        a, bounds = self.cfg.autoscaler, self.autoscaler.bounds
        await self._check_prediction(observations, now, a.window_s)
        target = await asyncio.to_thread(plan_pools, a, self._profile, observations, now, bounds)
        if target is None:
            return  # too little traffic in the window to plan for
        for role in ROLES:
            reason = f"planner: {target.reason}"
            wanted = getattr(target, role)
            self._apply(
                self.autoscaler.move_to(role, self.targets[role], wanted, time.monotonic(), reason)
            )

    async def _check_prediction(self, observations, now: float, window_s: float) -> None:
        """The planner's prediction for the window's traffic on the pools as they serve,
        beside what the router measured: into ``status`` and the router's metrics."""
        from pdserve.planner.drift import prediction_error
        from pdserve.planner.sim import Split

        serving = {role: sum(r.state == "ready" for r in self._pool(role)) for role in ROLES}
        if not serving["decode"]:
            return
        split = Split(serving["prefill"], serving["decode"])
        self.prediction = await asyncio.to_thread(
            prediction_error, self._profile, observations, now, window_s, split
        )
        await self.router.set_planner_prediction.remote(self.prediction)

    def _apply(self, decision) -> None:
        """An autoscaler Decision (None: keep the pool): its new target, then reconcile."""
        if decision is not None:
            self._set_target(decision.role, decision.new, f"autoscaler: {decision.reason}")
            self._spawn(self._reconcile(decision.role))
