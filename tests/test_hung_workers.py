"""Hung is lost (issue 46), with workers as processes: a worker frozen by SIGSTOP keeps its
sockets open, so no call breaks; the router's deadlines (a first token's budget, then one per
token) end its attempts as HUNG, the streams migrate with their tokens, and every stream
finishes with the exact greedy text of an undisturbed run. The deadlines are short here (set
through the router's settings); the defaults stay generous."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator

import pytest

from pdserve.cluster.local import ClusterSpec, LocalCluster
from tests.cluster_utils import assert_all_blocks_free
from tests.conftest import tiny_llama_dir
from tests.test_disagg import engine_reference, mixed_prompts
from tests.test_liveness import LIVENESS, stream_all, wait_for

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("hung"), num_kv_heads=2, seed=5)
    return path


def _spec(tiny_model, **kw) -> ClusterSpec:
    fields = {"num_blocks": 256, "max_model_len": 512, "router": LIVENESS, **kw}
    return ClusterSpec(
        model=str(tiny_model), separate_processes=True, threads_per_worker=1, **fields
    )


class Frozen:
    """SIGSTOP a worker process once (``freeze``); see ``frozen``."""

    def __init__(self, proc):
        self.proc = proc
        self.at: float | None = None

    def freeze(self) -> None:
        if self.at is None:
            self.at = time.monotonic()
            os.kill(self.proc.pid, signal.SIGSTOP)


@contextlib.contextmanager
def frozen(proc) -> Iterator[Frozen]:
    """A Frozen for ``proc``, SIGCONT on the way out whatever happened (the cluster's stop
    then ends it like any other worker)."""
    f = Frozen(proc)
    try:
        yield f
    finally:
        if f.at is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)


def _check_router(cluster: LocalCluster, role: str, address: str) -> None:
    """The server stays healthy; the frozen worker is out of routing."""
    router = cluster.router
    assert router.ready
    pool = router.prefill if role == "prefill" else router.decode
    handle = pool.workers[address]
    wait_for(lambda: not handle.routable, 15, f"frozen {role} worker out of routing")
    assert router.metrics.migrations._value.get() >= 1


def test_a_decode_worker_frozen_mid_stream_loses_no_stream(tiny_model):
    prompts = [p[:40] for p in mixed_prompts(6, seed=21)]
    reference = engine_reference(tiny_model, prompts, new_tokens=NEW_TOKENS)
    with LocalCluster(_spec(tiny_model, num_decode=2)) as cluster:
        address = cluster.decode_addresses[0]
        with frozen(cluster._procs[cluster.spec.num_prefill]) as victim:

            def freeze_once_all_stream(counts):
                if min(counts) >= 4:
                    victim.freeze()

            outs, reasons = asyncio.run(
                stream_all(cluster.address, prompts, freeze_once_all_stream, NEW_TOKENS)
            )
            print(f"streams done {time.monotonic() - victim.at:.1f} s after the freeze")
            assert victim.at is not None and time.monotonic() - victim.at < 90
            assert reasons == ["length"] * len(prompts)
            assert outs == reference
            _check_router(cluster, "decode", address)
            assert_all_blocks_free(cluster, dead={address})
        # Thawed, it gets its cancelled streams' aborts and frees every block too.
        assert_all_blocks_free(cluster, timeout=30)


def test_a_prefill_worker_frozen_mid_prefill_loses_no_request(tiny_model):
    # Prompts long enough to take the transfer path (not prefilled on the decode side).
    prompts = [p * 4 for p in mixed_prompts(6, seed=33)]
    reference = engine_reference(tiny_model, prompts, new_tokens=NEW_TOKENS)
    with LocalCluster(_spec(tiny_model, num_prefill=2)) as cluster:
        address = cluster.prefill_addresses[0]
        handle = cluster.router.prefill.workers[address]
        with frozen(cluster._procs[0]) as victim:

            async def freeze_while_it_prefills():
                # The moment the router has a Prefill in flight there: frozen mid-prefill.
                while handle.inflight_requests == 0:
                    await asyncio.sleep(0.001)
                victim.freeze()

            async def run():
                watcher = asyncio.ensure_future(freeze_while_it_prefills())
                try:
                    return await stream_all(cluster.address, prompts, lambda c: None, NEW_TOKENS)
                finally:
                    watcher.cancel()

            outs, reasons = asyncio.run(run())
            print(f"streams done {time.monotonic() - victim.at:.1f} s after the freeze")
            assert victim.at is not None, "no Prefill went to the first prefill worker"
            assert time.monotonic() - victim.at < 90
            assert reasons == ["length"] * len(prompts)
            assert outs == reference
            _check_router(cluster, "prefill", address)
            assert_all_blocks_free(cluster, dead={address})
            print(f"checked {time.monotonic() - victim.at:.1f} s after the freeze")
        assert_all_blocks_free(cluster, timeout=30)
        print(f"thawed, free {time.monotonic() - victim.at:.1f} s after the freeze")
