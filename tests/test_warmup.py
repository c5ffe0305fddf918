"""Workers warm up before they serve: every path runs once, and nothing of it stays behind."""

from __future__ import annotations

import pytest

from decode_worker.worker import DecodeWorker
from engine.request import SamplingParams
from engine.warmup import WARMUP_DECODE_STEPS, warm_up, warmup_prompts
from prefill_worker.worker import PrefillWorker
from tests.cluster_utils import assert_all_blocks_free
from tests.conftest import tiny_llama_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("tiny"))
    return path


def test_warm_up_runs_a_chunk_sized_prefill_and_short_prompts(tiny_dir, make_engine):
    engine = make_engine(tiny_dir, max_num_batched_tokens=64)
    prompts = warmup_prompts(engine)
    assert [len(p) for p in prompts] == [64, 37, 9, 1]
    steps = []
    original = engine.runner.execute

    def counting_execute(batch, *args):
        steps.append(sorted(s.num_new_tokens for s in batch))
        return original(batch, *args)

    engine.runner.execute = counting_execute
    seconds = warm_up(engine)
    assert seconds > 0
    assert steps[0] == [64]  # the whole chunk budget in one prefill
    assert any(len(s) > 1 and max(s) > 1 and min(s) == 1 for s in steps)  # a mixed batch
    decode_sizes = {len(s) for s in steps if max(s) == 1}
    assert len(decode_sizes) > 1  # decode at more than one batch size
    assert engine.blocks.num_free == engine.blocks.num_total
    assert not engine.requests and not engine.has_unfinished()


def test_warm_up_leaves_no_prefix_cache_entries_or_counts(tiny_dir, make_engine):
    engine = make_engine(tiny_dir)
    warm_up(engine)
    assert engine.blocks.prefix_hit_tokens == engine.blocks.prefix_query_tokens == 0
    # A real prompt equal to a warm-up prompt finds nothing cached.
    [long_prompt, *_] = warmup_prompts(engine)
    assert engine.blocks.match_prefix(long_prompt, len(long_prompt) // 16) == []


def test_greedy_output_is_the_same_after_warm_up(tiny_dir, make_engine):
    prompt = [5, 9, 2, 7, 1, 3, 8] * 5
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    cold = make_engine(tiny_dir)
    [expected] = cold.generate([prompt], sampling)
    warm = make_engine(tiny_dir)
    warm_up(warm)
    [got] = warm.generate([prompt], sampling)
    assert got.output_token_ids == expected.output_token_ids


def test_a_pool_too_small_for_every_warm_up_prompt_still_warms_up(tiny_dir, make_engine):
    engine = make_engine(tiny_dir, block_size=16, num_blocks=6, max_num_batched_tokens=512)
    prompts = warmup_prompts(engine)
    needed = sum(engine.blocks.blocks_needed(len(p) + WARMUP_DECODE_STEPS) for p in prompts)
    assert prompts and needed <= 6
    warm_up(engine)
    assert engine.blocks.num_free == 6


@pytest.mark.parametrize("worker_class", [PrefillWorker, DecodeWorker])
def test_workers_warm_up_before_their_engine_thread_starts(tiny_dir, make_engine, worker_class):
    worker = worker_class(make_engine(tiny_dir))
    assert worker.warmup_s is None
    worker.start()
    try:
        assert worker.warmup_s > 0
        status = worker.status()
        assert status["num_free_blocks"] == status["num_total_blocks"]
        assert status["num_running"] == status["num_waiting"] == 0
    finally:
        worker.stop()


def test_router_warm_up_sends_one_request_down_the_flow_and_one_over_http(tiny_dir):
    from pdserve.cluster.local import ClusterSpec, LocalCluster
    from router.warmup import warm_up_router

    spec = ClusterSpec(model=str(tiny_dir), num_blocks=64, max_model_len=128, http_port=0)
    with LocalCluster(spec) as cluster:
        router = cluster.servers.router
        success = router.metrics.success
        before = sum(
            s.value for m in success.collect() for s in m.samples if s.name.endswith("_total")
        )
        assert cluster.run(warm_up_router(cluster.servers), timeout=120) > 0
        after = sum(
            s.value for m in success.collect() for s in m.samples if s.name.endswith("_total")
        )
        assert after - before == 2  # through the flow, and through the HTTP front door
        served = [w.served_requests for w in router.prefill.workers.values()]
        assert sum(served) == 2
        assert_all_blocks_free(cluster)


def test_router_warm_up_without_ready_workers_gives_up_quietly(tiny_dir):
    import asyncio

    from router.app import start_router
    from router.settings import RouterSettings
    from router.warmup import warm_up_router

    async def scenario() -> float:
        servers = await start_router(RouterSettings(str(tiny_dir)), [], [])
        try:
            return await warm_up_router(servers, ready_timeout_s=0.2)
        finally:
            await servers.stop()

    assert asyncio.run(scenario()) == 0.0
