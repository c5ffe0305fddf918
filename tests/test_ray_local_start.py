"""Starting a local Ray instance: a raylet that did not register within Ray's fixed 30 s (a
cold first start on a busy 2-core machine) is started once more; anything else is raised."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from pdserve.cluster import ray_launcher

TIMED_OUT = (
    "The current node timed out during startup. This could happen because some of the raylet "
    "failed to startup or the GCS has become overloaded."
)


class FakeRay:
    def __init__(self, failures: list[Exception]):
        self.failures, self.inits, self.shutdowns = failures, [], 0

    def init(self, **args):
        self.inits.append(args)
        if self.failures:
            raise self.failures.pop(0)
        return "context"

    def shutdown(self):
        self.shutdowns += 1


def test_a_start_that_timed_out_is_tried_once_more(monkeypatch):
    fake = FakeRay([Exception(TIMED_OUT)])
    monkeypatch.setattr(ray_launcher, "ray", fake)
    assert ray_launcher.start_local_ray(num_cpus=4) == "context"
    assert len(fake.inits) == 2 and fake.shutdowns == 1
    assert fake.inits[0] == fake.inits[1]
    assert fake.inits[0]["num_cpus"] == 4 and fake.inits[0]["include_dashboard"] is False


def test_a_second_timeout_and_other_errors_are_raised(monkeypatch):
    fake = FakeRay([Exception(TIMED_OUT), Exception(TIMED_OUT)])
    monkeypatch.setattr(ray_launcher, "ray", fake)
    with pytest.raises(Exception, match="timed out during startup"):
        ray_launcher.start_local_ray()
    assert len(fake.inits) == 2
    other = FakeRay([ValueError("bad num_cpus")])
    monkeypatch.setattr(ray_launcher, "ray", other)
    with pytest.raises(ValueError, match="bad num_cpus"):
        ray_launcher.start_local_ray()
    assert len(other.inits) == 1 and other.shutdowns == 0


def test_the_timed_out_nodes_processes_are_stopped_before_the_second_start(monkeypatch):
    """What the failed start left running (its GCS, raylet and reaper: children of this
    process that no Ray node owns) is killed; children that were there before are not."""
    older = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    left_behind = []

    class LeavesAProcess(FakeRay):
        def init(self, **args):
            if not self.inits:
                left_behind.append(
                    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
                )
            return super().init(**args)

    fake = LeavesAProcess([Exception(TIMED_OUT)])
    monkeypatch.setattr(ray_launcher, "ray", fake)
    try:
        assert ray_launcher.start_local_ray() == "context"
        assert left_behind[0].wait(timeout=10) == -signal.SIGKILL
        assert older.poll() is None
    finally:
        older.kill()
        older.wait()
