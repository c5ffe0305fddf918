"""The shm transport's cache file (engine.shared_kv_cache): the decode worker's cache moved into
one private shared-memory file (same tensors, same bytes, the old memory freed), gone after
stop, swept when its worker was killed, refused at start when shared memory cannot hold it,
and a sender elsewhere told why it cannot map it."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from engine.shared_kv_cache import sweep_stale
from kv_transfer.lease import LeaseTable
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import make_sender, start_receiver_server
from tests.one_sided_receiver import LAYERS, TOKEN, kv_cache


def test_the_cache_moves_into_a_private_file_that_is_gone_after_stop():
    """The receiver's cache tensors (the same objects, their contents kept) live in one file
    of the shared-memory directory, readable and writable by this user only."""
    leases = LeaseTable(default_ttl_s=30.0, num_layers=LAYERS)
    caches = kv_cache(zero=False)
    before = [(k.clone(), v.clone()) for k, v in caches]
    tensors = [t for pair in caches for t in pair]
    server = start_receiver_server("shm", KVReceiver(caches, leases), "127.0.0.1", 0)
    path = server.cache.path
    try:
        mode = os.stat(path).st_mode
        assert path.startswith("/dev/shm/") and stat.S_IMODE(mode) == 0o600
        mapping = server.cache._map
        base, size = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr(), len(mapping)
        assert size == sum(t.numel() * t.element_size() for t in tensors)
        assert [t for pair in caches for t in pair] == tensors  # the same tensor objects
        assert all(base <= t.data_ptr() < base + size for t in tensors)
        assert all(
            torch.equal(a, b) for pair, old in zip(caches, before) for a, b in zip(pair, old)
        )
    finally:
        server.stop()
    assert not os.path.exists(path)
    caches[0][0][0] = 1.0  # its tensors stay usable after the file is gone


def test_a_killed_workers_file_is_swept_by_the_next(tmp_path):
    """A worker killed before its stop leaves its file; the next server on the node removes
    the files no live worker holds its lock on (whatever their pid says: another container's
    pids are not ours to see), and no other's."""
    import fcntl
    import subprocess
    import sys

    leases = LeaseTable(default_ttl_s=30.0, num_layers=LAYERS)
    live = start_receiver_server(
        "shm", KVReceiver(kv_cache(True), leases), "127.0.0.1", 0, shm_dir=str(tmp_path)
    )
    # A worker in another process that was killed: its file, its lock gone with it.
    killed = tmp_path / "pdserve-kv-1-0123456789abcdef"
    code = "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600); "
    code += "fcntl.flock(fd, fcntl.LOCK_SH); os.kill(os.getpid(), 9)"
    subprocess.run([sys.executable, "-c", code, str(killed)], check=False)
    # A worker of another container whose pid is dead here, still holding its lock.
    elsewhere = tmp_path / "pdserve-kv-999999999-0123456789abcdef"
    held = os.open(elsewhere, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(held, fcntl.LOCK_SH)
    (tmp_path / "unrelated").write_bytes(b"x")
    try:
        assert sweep_stale(str(tmp_path)) == [killed.name]
        names = sorted(os.listdir(tmp_path))
        assert names == sorted([os.path.basename(live.cache.path), elsewhere.name, "unrelated"])
    finally:
        os.close(held)
        live.stop()
    assert sweep_stale(str(tmp_path)) == [elsewhere.name]  # its worker went away too


def test_a_sender_on_another_node_is_told_why(tmp_path):
    """A sender that cannot open the cache file (another node's /dev/shm) fails to connect,
    saying that shm needs both workers on one node."""
    leases = LeaseTable(default_ttl_s=30.0, num_layers=LAYERS)
    server = start_receiver_server(
        "shm",
        KVReceiver(kv_cache(True), leases),
        "127.0.0.1",
        0,
        token=TOKEN,
        shm_dir=str(tmp_path),
    )
    try:
        assert os.listdir(tmp_path) == [os.path.basename(server.cache.path)]
        os.unlink(server.cache.path)  # as a sender on another node sees it
        with pytest.raises(ConnectionError, match="needs the prefill and the decode worker on one"):
            make_sender("shm", server.endpoint, token=TOKEN)
    finally:
        server.stop()


def test_a_cache_that_does_not_fit_fails_at_start_not_with_sigbus(monkeypatch, tmp_path):
    """Shared memory that cannot hold the cache refuses it when the worker starts, saying how
    much it needs, and leaves no file."""
    import errno

    import engine.shared_kv_cache as shm_cache

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm_cache.os, "posix_fallocate", full)
    leases = LeaseTable(default_ttl_s=30.0, num_layers=LAYERS)
    receiver = KVReceiver(kv_cache(True), leases)
    with pytest.raises(OSError, match=r"needs 24,576 bytes in .*No space left.*shm-size"):
        start_receiver_server("shm", receiver, "127.0.0.1", 0, shm_dir=str(tmp_path))
    assert not os.listdir(tmp_path)


def test_the_move_frees_the_old_cache(tmp_path):
    """The cache's anonymous memory goes back once its bytes are in shared memory."""
    from engine.shared_kv_cache import SharedKVCache

    def rss_mib(kind: str) -> float:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith(kind + ":"))
        return int(line.split()[1]) / 1024

    caches = [(torch.ones(64, 16, 8, 128), torch.ones(64, 16, 8, 128)) for _ in range(16)]
    anon = rss_mib("RssAnon")  # the 128 MiB cache in it
    shared = SharedKVCache(caches, str(tmp_path))  # tmp_path: a file system, or tmpfs
    try:
        assert rss_mib("RssAnon") < anon - 100  # freed
        assert all(k.eq(1).all() and v.eq(1).all() for k, v in caches)  # the bytes moved along
    finally:
        shared.remove()


def test_the_move_frees_the_old_cache_when_it_came_from_the_heap(tmp_path):
    """In a process whose malloc serves blocks this size from its heap (glibc raises its mmap
    threshold, up to 32 MiB, as large blocks are freed: a long-running worker, or this suite),
    freed memory stays resident unless trimmed: the move gives it back all the same. A child
    process, its threshold raised on purpose (glibc only)."""
    import subprocess
    import sys

    code = f"""
import ctypes, torch
if not ctypes.CDLL("libc.so.6").mallopt(-3, 64 << 20):  # M_MMAP_THRESHOLD
    raise SystemExit(3)
from engine.shared_kv_cache import SharedKVCache
def rss():
    return int(next(x for x in open("/proc/self/status") if x.startswith("RssAnon:")).split()[1])
caches = [(torch.ones(64, 16, 8, 128), torch.ones(64, 16, 8, 128)) for _ in range(16)]
before = rss()
shared = SharedKVCache(caches, {str(tmp_path)!r})
print(before - rss())
shared.remove()
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = [sys.executable, "-c", code]
    out = subprocess.run(run, check=False, capture_output=True, text=True, timeout=120, cwd=root)
    if out.returncode == 3:
        pytest.skip("not glibc")
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) / 1024 > 100  # MiB of the 128 MiB cache given back
