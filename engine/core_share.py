"""Cores lent between a prefill worker and a decode worker on one node (issue #47).

On a node with a prefill worker and a decode worker, a static split of its cores wastes
whichever is idle. Here the pair share them, step by step, through a tiny ledger in shared
memory (one per node group, a file under /dev/shm, written by decode and read by prefill):

- decode, each step, publishes the threads its running batch needs to hold its TPOT target
  (``DecodeCores``) and runs with that many itself;
- prefill, before each chunk, reads it and runs with the rest of the node's cores, at least 1
  (``PrefillCores``), and, while decode's measured steps keep well within its budget, on
  decode's cores too (the OS time-slices them): a decode whose steps reach the budget, or that
  needs more cores, gets them back within one prefill chunk.

Threads are torch's intra-op threads. ``torch.set_num_threads`` sets the calling thread's
OpenMP count, so both are called on the engine thread, which runs every forward; a call costs
about 0.1 us and is made only when the count changes. GPUs (SM shares through MPS or green
contexts) are not built.

Torch-free at import: the workers' launch modules and the cluster config read the settings.
"""

from __future__ import annotations

import argparse
import math
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

LEDGER_DIR = "/dev/shm"
# A decode worker that has not published for this long is gone (or stalled past any normal
# step: an idle one publishes every engine loop turn, 50 ms): its cores go to prefill.
STALE_AFTER_S = 5.0
# The decode need's estimate of a step: a moving average over about this many recent steps.
EWMA_WEIGHT = 0.2
# need falls by one only when the estimate fits (need - 1) threads with this much to spare,
# so a step time at a boundary does not flip the split every step.
DOWN_MARGIN = 0.9
# Prefill runs on decode's cores too (one more thread per chunk, up to the node's cores) while
# decode's measured step stays under this share of its budget (headroom x TPOT target): the
# OS time-slices the cores, decode's steps slow but keep their target, and a long prompt is
# prefilled on every core. At or past the budget prefill gives them back from its next chunk.
LEND_BELOW = 0.6
RECLAIM_AT = 1.0


@dataclass(frozen=True)
class CoreShareSettings:
    """One worker's side of a node group's core sharing."""

    ledger: str  # the group's ledger file (ledger_path)
    node_cores: int = 0  # cores the pair shares; 0: the CPUs this process may use
    decode_threads: int = 0  # 0: derived from decode's step time; N: decode takes N when busy
    tpot_target_s: float = 0.1  # the decode worker's target time per output token
    headroom: float = 0.8  # decode aims at this share of the target (the rest: noise)

    @property
    def cores(self) -> int:
        return self.node_cores or _usable_cpus()


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: a container's or taskset's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def ledger_path(name: str, group: int) -> str:
    """The ledger of node group ``group`` of the cluster (or sharing) named ``name``."""
    return os.path.join(LEDGER_DIR, f"pdserve-cores-{name}-{group}")


class Published(NamedTuple):
    need: int  # threads decode's batch needs now (0: no running sequences)
    decode_threads: int  # threads decode runs with
    running: int  # decode's running + waiting sequences
    step_s: float  # decode's estimate of one step at ``decode_threads`` threads
    age_s: float  # since decode published this


# magic, version, seq (odd while written), need, decode threads, sequences, (pad),
# published at (CLOCK_MONOTONIC ns: one clock for every process of a node), step estimate.
_LAYOUT = struct.Struct("<4sIQIIIIqd")
_SEQ = struct.Struct("<Q")
_SEQ_OFFSET = 8
_MAGIC, _VERSION = b"PDCS", 1
LEDGER_BYTES = 64


class CoreLedger:
    """A node group's ledger: a fixed 64-byte struct in a mmap'd file, one writer (decode),
    any readers (prefill). A sequence counter, odd while a write is under way, lets a reader
    retry a torn read (a seqlock); nothing is pickled."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()  # close() against a publish from the engine thread
        self._map, self._inode = self._open(path)
        self._last: Published | None = None

    @staticmethod
    def _open(path: str) -> tuple[mmap.mmap, int]:
        # Either side may start first: both create it, at its full size, zeros until written.
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < LEDGER_BYTES:
                os.ftruncate(fd, LEDGER_BYTES)
            return mmap.mmap(fd, LEDGER_BYTES), os.fstat(fd).st_ino
        finally:
            os.close(fd)

    def publish(self, need: int, decode_threads: int, running: int, step_s: float) -> None:
        with self._lock:
            if self._map is None:
                return
            (seq,) = _SEQ.unpack_from(self._map, _SEQ_OFFSET)
            seq += 1 if seq % 2 == 0 else 0  # odd: a write is under way
            _SEQ.pack_into(self._map, _SEQ_OFFSET, seq)
            now = time.monotonic_ns()
            values = (need, decode_threads, running, 0, now, step_s)
            _LAYOUT.pack_into(self._map, 0, _MAGIC, _VERSION, seq, *values)
            _SEQ.pack_into(self._map, _SEQ_OFFSET, seq + 1)

    def read(self) -> Published | None:
        """What decode published last (None: nothing yet). A write torn past a few retries
        (its writer died mid-write) gives the last good read."""
        with self._lock:
            if self._map is None:
                return self._last
            self._follow_path()
            for _ in range(100):
                magic, version, seq, need, threads, running, _, at, step_s = _LAYOUT.unpack_from(
                    self._map
                )
                if seq % 2 == 0 and _SEQ.unpack_from(self._map, _SEQ_OFFSET)[0] == seq:
                    break
            else:
                return self._last
            if magic != _MAGIC or version != _VERSION:
                return None
            age_s = (time.monotonic_ns() - at) / 1e9
            self._last = Published(need, threads, running, step_s, age_s)
            return self._last

    def _follow_path(self) -> None:
        """A decode worker that stopped cleanly unlinked the ledger; its successor made a new
        file at the path: read that one from now on."""
        try:
            inode = os.stat(self.path).st_ino
        except FileNotFoundError:
            return
        if inode != self._inode:
            self._map.close()
            self._map, self._inode = self._open(self.path)

    def close(self, unlink: bool = False) -> None:
        with self._lock:
            if self._map is not None:
                self._map.close()
                self._map = None
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def _torch_set_num_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


class _ThreadCount:
    """The engine thread's torch thread count, changed only when it differs."""

    def __init__(self, set_threads: Callable[[int], None] | None):
        self._set = set_threads or _torch_set_num_threads
        self.threads = 0  # not set yet
        self.changes = 0

    def apply(self, threads: int) -> None:
        if threads != self.threads:
            self._set(threads)
            self.threads = threads
            self.changes += 1


class DecodeCores:
    """Decode's side, called once per engine step on the engine thread (``on_step``).

    The need: 0 with no sequences; else ``decode_threads`` when configured; else the threads
    at which a step would take ``headroom`` x the TPOT target, taking a step's work as fixed
    thread-seconds (its measured time x the threads it ran with, averaged over recent steps;
    step time ~ 1/threads, which over-asks where decode is bound by memory bandwidth rather
    than cores). Between 1 and the node's cores; 1 until a step has been measured. A step is
    timed from its plan to the next plan, so only back-to-back steps count."""

    def __init__(self, s: CoreShareSettings, set_threads: Callable[[int], None] | None = None):
        self.settings = s
        self.ledger = CoreLedger(s.ledger)
        self._threads = _ThreadCount(set_threads)
        self.need = 0
        self.step_thread_s: float | None = None  # the average step's thread-seconds
        self._planned_at: float | None = None  # when the busy step in progress was planned
        self._ran_with = 0  # the threads that step ran with

    @property
    def threads(self) -> int:
        return self._threads.threads

    def on_step(self, sequences: int, now: float | None = None) -> int:
        """A plan was made with ``sequences`` running or waiting: update the need, run with
        it, publish it; returns it."""
        now = time.monotonic() if now is None else now
        if self._planned_at is not None:
            work = (now - self._planned_at) * self._ran_with
            old = self.step_thread_s
            self.step_thread_s = work if old is None else old + EWMA_WEIGHT * (work - old)
        self.need = self._need(sequences)
        if self.need:
            self._threads.apply(self.need)
        self._planned_at = now if sequences else None
        self._ran_with = self._threads.threads
        step_s = (self.step_thread_s or 0.0) / max(self._threads.threads, 1)
        self.ledger.publish(self.need, self._threads.threads, sequences, step_s)
        return self.need

    def _need(self, sequences: int) -> int:
        s = self.settings
        if not sequences:
            return 0
        if s.decode_threads:
            return min(s.decode_threads, s.cores)
        if self.step_thread_s is None:
            return max(self.need, 1)
        budget = s.headroom * s.tpot_target_s
        wanted = math.ceil(self.step_thread_s / budget)
        if wanted < self.need and self.step_thread_s > (self.need - 1) * budget * DOWN_MARGIN:
            wanted = self.need  # not clearly below the next step down: hold
        return min(max(wanted, 1), s.cores)

    def close(self) -> None:
        """Stopped: publish that nothing is needed (prefill takes every core), and remove the
        ledger (a successor in this group makes a new one, which prefill follows)."""
        self.ledger.publish(0, self._threads.threads, 0, 0.0)
        self.ledger.close(unlink=True)


class PrefillCores:
    """Prefill's side: before each chunk (``before_chunk``, on the engine thread), run with
    the node's cores less decode's published need, at least 1; and, while decode's steps have
    time to spare (its published step under LEND_BELOW of its budget), on decode's cores too,
    one more thread a chunk, until its steps reach the budget (RECLAIM_AT: back to the cores
    decode does not need). Nothing published yet, or a publication older than STALE_AFTER_S
    (decode gone): every core."""

    def __init__(self, s: CoreShareSettings, set_threads: Callable[[int], None] | None = None):
        self.settings = s
        self.ledger = CoreLedger(s.ledger)
        self._threads = _ThreadCount(set_threads)
        self.decode_need = 0
        self._lent: int | None = None  # decode's cores prefill runs on too (None: decode idle)

    @property
    def threads(self) -> int:
        return self._threads.threads

    def before_chunk(self) -> int:
        """Read decode's need and step, and set this thread's count; returns the count."""
        published = self.ledger.read()
        fresh = published is not None and published.age_s < STALE_AFTER_S
        self.decode_need = published.need if fresh else 0
        self._threads.apply(self._share(published if self.decode_need else None))
        return self._threads.threads

    def _share(self, published: Published | None) -> int:
        cores = self.settings.cores
        if published is None:  # decode idle or gone: every core, nothing lent to count
            self._lent = None
            return cores
        own = max(1, cores - published.need)
        budget = self.settings.headroom * self.settings.tpot_target_s
        pressure = published.step_s / budget
        if self._lent is None or pressure >= RECLAIM_AT:
            self._lent = 0  # decode just got busy, or its steps reach the budget
        elif 0 < published.step_s and pressure < LEND_BELOW:  # 0: no step measured yet
            self._lent += 1
        self._lent = min(self._lent, cores - own)
        return own + self._lent

    def close(self) -> None:
        self.ledger.close()


# ---- the workers' command lines (python -m prefill_worker / decode_worker) -----------------
def add_core_share_args(parser: argparse.ArgumentParser) -> None:
    d = CoreShareSettings(ledger="")
    g = parser.add_argument_group("core sharing (a node group's prefill and decode worker)")
    g.add_argument("--share-cores-ledger", default=None, help="the group's ledger; none: off")
    g.add_argument("--share-cores-node-cores", type=int, default=d.node_cores)
    g.add_argument("--share-cores-decode-threads", type=int, default=d.decode_threads)
    g.add_argument("--share-cores-tpot-target", type=float, default=d.tpot_target_s)
    g.add_argument("--share-cores-headroom", type=float, default=d.headroom)


def core_share_from_args(args: argparse.Namespace) -> CoreShareSettings | None:
    if not args.share_cores_ledger:
        return None
    return CoreShareSettings(
        ledger=args.share_cores_ledger,
        node_cores=args.share_cores_node_cores,
        decode_threads=args.share_cores_decode_threads,
        tpot_target_s=args.share_cores_tpot_target,
        headroom=args.share_cores_headroom,
    )


def core_share_args(s: CoreShareSettings | None) -> list[str]:
    """The flags ``core_share_from_args`` reads back as ``s``."""
    if s is None:
        return []
    return [
        *("--share-cores-ledger", s.ledger, "--share-cores-node-cores", str(s.node_cores)),
        *("--share-cores-decode-threads", str(s.decode_threads)),
        *("--share-cores-tpot-target", repr(s.tpot_target_s)),
        *("--share-cores-headroom", repr(s.headroom)),
    ]
