"""A KV cache in one shared-memory file, and another process's mapping of it: the decode
worker's cache for the shm transport's senders (kv_transfer/shm/), and each tensor-parallel
follower's cache for its rank 0, which ships and receives the ranks' KV slices
(engine/tp_ranks.py).

``SharedKVCache`` moves every layer's K and V cache tensors into one file under /dev/shm
(mode 0600: only this user's processes on this node can map it), laid out layer by layer,
K then V, each [num_blocks, ...] contiguous. The tensors keep their identity (``set_``): the
engine, the receiver and every other holder of the list use the shared memory from then on,
so nothing about the engine changes. ``remove`` unlinks the file (the mapping stays valid for
this process); it runs at ``stop`` and at exit, and a worker that was killed leaves a file
that the next one on the node removes (``sweep_stale``: no live worker holds its lock). Its
pages are allocated at start, so a shared memory too small fails the start, not a later write.

``map_shared`` is the other side: the file the receiver named, checked (a regular file of
this user, of the layout's size, not a symlink) and mapped read-write as the same tensors.
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat

import torch

log = logging.getLogger("pdserve.kv")

SHM_DIR = "/dev/shm"
NAME = re.compile(r"pdserve-kv-(\d+)-[0-9a-f]{16}")


def cache_layout(kv_caches) -> dict:
    """What a sender needs to map these caches: layers, blocks, block shape, dtype, bytes."""
    k0 = kv_caches[0][0]
    for k, v in kv_caches:
        for c in (k, v):
            if c.shape != k0.shape or c.dtype != k0.dtype:
                raise ValueError("shm needs every layer's K and V cache of one shape and dtype")
            if c.device.type != "cpu":
                raise ValueError(f"shm needs the KV cache in host memory, not on {c.device}")
    return {
        "num_layers": len(kv_caches),
        "num_blocks": k0.shape[0],
        "block_shape": list(k0.shape[1:]),
        "dtype": str(k0.dtype).removeprefix("torch."),
        "block_bytes": k0[0].numel() * k0.element_size(),
    }


def file_bytes(layout: dict) -> int:
    return 2 * layout["num_layers"] * layout["num_blocks"] * layout["block_bytes"]


def _views(whole: torch.Tensor, layout: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) cache as tensors over ``whole`` (the file's bytes)."""
    dtype = getattr(torch, layout["dtype"])
    shape = (layout["num_blocks"], *layout["block_shape"])
    size = layout["num_blocks"] * layout["block_bytes"]

    def cache(index: int) -> torch.Tensor:
        return whole[index * size : (index + 1) * size].view(dtype).view(shape)

    return [(cache(2 * i), cache(2 * i + 1)) for i in range(layout["num_layers"])]


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Remove this user's cache files whose worker is gone (killed before it could); the
    names removed. A live worker holds a shared lock on its file as long as it runs (the
    kernel drops it with the process), so a file nobody holds a lock on is stale, whichever
    pid namespace its worker ran in."""
    removed = []
    for name in os.listdir(directory):
        if NAME.fullmatch(name) is None:
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # gone meanwhile, a link, not ours
            continue
        try:
            if os.fstat(fd).st_uid != os.getuid():
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a worker has it
            os.unlink(path)
            removed.append(name)
        except OSError:  # held by a live worker, or removed by another sweep
            continue
        finally:
            os.close(fd)
    if removed:
        log.info("removed KV cache files of workers that are gone: %s", removed)
    return removed


def _reserve(fd: int, offset: int, size: int, nbytes: int, directory: str) -> None:
    """Allocate pages of the file now: a tmpfs that runs out later does not fail a write, it
    kills the process (SIGBUS) on the page that did not fit. ``nbytes``: the whole file's."""
    try:
        os.posix_fallocate(fd, offset, size)
    except OSError as e:
        raise OSError(
            e.errno,
            f"the shm transport's KV cache needs {nbytes:,} bytes in {directory}: "
            f"{e.strerror} (a container's /dev/shm is 64 MiB unless given more, e.g. "
            "docker --shm-size; or fewer num_blocks)",
        ) from None


class SharedKVCache:
    """``kv_caches`` (host tensors, changed in place) moved into a new shared-memory file."""

    def __init__(self, kv_caches, directory: str = SHM_DIR):
        self.layout = cache_layout(kv_caches)
        self.nbytes = nbytes = file_bytes(self.layout)
        sweep_stale(directory)
        # Its shared lock says this worker is alive (sweep_stale) until remove or exit.
        self._fd, self.path = _create_locked(directory)
        fd = self._fd
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.ftruncate(fd, nbytes)
            self._map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
            _ask_huge_pages(self._map)
            self._move(fd, kv_caches, directory)
        except BaseException:
            self.remove()
            raise
        atexit.register(self.remove)

    def _move(self, fd: int, kv_caches, directory: str) -> None:
        """Each tensor in turn: its region's pages allocated, its bytes copied, the tensor set
        onto them (its old memory freed then): at most one tensor more than the cache at
        once, not the cache twice."""
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        size = self.layout["num_blocks"] * self.layout["block_bytes"]
        views = _views(whole, self.layout)
        moves = [(t, v) for pair, shared in zip(kv_caches, views) for t, v in zip(pair, shared)]
        for index, (tensor, shared) in enumerate(moves):
            _reserve(fd, index * size, size, self.nbytes, directory)
            shared.copy_(tensor)
            with torch.no_grad():
                tensor.set_(shared)
        _give_back_freed_memory()

    def remove(self) -> None:
        """Unlink the file and let its lock go (idempotent): no new sender can map it; this
        process's tensors and mappings already made stay valid."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        atexit.unregister(self.remove)


def _give_back_freed_memory() -> None:
    """glibc serves allocations under its mmap threshold (dynamic, up to 32 MiB: it rises as
    large blocks are freed) from its heap and keeps what is freed there resident: in a process
    that freed large blocks before, the old cache would stay in memory after the move.
    malloc_trim returns the free pages to the system (nothing to do on another libc)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _create_locked(directory: str) -> tuple[int, str]:
    """A new cache file, 0600, with this process's shared lock on it: (its fd, its path)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(3):
        path = os.path.join(directory, f"pdserve-kv-{os.getpid()}-{secrets.token_hex(8)}")
        fd = os.open(path, flags, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:  # a sweep between the create and the lock removed it: make another
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd, path
        except FileNotFoundError:
            pass
        os.close(fd)
    raise OSError(f"could not keep a KV cache file in {directory} (swept as it was made)")


def _ask_huge_pages(mapping: mmap.mmap) -> None:
    """Huge pages for the cache where the kernel gives them to shared memory (its shmem THP
    mode ``advise`` or ``always``): decode steps read every block of their batch through it, as
    they read the anonymous memory it replaces (engine/hugepages.py)."""
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no THP here: 4 KiB pages, same bytes
        pass


def map_shared(path: str, layout: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The receiver's caches, mapped read-write from ``path`` (named by an authenticated
    receiver; still checked: a cache file's name, a regular file of this user, not a link,
    of exactly the layout's size)."""
    if not NAME.fullmatch(os.path.basename(path)) or not os.path.isabs(path):
        raise ConnectionError(f"shm receiver named {path[:128]!r}, not a KV cache file")
    nbytes = file_bytes(layout)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConnectionError(
            f"{path} is not on this node: the shm transport needs the prefill and the decode "
            "worker on one node (share_cores node groups); use another transport across nodes"
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != nbytes:
            raise ConnectionError(f"{path} is not this user's KV cache file of {nbytes} bytes")
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
    finally:
        os.close(fd)
    return _views(torch.frombuffer(mapping, dtype=torch.uint8), layout)
