"""A build of the CPU extension killed mid-way leaves torch's lock file in its build folder, and
torch waits for that file to go away, forever (a CI run stalled 11 minutes on one). Builds now
take turns under an OS lock that dies with its process (kernels/cpu_extension.py
``exclusive_build``), and under it a torch lock file that no live process holds is removed.
None of these tests compiles anything: torch's loader is replaced by a fake that locks the
folder as torch does."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from kernels import cpu_extension
from kernels.cpu_extension import TORCH_LOCK_FILE

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 3.0  # how long the fakes wait on torch's lock file before calling themselves stuck


def _fake_torch_load(builds: list[str]):
    """torch.utils.cpp_extension.load as far as its lock goes (``_jit_compile``): build under
    a FileBaton on <build_directory>/lock, or wait for that file to go away (bounded here)."""
    from torch.utils.file_baton import FileBaton

    def load(name, sources, build_directory, **_):
        baton = FileBaton(os.path.join(build_directory, TORCH_LOCK_FILE))
        if baton.try_acquire():
            try:
                builds.append(name)
            finally:
                baton.release()
        else:
            deadline = time.monotonic() + WAIT_S
            while os.path.exists(baton.lock_file_path):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"stuck on {baton.lock_file_path}")
                time.sleep(0.05)
        return SimpleNamespace(instruction_set=name.rsplit("_", 1)[1])

    return load


def test_a_killed_build_s_lock_file_no_longer_stops_the_next_build(tmp_path, monkeypatch):
    import torch.utils.cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    builds: list[str] = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", _fake_torch_load(builds))
    variant = cpu_extension.VARIANTS[-1]
    stale = cpu_extension._build_directory(variant.name) / TORCH_LOCK_FILE
    stale.touch()  # what a build killed mid-way leaves
    module = cpu_extension._build(variant)
    assert module is not None and module.instruction_set == variant.name
    assert builds == [f"pdserve_cpu_kernels_{variant.name}"]
    assert not stale.exists()


_HOLDER = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL)  # as torch's FileBaton, never released
print("holding", flush=True)
time.sleep(60)
"""


def test_a_lock_file_a_live_process_holds_stays(tmp_path):
    """A build that did not take our lock (an older checkout's) still owns its lock file."""
    lock = tmp_path / TORCH_LOCK_FILE
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _HOLDER,
            str(lock),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        assert cpu_extension.processes_with_open(lock) == [holder.pid]
        with cpu_extension.exclusive_build(tmp_path):
            assert lock.exists()
        assert not cpu_extension.remove_stale_torch_lock(tmp_path) and lock.exists()
    finally:
        holder.kill()
        holder.wait()
    assert cpu_extension.processes_with_open(lock) == []
    assert cpu_extension.remove_stale_torch_lock(tmp_path) and not lock.exists()


# One process's build: wait for "go", then, under exclusive_build, do what torch does in the
# folder (build the module once under its lock file, or wait that file out) and load it.
_BUILDER = """
import logging, os, sys, time
from pathlib import Path
from kernels.cpu_extension import TORCH_LOCK_FILE, exclusive_build

logging.basicConfig(level=logging.INFO)
folder = Path(sys.argv[1])
lock, module = folder / TORCH_LOCK_FILE, folder / "module.so"
print("ready", flush=True)
while not (folder / "go").exists():
    time.sleep(0.01)
with exclusive_build(folder):
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        deadline = time.monotonic() + WAIT_S
        while lock.exists():
            if time.monotonic() > deadline:
                sys.exit("stuck on the lock file")
            time.sleep(0.05)
    else:
        if not module.exists():
            with open(folder / "builds", "a") as log:
                log.write(f"{os.getpid()}\\n")
            time.sleep(1.5)  # compiling
            module.write_text("built")
        os.close(fd)
        os.remove(lock)
print("loaded", module.read_text(), flush=True)
""".replace("WAIT_S", repr(WAIT_S))


def test_two_processes_with_a_stale_lock_file_build_once_and_both_load(tmp_path):
    (tmp_path / TORCH_LOCK_FILE).touch()  # a killed build's
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BUILDER, str(tmp_path)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    (tmp_path / "go").touch()
    results = [p.communicate(timeout=30) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert [out.split() for out, _ in results] == [["loaded", "built"]] * 2
    assert len((tmp_path / "builds").read_text().split()) == 1  # one built, one loaded
    assert sum("waiting for another process's build" in err for _, err in results) == 1
    assert not (tmp_path / TORCH_LOCK_FILE).exists()
