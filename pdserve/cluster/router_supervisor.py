"""The controller's watch over the router actor: a router that died (its process killed, the
actor ``ray.kill``-ed) or stopped answering is started again on the same ports, with every
ready worker, so clients find it where they left it.

Requests in flight on the dead router are lost with it (their clients see the connection
break); the leases it held on decode workers expire at their TTL.
"""

from __future__ import annotations

import asyncio
import logging

import ray

log = logging.getLogger("pdserve.controller")

ROUTER_STATUS_TIMEOUT_S = 30.0  # a router that does not answer this long is hung: restarted
NAME_FREE_TIMEOUT_S = 30.0  # how long a dead router's name may stay taken


async def supervise_router(ctl) -> bool:
    """True while the router answers. Otherwise restart it (``ctl``: the Controller) and
    return False; a failed restart is tried again at the next health round."""
    if ctl.router is None:
        return False
    try:
        await asyncio.wait_for(ctl.router.pool_status.remote(), ROUTER_STATUS_TIMEOUT_S)
        return True
    except ray.exceptions.RayActorError as e:
        why = f"died ({type(e).__name__})"
    except asyncio.TimeoutError:
        why = f"has not answered for {ROUTER_STATUS_TIMEOUT_S:.0f} s"
    except ray.exceptions.RayError:
        return True  # one failed call of a live router: not ours to restart
    try:
        await restart_router(ctl, why)
    except Exception as e:  # noqa: BLE001 - keep supervising: the next round tries again
        ctl._event(f"restarting the router failed: {type(e).__name__}: {e!s:.300}")
    return False


async def restart_router(ctl, why: str) -> None:
    """A new router actor on the old one's ports, given every ready worker."""
    ctl._event(f"the router {why}; restarting it")
    ray.kill(ctl.router)
    cfg = same_ports(ctl.cfg, ctl.addresses)
    actor_cls = ctl.router_actor_class()
    router = await _create_when_name_free(actor_cls)
    try:
        addresses = await router.start.remote(cfg.model_dump(), ctl.model_dir)
        for rec in [r for r in ctl.workers.values() if r.state == "ready"]:
            await router.add_worker.remote(rec.role, rec.address)
    except BaseException:
        ray.kill(router)
        raise
    ctl.router, ctl.addresses = router, addresses
    ctl._event(f"router back at grpc {addresses['grpc']} http {addresses['http'] or '-'}")


def same_ports(cfg, addresses: dict):
    """``cfg`` with the ports the first router bound (the config's, or those picked for 0)."""
    ports = {}
    for key, field in (("grpc", "grpc_port"), ("http", "http_port")):
        if addresses.get(key):
            ports[field] = int(addresses[key].rsplit(":", 1)[1])
    return cfg.with_overrides(**ports) if ports else cfg


async def _create_when_name_free(actor_cls):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + NAME_FREE_TIMEOUT_S
    while True:
        try:
            return actor_cls.remote()
        except ValueError:  # the dead router still holds its name
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.5)
