"""A tensor-parallel engine's ranks: rank 0 is the engine's own process (scheduler, sampler,
block bookkeeping, the logits) and spawns k - 1 followers, each running the same forward on its
shard (engine/tensor_parallel.py). One engine step stays one step: rank 0 sends the step's plan
to every follower, then all run the forward and meet in two all-reduces per layer.

Control and data take different roads. The plan (input ids, query and sequence lengths, block
tables: what ``ModelRunner.inputs`` builds a forward from) goes to each follower over its own
pipe as msgpack bytes (no pickle), so an idle engine keeps no collective open: a follower waits
on its pipe as long as rank 0 lives, and a pipe that closes (rank 0 gone, even by SIGKILL) ends
the follower. The all-reduces run on one process group (gloo on CPU, NCCL on CUDA: the same
calls) built directly on a TCPStore at ``tp_host`` (127.0.0.1 by default) with a collective
timeout, and no global ``init_process_group``.

Failure: a follower that exits is seen before the next step; one that dies or hangs inside a
step makes rank 0's all-reduce fail (a closed peer at once, a hung one at the timeout). Either
way rank 0's step raises ``TensorParallelError`` naming the rank, every later step raises it at
once, and rank 0 tears the other followers down (their pipes closed, then killed after a
grace): ranks that were mid-collective cannot be matched up again. The same holds for any error
inside a TP forward: one rank's failure is the engine's.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from dataclasses import replace

import msgpack
import torch
import torch.distributed as dist

from engine.model_runner import ModelRunner, plan_lists
from engine.settings import EngineSettings, LoadedModel, load_model_once
from engine.shared_kv_cache import SharedKVCache, map_shared
from engine.tensor_parallel import TPShard, check_tensor_parallel

log = logging.getLogger("pdserve.engine")

OP_STEP, OP_COPY, OP_STOP, OP_LOADED, OP_ERROR = 1, 2, 3, 4, 5
COLLECTIVE_TIMEOUT_S = 30.0  # a rank that does not join an all-reduce by then is lost
START_TIMEOUT_S = 600.0  # loading a shard and meeting the others
STOP_GRACE_S = 2.0  # a follower still alive this long after its pipe closed is killed
POLL_S = 0.5  # a waiting follower checks that its parent lives this often
LOST_RANK_WAIT_S = 1.0  # after a failed collective, how long to look for the rank that died


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel engine died, hung or failed: the engine cannot step."""


def threads_per_rank(s: EngineSettings) -> int:
    # k ranks on one host share its cores: torch's default (every core) in each would thrash.
    return s.threads or max(1, (os.cpu_count() or 1) // s.tensor_parallel_size)


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cuda:r (cuda:N+r where ``device`` names cuda:N), or the CPU."""
    from engine.loader import resolve_device

    kind, _, index = resolve_device(device).partition(":")
    return f"cuda:{int(index or 0) + rank}" if kind == "cuda" else kind


def make_group(store, rank: int, size: int, device: str, timeout_s: float, host: str):
    timeout = datetime.timedelta(seconds=timeout_s)
    if not device.startswith("cuda"):
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        opts._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, size, opts)
    # NCCL: the same calls; untested here (no GPU with k > 1 on this machine).
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, opts)


def install_all_reduce(model, group) -> None:
    """Sum the row-parallel outputs (o_proj, down_proj) over the ranks, in place, right after
    each is computed: a forward hook, so the layers' code is TP=1's."""

    def reduce(_module, _inputs, out: torch.Tensor) -> torch.Tensor:
        group.allreduce([out]).wait()
        return out

    for layer in model.layers:
        layer.self_attn.o_proj.register_forward_hook(reduce)
        layer.mlp.down_proj.register_forward_hook(reduce)


class FollowerRanks:
    """Rank 0's side: the followers' processes, their pipes, and the group."""

    def __init__(self, s: EngineSettings, cfg, timeout_s: float = COLLECTIVE_TIMEOUT_S):
        self.size, self.host, self.timeout_s = s.tensor_parallel_size, s.tp_host, timeout_s
        self.cfg = cfg  # the whole model's shape: which KV heads each rank holds
        self.device = rank_device(s.device, 0)
        self.broken: str | None = None
        self._failing = threading.Lock()  # the engine thread and the health watch both fail it
        self.group = None
        # Each follower's KV cache, mapped here from its shared-memory file (host caches
        # only): the worker ships and receives every rank's KV slices from rank 0's process.
        self.follower_caches: list = []
        start = datetime.timedelta(seconds=START_TIMEOUT_S)
        self.store = dist.TCPStore(s.tp_host, 0, self.size, True, start, wait_for_workers=False)
        ctx = torch.multiprocessing.get_context("spawn")
        self.procs, self.conns = [], []
        for rank in range(1, self.size):
            here, there = ctx.Pipe()
            args = (rank, s, self.store.port, there, timeout_s, os.getpid())
            proc = ctx.Process(target=follower_main, args=args, name=f"tp-rank-{rank}", daemon=True)
            proc.start()
            there.close()
            self.procs.append(proc)
            self.conns.append(here)

    def join(self, deadline_s: float = START_TIMEOUT_S) -> None:
        """Wait until every follower loaded its shard, then form the group with them."""
        deadline = time.monotonic() + deadline_s
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(POLL_S):
                if not proc.is_alive() or time.monotonic() > deadline:
                    raise TensorParallelError(f"tensor-parallel {self._rank_state(rank)} at start")
            try:
                reply = msgpack.unpackb(conn.recv_bytes())
            except EOFError:  # it died before a word
                proc.join(STOP_GRACE_S)
                raise TensorParallelError(f"tensor-parallel {self._rank_state(rank)} at start")
            if reply[0] != OP_LOADED:
                raise TensorParallelError(f"tensor-parallel rank {rank} failed to load: {reply[1]}")
            if reply[1] is not None:  # its cache's file: mapped before the group forms
                self.follower_caches.append(map_shared(reply[1], reply[2]))
        args = (self.store, 0, self.size, self.device, self.timeout_s, self.host)
        self.group = make_group(*args)

    def send(self, message: list) -> None:
        """One message to every follower (raises if any is gone)."""
        self.check()
        data = msgpack.packb(message)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(data)
            except OSError as e:
                raise self.fail(TensorParallelError(f"{self._rank_state(rank)}: {e}")) from e

    def check(self) -> None:
        """Raise if the ranks cannot step: broken before, or a follower has exited."""
        if self.broken is not None:
            raise TensorParallelError(self.broken)
        if not all(proc.is_alive() for proc in self.procs):
            raise self.fail(TensorParallelError("seen before the step"))

    def fail(self, error: BaseException) -> TensorParallelError:
        """Mark the ranks broken by ``error``, tear the followers down; the error to raise."""
        with self._failing:
            return self._fail(error)

    def _fail(self, error: BaseException) -> TensorParallelError:
        if self.broken is None:
            lost = "; ".join(self._exited_ranks(LOST_RANK_WAIT_S)) or "no rank exited"
            cause = str(error).splitlines()[0][:300] if str(error) else type(error).__name__
            self.broken = f"tensor-parallel engine of {self.size} ranks is down: {lost} ({cause})"
            log.error("%s", self.broken)
            self.close()
        return TensorParallelError(self.broken)

    def _exited_ranks(self, wait_s: float) -> list[str]:
        """The followers that have exited, waiting up to ``wait_s`` for one to show: a rank
        killed mid-step breaks the collective a moment before its exit is seen."""
        deadline = time.monotonic() + wait_s
        while True:
            gone = [r for r, p in enumerate(self.procs, start=1) if not p.is_alive()]
            if gone or time.monotonic() > deadline:
                return [self._rank_state(r) for r in gone]
            time.sleep(0.02)

    def close(self) -> None:
        """Stop every follower: a stop message and their pipes closed, then killed after
        ``STOP_GRACE_S`` (one stuck in a collective never reads its pipe)."""
        for conn in self.conns:
            try:
                conn.send_bytes(msgpack.packb([OP_STOP]))
            except OSError:
                pass
            conn.close()
        self.conns = []
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(STOP_GRACE_S)
        self.broken = self.broken or "tensor-parallel engine closed"

    def rank_status(self) -> list[dict]:
        """Each follower as ``pdserve status`` shows it (rank 0 is the worker's process)."""
        procs = [(r, p.pid, p.is_alive()) for r, p in enumerate(self.procs, start=1)]
        return [{"rank": 0, "pid": os.getpid(), "alive": True}] + [
            {"rank": r, "pid": pid, "alive": alive and self.broken is None}
            for r, pid, alive in procs
        ]

    def _rank_state(self, rank: int) -> str:
        proc = self.procs[rank - 1]
        code = proc.exitcode
        if code is None:
            return f"rank {rank} (pid {proc.pid}) did not answer"
        how = f"signal {-code}" if code < 0 else f"code {code}"
        return f"rank {rank} (pid {proc.pid}) exited with {how}"


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: each forward's plan goes to the followers first."""

    def __init__(self, model, num_blocks: int, block_size: int, kv_dtype: str, ranks):
        super().__init__(model, num_blocks, block_size, kv_dtype)
        self.ranks = ranks

    def prepare(self, batch):
        lists = plan_lists(batch)
        self.ranks.send([OP_STEP, *lists])
        return self.inputs(*lists)

    def execute(self, batch, layer_callback=None) -> torch.Tensor:
        self.ranks.check()
        try:
            return super().execute(batch, layer_callback)
        except Exception as e:  # the ranks' collectives are out of step now: all go
            raise self.ranks.fail(e) from e

    def copy_block(self, src: int, dst: int) -> None:
        self.ranks.send([OP_COPY, src, dst])
        super().copy_block(src, dst)

    def rank_caches(self) -> list[tuple[tuple[int, int], list]]:
        """Every rank's (the model's KV heads [lo, hi) it holds, its cache), rank 0 first."""
        ranks = self.ranks
        if len(ranks.follower_caches) != ranks.size - 1:
            raise TensorParallelError(
                "the followers' KV caches are not mapped here (a cache on a GPU stays in its "
                "rank's process): a tensor-parallel worker ships KV from host caches only"
            )
        caches = [self.kv_caches, *ranks.follower_caches]
        return [(TPShard(r, ranks.size).kv_heads(ranks.cfg), c) for r, c in enumerate(caches)]

    def tensor_parallel_status(self) -> dict:
        return {"size": self.ranks.size, "ranks": self.ranks.rank_status()}

    def problem(self) -> str | None:
        """A lost rank, seen by a step or by the health watch between steps (a follower
        killed while the engine idles): the ranks are torn down then, and the worker reports
        NOT_SERVING so its streams move and the controller replaces it."""
        try:
            self.ranks.check()
        except TensorParallelError as e:
            return str(e)
        return None

    def close(self) -> None:
        self.ranks.close()


def start_tensor_parallel(s: EngineSettings, timeout_s: float = COLLECTIVE_TIMEOUT_S):
    """Rank 0 of ``s``: (the loaded shard, its runner) once every follower has joined."""
    from engine.loader import load_config
    from engine.model_files import resolve_model_dir

    cfg = load_config(resolve_model_dir(s.model, progress=False))  # converts a GGUF once
    check_tensor_parallel(cfg, s.tensor_parallel_size)  # before anything is spawned
    torch.set_num_threads(threads_per_rank(s))
    ranks = FollowerRanks(s, cfg, timeout_s)
    try:
        loaded = load_model_once(_rank_settings(s, 0), shard=TPShard(0, s.tensor_parallel_size))
        ranks.join()
        install_all_reduce(loaded.weights, ranks.group)
        runner = TensorParallelRunner(loaded.weights, s.num_blocks, s.block_size, s.kv_dtype, ranks)
    except BaseException:
        ranks.close()
        raise
    return loaded, runner


def _rank_settings(s: EngineSettings, rank: int) -> EngineSettings:
    return replace(s, device=rank_device(s.device, rank), threads=threads_per_rank(s))


def follower_main(rank, s, port, conn, timeout_s, parent_pid) -> None:
    """A follower process: load the shard, join the group, run rank 0's plans until its pipe
    closes. Exits (never returns to multiprocessing's cleanup, which could wait on gloo)."""
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(threads_per_rank(s))
    try:
        rs = _rank_settings(s, rank)
        loaded: LoadedModel = load_model_once(rs, shard=TPShard(rank, s.tensor_parallel_size))
        runner = ModelRunner(loaded.weights, s.num_blocks, s.block_size, s.kv_dtype)
        shared = None if runner.device.type == "cuda" else SharedKVCache(runner.kv_caches)
        where = [shared.path, shared.layout] if shared is not None else [None, None]
        conn.send_bytes(msgpack.packb([OP_LOADED, *where]))
        start = datetime.timedelta(seconds=START_TIMEOUT_S)
        store = dist.TCPStore(s.tp_host, port, s.tensor_parallel_size, False, start)
        group = make_group(store, rank, s.tensor_parallel_size, rs.device, timeout_s, s.tp_host)
        if shared is not None:  # rank 0 mapped it before forming the group: no one else may
            shared.remove()
        install_all_reduce(loaded.weights, group)
        _follow(conn, runner, parent_pid)
        code = 0
    except BaseException as e:  # noqa: BLE001 - said on the pipe where it can be, then exit
        log.error("tensor-parallel rank %d: %s: %s", rank, type(e).__name__, e)
        try:
            conn.send_bytes(msgpack.packb([OP_ERROR, f"{type(e).__name__}: {e}"]))
        except OSError:
            pass
        code = 1
    os._exit(code)


@torch.inference_mode()
def _follow(conn, runner: ModelRunner, parent_pid: int) -> None:
    while True:
        if not conn.poll(POLL_S):
            if os.getppid() != parent_pid:  # rank 0 gone without closing the pipe
                return
            continue
        try:
            message = msgpack.unpackb(conn.recv_bytes())
        except EOFError:  # rank 0 closed the pipe or died
            return
        op = message[0]
        if op == OP_STOP:
            return
        if op == OP_COPY:
            runner.copy_block(message[1], message[2])
            continue
        input_ids, positions, meta = runner.inputs(*message[1:])
        runner.model(input_ids, positions, meta, runner.kv_caches)
