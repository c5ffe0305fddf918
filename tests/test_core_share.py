"""Cores lent between a node's prefill and decode worker (engine/core_share.py): the shared
ledger (decode writes, prefill reads), decode's need, and prefill's share, with a recording
stand-in for torch.set_num_threads."""

from __future__ import annotations

import os
import uuid

import pytest

from engine import core_share
from engine.core_share import (
    CoreLedger,
    CoreShareSettings,
    DecodeCores,
    PrefillCores,
    core_share_args,
    core_share_from_args,
    ledger_path,
)


@pytest.fixture
def settings():
    path = ledger_path(f"test-{uuid.uuid4().hex[:8]}", 0)
    yield CoreShareSettings(ledger=path, node_cores=4, tpot_target_s=0.1, headroom=0.5)
    if os.path.exists(path):
        os.unlink(path)


class Recorder:
    def __init__(self):
        self.calls: list[int] = []

    def __call__(self, n: int) -> None:
        self.calls.append(n)


def test_ledger_is_a_small_file_under_dev_shm_named_by_cluster_and_group():
    assert ledger_path("c1", 3) == "/dev/shm/pdserve-cores-c1-3"


def test_a_reader_sees_what_the_writer_published_last(settings):
    writer, reader = CoreLedger(settings.ledger), CoreLedger(settings.ledger)
    assert reader.read() is None  # nothing published yet
    writer.publish(need=3, decode_threads=3, running=7, step_s=0.02)
    writer.publish(need=2, decode_threads=2, running=5, step_s=0.03)
    got = reader.read()
    assert (got.need, got.decode_threads, got.running) == (2, 2, 5)
    assert got.step_s == pytest.approx(0.03)
    assert 0 <= got.age_s < 1
    assert os.path.getsize(settings.ledger) == core_share.LEDGER_BYTES
    writer.close(), reader.close()


def test_a_torn_write_gives_the_last_good_read(settings):
    writer, reader = CoreLedger(settings.ledger), CoreLedger(settings.ledger)
    writer.publish(1, 1, 1, 0.01)
    assert reader.read().need == 1
    # A writer that died mid-write leaves the counter odd: the read is not trusted.
    core_share._SEQ.pack_into(writer._map, core_share._SEQ_OFFSET, 7)
    core_share._LAYOUT.pack_into(writer._map, 0, b"PDCS", 1, 7, 4, 4, 1, 0, 0, 0.0)
    assert reader.read().need == 1
    writer.publish(2, 2, 1, 0.01)  # the next write makes it even again
    assert reader.read().need == 2


def test_reader_follows_a_new_ledger_after_decode_stopped_and_a_successor_started(settings):
    reader = CoreLedger(settings.ledger)
    first = CoreLedger(settings.ledger)
    first.publish(3, 3, 2, 0.01)
    first.close(unlink=True)
    assert reader.read().need == 3  # the old mapping: what it said last
    second = CoreLedger(settings.ledger)
    second.publish(1, 1, 1, 0.01)
    assert reader.read().need == 1


def test_prefill_takes_the_cores_decode_does_not_need_and_at_least_one(settings):
    decode, prefill = CoreLedger(settings.ledger), Recorder()
    cores = PrefillCores(settings, prefill)
    assert cores.before_chunk() == 4  # nothing published: every core
    # Decode's steps at 0.8 of its budget (0.5 x 0.1 s): no time to lend its cores.
    for need, expected in ((0, 4), (1, 3), (3, 1), (4, 1), (2, 2)):
        decode.publish(need, max(need, 1), need, 0.04)
        assert cores.before_chunk() == expected
    assert prefill.calls == [4, 3, 1, 2]  # set only when the count changes
    cores.before_chunk()
    assert prefill.calls == [4, 3, 1, 2]


def test_prefill_runs_on_decodes_cores_too_while_decode_has_time_and_gives_them_back(settings):
    """Budget 0.05 s (0.5 x 0.1): decode's steps under 0.6 of it lend prefill one more thread
    a chunk, up to every core; at the budget prefill is back to the cores decode does not
    need; in between it holds. A decode that just got busy starts from its own cores."""
    decode, prefill = CoreLedger(settings.ledger), Recorder()
    cores = PrefillCores(settings, prefill)
    shares = []
    for need, step_s in (
        (2, 0.01),
        (2, 0.01),
        (2, 0.01),
        (2, 0.01),
        (2, 0.06),
        (2, 0.04),
        (2, 0.02),
        (3, 0.02),
        (0, 0.0),
        (1, 0.01),
    ):
        decode.publish(need, need, 4, step_s)
        shares.append(cores.before_chunk())
    assert shares == [2, 3, 4, 4, 2, 2, 3, 3, 4, 3]
    decode.publish(1, 1, 4, 0.0)  # a step not measured yet: nothing more is lent on it
    assert cores.before_chunk() == 3
    assert cores.settings.cores == 4


def test_a_stale_publication_gives_prefill_every_core(settings, monkeypatch):
    CoreLedger(settings.ledger).publish(3, 3, 1, 0.01)
    cores = PrefillCores(settings, Recorder())
    assert cores.before_chunk() == 1
    later = core_share.time.monotonic_ns() + int(core_share.STALE_AFTER_S * 1e9) + 1
    monkeypatch.setattr(core_share.time, "monotonic_ns", lambda: later)
    assert cores.before_chunk() == 4


def test_decode_needs_nothing_idle_and_the_threads_its_step_time_asks_for(settings):
    threads = Recorder()
    cores = DecodeCores(settings, threads)
    assert cores.on_step(0, now=0.0) == 0  # idle: no need, threads untouched
    assert threads.calls == []
    assert cores.on_step(4, now=1.0) == 1  # busy, nothing measured yet: 1
    # A step at 1 thread took 0.12 s: 0.12 thread-seconds over a budget of 0.5 x 0.1 s: 3.
    assert cores.on_step(4, now=1.12) == 3
    assert threads.calls == [1, 3]
    reader = CoreLedger(settings.ledger).read()
    assert (reader.need, reader.decode_threads, reader.running) == (3, 3, 4)
    # Steps at 3 threads now take 0.01 s (0.03 thread-s): the average falls, the need with it.
    t = 1.12
    for _ in range(30):
        t += 0.01
        cores.on_step(4, now=t)
    assert cores.need == 1
    assert cores.on_step(0, now=t + 0.01) == 0  # the batch finished
    assert CoreLedger(settings.ledger).read().need == 0


def test_decode_need_is_bounded_by_the_node_and_can_be_fixed(settings):
    cores = DecodeCores(settings, Recorder())
    cores.on_step(1, now=0.0)
    assert cores.on_step(1, now=10.0) == 4  # a 10 s step: never more than the node's cores
    fixed = DecodeCores(CoreShareSettings(settings.ledger, node_cores=4, decode_threads=2))
    fixed._threads._set = Recorder()
    assert [fixed.on_step(n, now=float(i)) for i, n in enumerate((0, 3, 3, 0))] == [0, 2, 2, 0]


def test_decode_close_hands_every_core_to_prefill_and_removes_the_ledger(settings):
    decode = DecodeCores(settings, Recorder())
    prefill = PrefillCores(settings, Recorder())
    decode.on_step(2, now=0.0)
    decode.on_step(2, now=1.0)
    assert prefill.before_chunk() == 0 + 1  # decode needs all 4 of them
    decode.close()
    assert not os.path.exists(settings.ledger)
    assert prefill.before_chunk() == 4


def test_settings_travel_on_the_workers_command_line(settings):
    import argparse

    parser = argparse.ArgumentParser()
    core_share.add_core_share_args(parser)
    assert core_share_from_args(parser.parse_args([])) is None
    assert core_share_from_args(parser.parse_args(core_share_args(settings))) == settings
