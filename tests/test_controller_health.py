"""The controller's health decisions, without Ray: a worker whose actor answers but whose gRPC
server the router cannot reach is replaced once that lasts ``unreachable_after_s``."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.cluster import ray_controller
from pdserve.cluster.ray_controller import Controller, WorkerRecord
from tests.ray_utils import FakeRemote, tiny_config


class FakeActor:
    def __init__(self):
        self.status = FakeRemote(lambda: {"num_running": 0})


class FakeRouter:
    def __init__(self):
        self.removed = []
        self.remove_worker = FakeRemote(lambda role, address: self.removed.append(address))


@pytest.fixture
def controller(tmp_path, monkeypatch):
    ctl = Controller(tiny_config(tmp_path, unreachable_after_s=5).model_dump(), str(tmp_path))
    ctl.router = FakeRouter()
    reconciled = []

    async def reconcile(role):
        reconciled.append(role)

    monkeypatch.setattr(ctl, "_reconcile", reconcile)
    monkeypatch.setattr(ray_controller.ray, "kill", lambda actor: None)
    ctl.reconciled = reconciled
    return ctl


def _ready(ctl: Controller) -> WorkerRecord:
    rec = WorkerRecord("decode-0", "decode", FakeActor(), "ready", "127.0.0.1:1")
    ctl.workers[rec.worker_id] = rec
    return rec


def _check(ctl, rec, routed, now, monkeypatch):
    monkeypatch.setattr(ray_controller.time, "monotonic", lambda: now)

    async def run():
        await ctl._check(rec, routed)
        await asyncio.gather(*ctl._tasks)

    asyncio.run(run())


def test_unreachable_worker_is_replaced_after_the_grace_period(controller, monkeypatch):
    rec = _ready(controller)
    down = {"address": rec.address, "healthy": False}
    _check(controller, rec, down, 100.0, monkeypatch)
    _check(controller, rec, down, 104.0, monkeypatch)
    assert rec.worker_id in controller.workers  # 4 s < 5 s: still waiting
    _check(controller, rec, down, 105.5, monkeypatch)
    assert rec.worker_id not in controller.workers
    assert controller.router.removed == [rec.address]
    assert controller.reconciled == ["decode"]
    assert "gRPC server has not" in controller.events[-1]


def test_a_worker_that_answers_again_starts_the_clock_over(controller, monkeypatch):
    rec = _ready(controller)
    _check(controller, rec, {"healthy": False}, 100.0, monkeypatch)
    _check(controller, rec, {"healthy": True}, 103.0, monkeypatch)
    _check(controller, rec, {"healthy": False}, 104.0, monkeypatch)
    _check(controller, rec, {"healthy": False}, 108.0, monkeypatch)
    assert rec.worker_id in controller.workers  # down 4 s since it last answered
    assert not controller.reconciled


def test_a_worker_the_router_does_not_know_yet_is_left_alone(controller, monkeypatch):
    rec = _ready(controller)
    for now in (100.0, 200.0, 300.0):
        _check(controller, rec, None, now, monkeypatch)
    assert rec.worker_id in controller.workers
    assert not controller.reconciled
