"""Core sharing through the workers' step hooks (engine/core_share.py): a prefill worker's
forward runs with the node's cores less what its decode partner published at its last step,
and both report their share in Status."""

from __future__ import annotations

import os
import threading
import uuid

import pytest
import torch

from decode_worker.worker import DecodeWorker
from engine.core_share import CoreShareSettings, DecodeCores, PrefillCores, ledger_path
from engine.request import SamplingParams
from prefill_worker.worker import PrefillWorker
from protos import pdserve_pb2 as pb
from tests.conftest import tiny_llama_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("cores"), seed=4)
    return path


@pytest.fixture
def share():
    path = ledger_path(f"test-{uuid.uuid4().hex[:8]}", 0)
    # Decode takes 2 of 3 cores whenever it has sequences, and its steps never have time to
    # spare (a TPOT target of 1 ns): prefill borrows none of them (tests/test_core_share.py).
    yield CoreShareSettings(ledger=path, node_cores=3, decode_threads=2, tpot_target_s=1e-9)
    if os.path.exists(path):
        os.unlink(path)


class NoTransfer:
    """A KV stream that drops every frame: these tests look at the forward only."""

    def __init__(self, request_id: str):
        self.request_id = request_id

    def send_layer(self, *args) -> None:
        pass

    def abort(self) -> None:
        pass


def prefill_threads(worker: PrefillWorker, request_id: str) -> set[int]:
    """Prefill one prompt on a thread of its own, as the engine thread would (torch's count is
    per thread), and return the torch thread counts its layers ran with."""
    seen: set[int] = set()
    worker.on_layer_computed = lambda layer, ids: seen.add(torch.get_num_threads())
    job = worker.submit(
        request_id, [5, 6, 7, 8, 9, 10], [], SamplingParams(max_tokens=1), NoTransfer(request_id), 4
    )

    def engine_thread():
        while worker.step_loop.step():
            pass

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join(30)
    job.events.get(timeout=5)
    worker.finish_transfer(job)
    return seen


def test_prefill_forward_runs_with_the_cores_decode_does_not_need(tiny, make_engine, share):
    decode = DecodeWorker(make_engine(tiny, num_blocks=64))
    decode_threads: list[int] = []  # decode steps on this test's thread: recorded, not set
    decode.cores = DecodeCores(share, decode_threads.append)
    prefill = PrefillWorker(make_engine(tiny, num_blocks=64))
    prefill.cores = PrefillCores(share)

    decode.step_loop.step()  # idle: needs nothing
    assert prefill_threads(prefill, "a") == {3}

    params = pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    decode.submit_local("d", [5, 6, 7], [], params)
    decode.step_loop.step()  # a sequence: needs 2 and runs with them
    assert decode_threads == [2]
    assert prefill_threads(prefill, "b") == {1}
    assert prefill.status()["threads"] == 1
    assert decode.status()["threads"] == 2
    assert prefill.status()["node_cores"] == decode.status()["node_cores"] == 3

    while decode.step_loop.step():  # the sequence finishes; the next plan is empty
        pass
    assert prefill_threads(prefill, "c") == {3}
    assert decode.blocks.num_free == decode.blocks.num_total
    assert prefill.blocks.num_free == prefill.blocks.num_total

    decode.stop(), prefill.stop()  # decode's stop removes the ledger
    assert not os.path.exists(share.ledger)


def test_a_worker_that_shares_nothing_reports_its_built_threads(tiny, make_engine):
    worker = DecodeWorker(make_engine(tiny, num_blocks=64))
    st = worker.status()
    assert st["node_cores"] == 0 and st["threads"] == 0  # not started: nothing measured
    assert pb.WorkerStatus(**st).node_cores == 0
