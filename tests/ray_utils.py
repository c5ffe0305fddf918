"""Helpers for the Ray tests: tiny cluster configs, reference outputs, a steady request stream."""

from __future__ import annotations

import asyncio
import threading
import time

import torch
from typing_extensions import Self

from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from pdserve.client import AsyncClient, Completion
from pdserve.cluster.ray_launcher import start_local_ray
from pdserve.config import ClusterConfig, validate_config

NEW_TOKENS = 8


def init_local_ray() -> str:
    """Ray on this machine for one test module (4 logical CPUs, no dashboard, a small object
    store); returns the GCS address. The caller shuts it down."""
    ctx = start_local_ray(num_cpus=4, object_store_memory=100 * 2**20, log_to_driver=False)
    return ctx.address_info["gcs_address"]


def tiny_config(model_path, **fields) -> ClusterConfig:
    """A cluster on this machine for a tiny model: 1P1D, free ports, no HTTP, and
    ``num_cpus: 0`` so a 2-core machine fits every actor a test starts."""
    pool = {"num_cpus": 0, "threads": 1, "min": 1, "max": 3}
    data = {
        "model": str(model_path),
        "host": "127.0.0.1",
        "grpc_port": 0,
        "http_port": None,
        "num_blocks": 256,
        "max_model_len": 256,
        "health_period_s": 0.5,
        "unreachable_after_s": 6,
        "worker_start_timeout_s": 120,
        "pools": {"prefill": dict(pool), "decode": dict(pool)},
    }
    for key, value in fields.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return validate_config(data)


def make_prompts(n: int, seed: int = 0, vocab: int = 128) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, vocab, (int(k),), generator=g).tolist()
        for k in torch.randint(2, 40, (n,), generator=g)
    ]


def engine_reference(model_path, prompts, max_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Greedy outputs of the single-process engine."""
    engine = LLMEngine.from_model_path(
        model_path, cache=CacheConfig(16, 512), scheduler=SchedulerConfig(), progress=False
    )
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [r.output_token_ids for r in engine.generate(prompts, params)]


async def _generate_all(address: str, prompts, max_tokens: int) -> list[Completion]:
    client = AsyncClient(address)
    try:
        return list(
            await asyncio.gather(
                *(
                    client.generate(
                        token_ids=p, max_tokens=max_tokens, ignore_eos=True, include_timings=True
                    )
                    for p in prompts
                )
            )
        )
    finally:
        await client.close()


def generate(address: str, prompts, max_tokens: int = NEW_TOKENS) -> list[Completion]:
    return asyncio.run(_generate_all(address, prompts, max_tokens))


class SteadyStream:
    """``concurrency`` clients sending requests back to back from a thread until stopped;
    every completion is checked against the reference, every failure kept."""

    def __init__(
        self, address: str, prompts, reference, concurrency: int = 3, max_tokens: int = NEW_TOKENS
    ):
        self.address, self.prompts, self.reference = address, prompts, reference
        self.concurrency, self.max_tokens = concurrency, max_tokens
        self.completed = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)

    async def _run(self) -> None:
        client = AsyncClient(self.address)
        try:
            await asyncio.gather(*(self._loop(client, i) for i in range(self.concurrency)))
        finally:
            await client.close()

    async def _loop(self, client, offset: int) -> None:
        i = offset
        while not self._stop.is_set():
            k = i % len(self.prompts)
            try:
                out = await client.generate(
                    token_ids=self.prompts[k], max_tokens=self.max_tokens, ignore_eos=True
                )
                if out.token_ids != self.reference[k]:
                    self.failures.append(f"prompt {k}: {out.token_ids} != {self.reference[k]}")
                self.completed += 1
            except Exception as e:  # noqa: BLE001 - every failure is a test failure
                self.failures.append(repr(e))
            i += self.concurrency


# These are bounds on "until", not timing assertions: a loaded 2-core CI box (Ray, its
# dashboard and the workers all share it) can be several times slower than an idle one.
WAIT_SCALE = 4


def wait_for(predicate, timeout: float, what: str, period: float = 0.2):
    timeout *= WAIT_SCALE
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(period)


class FakeRemote:
    """A Ray actor method without Ray: ``.remote(*args)`` is an awaitable of ``fn(*args)``."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        async def call():
            return self.fn(*args)

        return call()


class FakeActorClass:
    """``ray.remote(WorkerActor)`` without Ray: records each actor's options and arguments in
    ``made``; its actors are ready at once (an address of their order) and stop."""

    def __init__(self, made: list):
        self.made = made

    def options(self, **options):
        made = self.made

        class Handle:
            def remote(self, *args):
                made.append((options, args))
                info = {"address": f"127.0.0.1:{len(made)}", "node_id": "n1"}
                calls = {"ready": FakeRemote(lambda: info), "stop": FakeRemote(lambda: None)}
                return type("Actor", (), calls)()

        return Handle()
