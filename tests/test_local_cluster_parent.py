"""A local cluster's worker processes live no longer than the process that started them: a
parent killed with SIGKILL runs no cleanup, and before this its workers stayed on, each holding
its port, its model and its KV cache, until someone found and killed them."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

from pdserve.cluster.local import REPO_ROOT
from tests.conftest import tiny_llama_dir

PARENT = """
import sys, time
from pdserve.cluster.local import ClusterSpec, LocalCluster
spec = ClusterSpec(model=sys.argv[1], separate_processes=True, num_blocks=64, max_model_len=128)
cluster = LocalCluster(spec).__enter__()
print(" ".join(str(p.pid) for p in cluster._procs), flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it has stopped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_workers_stop_when_their_parent_is_killed(tmp_path):
    model, _ = tiny_llama_dir(tmp_path)
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(model)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        ready, _, _ = select.select([parent.stdout], [], [], 120)
        assert ready, "the cluster did not start within 120 s"
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in pids if alive(p)]
    for pid in left:  # do not leave them to the rest of the suite
        os.kill(pid, 9)
    assert not left, f"workers {left} outlived their killed parent by 30 s"


def test_workers_stopped_by_their_cluster_exit_cleanly(tmp_path):
    """The watch on stdin must not spoil a normal stop: each worker exits 0 on SIGTERM (a
    thread blocked in a buffered read of stdin made the interpreter abort at shutdown)."""
    from pdserve.cluster.local import ClusterSpec, LocalCluster

    model, _ = tiny_llama_dir(tmp_path)
    spec = ClusterSpec(model=str(model), separate_processes=True, num_blocks=64, max_model_len=128)
    with LocalCluster(spec) as cluster:
        procs = list(cluster._procs)
    assert [p.returncode for p in procs] == [0, 0]
