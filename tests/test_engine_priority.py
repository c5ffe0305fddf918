"""A pool's ``nice``: each of its workers' engine threads (where the forwards run) runs at that
niceness, so the pool lends its CPU to the other pool on the machine; its RPC threads keep the
process's own, and the tokens are the same."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from engine.loop import EngineThread
from pdserve.cluster.local import ClusterSpec, LocalCluster
from tests.cluster_utils import assert_all_blocks_free, generate_concurrently
from tests.conftest import tiny_llama_dir
from tests.test_disagg import NEW_TOKENS, engine_reference, mixed_prompts

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="a thread's own niceness is Linux's"
)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("nice"), num_heads=4, num_kv_heads=2, layers=2)
    return path


def niceness(tid: int | None = None) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid or threading.get_native_id())


def test_the_engine_thread_and_threads_it_starts_run_at_its_niceness():
    base = niceness()
    seen: list[int] = []
    done = threading.Event()

    def step() -> bool:
        if not done.is_set():
            seen.append(niceness())
            child = threading.Thread(target=lambda: seen.append(niceness()))
            child.start()
            child.join()
            done.set()
        return False

    loop = EngineThread(step, on_error=lambda e: None, name="t-engine", nice=5)
    loop.start()
    assert done.wait(10)
    loop.stop()
    assert seen == [min(19, base + 5)] * 2
    assert niceness() == base  # the thread that started it (an RPC thread's parent) keeps its own


def test_a_decode_pool_at_nice_10_runs_its_engine_there_and_serves_the_same_tokens(tiny_model):
    prompts = mixed_prompts(8, seed=4)
    ref = engine_reference(tiny_model, prompts)
    base = niceness()
    spec = ClusterSpec(
        model=str(tiny_model),
        num_blocks=512,
        max_model_len=256,
        pools={"decode": {"nice": 10}},
    )
    with LocalCluster(spec) as cluster:
        engines = {t.name: t.native_id for t in threading.enumerate() if t.name.endswith("-engine")}
        by_role = {
            role: {niceness(tid) for name, tid in engines.items() if name.startswith(role)}
            for role in ("prefill", "decode")
        }
        requests = [dict(token_ids=p, max_tokens=NEW_TOKENS, ignore_eos=True) for p in prompts]
        outs = generate_concurrently(cluster, requests)
        assert_all_blocks_free(cluster)
    assert by_role == {"prefill": {base}, "decode": {min(19, base + 10)}}
    assert [o.token_ids for o in outs] == ref
    assert niceness() == base  # in-process workers: the test's own thread is not lowered
