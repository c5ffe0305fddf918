"""Chaos: 1 prefill + 2 decode workers in their own processes under a steady mixed load of
greedy requests, while KV transfers are delayed, dropped, corrupted and cut (the "faults"
transport), a decode worker is killed (-9) mid-stream, the prefill worker is killed (-9)
mid-prefill, and clients hang up at random.

The cluster goes on with the workers it has left (the local harness does not replace workers;
the Ray controller does, see test_chaos_ray.py): the killed decode worker's streams migrate to
the other one, and with the only prefill worker gone the router has the decode worker prefill
locally. At the end every request its client did not cancel has finished with the greedy output
of an undisturbed run, none hung, and every live worker's blocks are all free.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
from dataclasses import dataclass, field

import grpc
import pytest

from engine.shared_kv_cache import SHM_DIR, sweep_stale
from kv_transfer.transport_faults import INNER_ENV, POLICY_ENV, FaultPolicy
from pdserve.client import build_request
from pdserve.cluster.local import ClusterSpec, LocalCluster
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router.pool import BreakerSettings
from tests.cluster_utils import assert_all_blocks_free
from tests.conftest import tiny_llama_dir
from tests.test_disagg import engine_reference, mixed_prompts

# The load stops AFTER_KILLS requests after the second kill, after ~100-300 requests. It must not
# run out sooner: while its transfers fail, the prefill worker is out of routing for a second at
# a time (the requests prefill on the decode side meanwhile), and the load's requests go by at
# ~50/s, so a plan of a few hundred could end before the prefill worker is back to be killed.
MAX_REQUESTS = 2000
AFTER_KILLS = 16
CONCURRENCY = 8  # requests in flight at any time: a steady load
MAX_NEW_TOKENS = 64
CANCEL_SHARE = 0.2  # clients that hang up mid-stream
REQUEST_BOUND_S = 120  # a request still open after this hung
POLICY = FaultPolicy(
    seed=19, delay_p=0.2, delay_s=0.02, drop_p=0.04, corrupt_p=0.04, disconnect_p=0.01
)


@dataclass
class Planned:
    prompt: list[int]
    max_tokens: int
    cancel_after: int | None  # tokens after which the client hangs up; None: it reads to the end
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    error: str | None = None
    sent: bool = False


def plan_requests(rng: random.Random) -> list[Planned]:
    prompts = [p[:80] for p in mixed_prompts(MAX_REQUESTS, seed=61)]
    out = []
    for prompt in prompts:
        n = rng.randint(24, MAX_NEW_TOKENS)
        cancel = rng.randint(1, n - 1) if rng.random() < CANCEL_SHARE else None
        out.append(Planned(prompt, n, cancel))
    return out


class Load:
    """CONCURRENCY clients sending the planned requests back to back until ``stop``."""

    def __init__(self, address: str, planned: list[Planned]):
        self.planned = planned
        self.done = 0
        self.streaming: dict[int, int] = {}  # in-flight request -> tokens so far
        self.stop = asyncio.Event()
        self._next = 0
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = pb_grpc.GenerationStub(self._channel)

    @property
    def ran_out(self) -> bool:
        return self._next >= len(self.planned)

    async def run(self) -> None:
        try:
            await asyncio.gather(*(self._client() for _ in range(CONCURRENCY)))
        finally:
            await self._channel.close()

    async def _client(self) -> None:
        while not self.stop.is_set() and self._next < len(self.planned):
            i, self._next = self._next, self._next + 1
            p = self.planned[i]
            p.sent = True
            try:
                await asyncio.wait_for(self._request(i), REQUEST_BOUND_S)
            except TimeoutError:
                p.error = f"hung for {REQUEST_BOUND_S} s"
            except grpc.aio.AioRpcError as e:
                p.error = f"{e.code().name}: {e.details()}"
            finally:
                self.streaming.pop(i, None)
                self.done += 1

    async def _request(self, i: int) -> None:
        p = self.planned[i]
        req = build_request(token_ids=p.prompt, max_tokens=p.max_tokens, ignore_eos=True)
        call = self._stub.Generate(req)
        self.streaming[i] = 0
        async for chunk in call:
            p.tokens.extend(chunk.token_ids)
            p.finish_reason = chunk.finish_reason or p.finish_reason
            self.streaming[i] = len(p.tokens)
            if p.cancel_after is not None and len(p.tokens) >= p.cancel_after:
                call.cancel()  # the client hangs up
                return


async def until(load: Load, predicate, what: str, timeout: float = 120.0, period: float = 0.01):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert not load.ran_out, f"the load ran out of requests waiting for {what}"
        late = asyncio.get_running_loop().time() >= deadline
        assert not late, f"timed out waiting for {what} ({load.done} requests done)"
        await asyncio.sleep(period)


async def run_chaos(load: Load, decode, prefill, transfer_failures) -> list[int]:
    """kill -9 the decode worker while streams run there; once transfer faults have sent
    requests around again (``transfer_failures()``), kill -9 the prefill worker while a Prefill
    call waits for its first token there; then AFTER_KILLS more requests. Returns the in-flight
    streams' token counts at the first kill."""
    await until(load, lambda: load.done >= 24, "a first share of the load")
    decode_proc, decode_address = decode
    async with grpc.aio.insecure_channel(decode_address) as channel:
        status = pb_grpc.DecodeWorkerStub(channel).Status
        while (await status(pb.StatusRequest(), timeout=5)).num_running < 2:
            await asyncio.sleep(0.005)  # until streams run there (its own word, not a poll's)
        streams_at_kill = sorted(load.streaming.values())
        decode_proc.send_signal(signal.SIGKILL)
    await until(load, lambda: load.done >= 72 and transfer_failures() >= 2, "transfer faults")
    prefill_proc, prefill_handle = prefill
    in_flight = "a prefill in flight"
    await until(load, lambda: prefill_handle.inflight_requests > 0, in_flight, period=0.001)
    prefill_proc.send_signal(signal.SIGKILL)
    done = load.done
    await until(load, lambda: load.done >= done + AFTER_KILLS, "the load to go on")
    load.stop.set()
    return streams_at_kill


@pytest.mark.slow
@pytest.mark.parametrize("inner", ["grpc", "shm"])  # shm: a killed worker of a shared pair
def test_chaos_every_request_not_cancelled_finishes_exactly(tmp_path, caplog, inner):
    caplog.set_level(logging.WARNING, logger="pdserve.router")
    model, _ = tiny_llama_dir(tmp_path, num_kv_heads=2, seed=8)
    planned = plan_requests(random.Random(5))
    spec = ClusterSpec(
        model=str(model),
        num_decode=2,
        kv_transport="faults",
        separate_processes=True,
        threads_per_worker=1,
        num_blocks=512,
        max_model_len=256,
        extra_env={POLICY_ENV: POLICY.encode(), INNER_ENV: inner},
    )
    with LocalCluster(spec) as cluster:
        # Transfers fail often here (every kind of fault, on purpose): room for them, on top
        # of the kills, so that no request runs out of migrations. The limit's own test is
        # test_faults_cluster.py.
        cluster.router.flow.cfg.max_migrations = 12
        prefill_proc, decode_proc = cluster._procs[0], cluster._procs[1]
        cache_file = f"pdserve-kv-{decode_proc.pid}-"  # shm: the decode worker's cache
        assert (inner == "shm") == any(n.startswith(cache_file) for n in os.listdir(SHM_DIR))
        prefill_address, decode_address = cluster.prefill_addresses[0], cluster.decode_addresses[0]
        prefill_handle = cluster.router.prefill.workers[prefill_address]
        # The only prefill worker fails many transfers on purpose; the breaker's cool-down is
        # shortened so that it keeps coming back to be killed mid-prefill (the breaker has its
        # own test, test_circuit_breaker.py).
        prefill_handle.breaker = BreakerSettings(failures=3, cooldown_s=1.0)
        decode = (decode_proc, decode_address)

        def transfer_failures() -> int:  # attempts the router sent around again for them
            return sum("KV transfer failed" in r.getMessage() for r in caplog.records)

        async def chaos():
            load = Load(cluster.address, planned)
            running = asyncio.ensure_future(load.run())
            try:
                prefill = (prefill_proc, prefill_handle)
                return await run_chaos(load, decode, prefill, transfer_failures)
            finally:
                load.stop.set()
                await running

        streams_at_kill = asyncio.run(chaos())

        hung = [p.error for p in planned if p.error and p.error.startswith("hung")]
        assert not hung, hung
        assert max(streams_at_kill) < MAX_NEW_TOKENS  # the decode worker died mid-stream
        router = cluster.servers.router
        assert router.metrics.migrations._value.get() >= 1
        migrations = [r.getMessage() for r in caplog.records if "migrating" in r.getMessage()]
        assert any(decode_address in m for m in migrations)  # the killed worker's streams
        assert_all_blocks_free(cluster, timeout=30, dead={prefill_address, decode_address})
        assert router.inflight == 0
    if inner == "shm":  # the killed decode worker could not remove its cache file: swept
        sweep_stale()  # (or by any other shm worker started since on this node)
        assert not [n for n in os.listdir(SHM_DIR) if n.startswith(cache_file)]

    # The reference after the cluster is gone: it would compete with it for the CPUs.
    sent = [(i, p) for i, p in enumerate(planned) if p.sent]
    assert len(sent) < MAX_REQUESTS  # the load ran on until after the kills, then stopped
    reference = engine_reference(model, [p.prompt for _, p in sent], new_tokens=MAX_NEW_TOKENS)
    for (i, p), ref in zip(sent, reference, strict=True):
        if p.cancel_after is None:
            assert p.error is None, (i, p.error)
            assert (p.finish_reason, p.tokens) == ("length", ref[: p.max_tokens]), i
        else:  # what it got before hanging up is what it would have got
            assert p.tokens == ref[: len(p.tokens)], i
