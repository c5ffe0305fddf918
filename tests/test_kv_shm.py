"""The shm KV transport: the decode side's cache in a shared-memory file, a sender that copies
each layer's blocks straight into the leased blocks and commits over the authenticated
control connection. Exact bytes; a refused commit for anything wrong (positions outside the
lease, bytes in the leased blocks that are not what the sender copied, a flipped header bit,
an expired lease); nothing for a peer without the cluster token; leased blocks counted as
written until their writer settles (tests/test_kv_shm_cache.py: the cache file itself)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from grpc_plumbing.auth import OpenBindError
from kv_transfer.lease import LeaseTable
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import TransferError, make_sender, start_receiver_server
from kv_transfer.torch_dist.handshake import HandshakeError
from kv_transfer.transport_faults import FaultPolicy
from tests.one_sided_receiver import (
    BLOCKS,
    LAYERS,
    TOKEN,
    kv_cache,
    receivers,
    refuses_a_write_into_the_leases_cached_blocks,
    refuses_an_incomplete_commit,
)


@pytest.fixture
def rx():
    yield from receivers("shm")


def _until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_blocks_land_in_the_lease_and_chunks_rewrite_a_partial_block(rx):
    r = rx()
    sender = r.sender()
    lease = r.leases.open("req", [9, 3, 12])
    stream = sender.open_stream("req", lease.lease_id)
    for layer, (k, v) in enumerate(r.src):  # a first chunk: blocks 0-1, the second partial
        stream.send_layer(layer, [5, 6], [0, 1], k, v)
    for layer, (k, v) in enumerate(r.src):  # the next chunk rewrites position 1, adds 2
        stream.send_layer(layer, [8, 1], [1, 2], k, v)
    stats = stream.commit(timeout=20)
    assert lease.is_committed and stats.frames == 2 * LAYERS
    r.assert_arrived([5, 8, 1], [9, 3, 12])
    outside = [b for b in range(BLOCKS) if b not in (9, 3, 12)]
    assert all(not k[outside].any() and not v[outside].any() for k, v in r.dst)
    assert r.receiver.bytes_received == stats.bytes > 0


def test_runs_of_blocks_land_exactly(rx):
    r = rx()
    src, dst = [2, 3, 4, 9, 10, 0], [5, 6, 7, 8, 11, 12]
    lease, _ = r.transfer(r.sender(), "runs", src, dst)
    assert lease.is_committed
    r.assert_arrived(src, dst)
    outside = [b for b in range(BLOCKS) if b not in dst]
    assert all(not k[outside].any() and not v[outside].any() for k, v in r.dst)


def test_a_write_into_the_leases_cached_blocks_is_refused(rx):
    refuses_a_write_into_the_leases_cached_blocks(rx())


def test_an_incomplete_commit_is_refused(rx):
    refuses_an_incomplete_commit(rx())


def test_a_write_outside_the_lease_is_refused(rx):
    r = rx()
    sender = r.sender()
    # 1. The sender names a position past the lease: nothing is copied, the stream fails.
    lease = r.leases.open("past", [1, 2])
    stream = sender.open_stream("past", lease.lease_id)
    stream.send_layer(0, [3], [2], *r.src[0])
    with pytest.raises(TransferError, match="outside lease"):
        stream.commit(timeout=20)
    assert all(not k.any() for k, _ in r.dst)
    # 2. A sender that copied into another lease's blocks and commits this one: the leased
    #    blocks do not hold what it hashed, so the commit is refused.
    victim, other = r.leases.open("victim", [8, 9]), r.leases.open("other", [13, 14])
    stream = sender.open_stream("victim", victim.lease_id)
    channel = stream._channel  # a hostile sender: it aims at the other lease's blocks
    channel._fetch_blocks()
    other_channel = sender._link.open_channel("other", other.lease_id)
    other_channel._fetch_blocks()
    channel._blocks = other_channel._blocks
    for layer, (k, v) in enumerate(r.src):
        stream.send_layer(layer, [4, 5], [0, 1], k, v)
    with pytest.raises(TransferError, match="digest"):
        stream.commit(timeout=20)
    assert not victim.is_committed and victim.commit_refused
    # 3. A commit naming positions past its lease is refused.
    lease = r.leases.open("forged", [6, 7])
    stream = sender.open_stream("forged", lease.lease_id)
    for layer, (k, v) in enumerate(r.src):
        stream.send_layer(layer, [4, 5], [0, 1], k, v)
    stream._channel._writes.append((0, [5]))
    with pytest.raises(TransferError, match="outside lease"):
        stream.commit(timeout=20)
    assert not lease.is_committed
    r.assert_still_serving()


def test_bytes_changed_in_the_leased_blocks_fail_the_digest(rx):
    """KV in the leased blocks that is not what the sender copied (damaged after the copy,
    or reported damaged by the faults transport) fails the commit."""
    r = rx()
    lease = r.leases.open("req", [5, 6])
    stream = r.sender().open_stream("req", lease.lease_id)
    for layer, (k, v) in enumerate(r.src):
        stream.send_layer(layer, [1, 2], [0, 1], k, v)
    _until(lambda: torch.equal(r.dst[-1][1][6], r.src[-1][1][2]))  # the last copy is done
    r.dst[1][1][6].view(-1).view(torch.uint8)[3] ^= 0x10  # one bit of one cell of the lease
    with pytest.raises(TransferError, match="digest"):
        stream.commit(timeout=20)
    assert not lease.is_committed and "digest" in lease.commit_refused
    faulty = rx(inner="shm", policy=FaultPolicy(seed=3, corrupt_p=0.5, corrupt_header_share=1.0))
    refused = 0
    for i in range(6):  # seed 3: some writes damaged with a clean commit among them
        try:
            lease, _ = faulty.transfer(faulty.sender(), f"r{i}", [1, 2], [5, 6])
            faulty.leases.close(lease.lease_id)
        except TransferError as e:
            assert "digest" in str(e) or "header checksum" in str(e)
            refused += "digest" in str(e)
    assert refused >= 1
    faulty.assert_still_serving()


def test_a_flipped_header_bit_is_refused(rx):
    r = rx(inner="shm", policy=FaultPolicy(seed=3, corrupt_p=1.0, corrupt_header_share=1.0))
    with pytest.raises(TransferError, match="header checksum mismatch"):
        r.transfer(r.sender(), "req", [1, 2], [5, 6])
    assert r.receiver.frames_rejected == 1 and r.receiver.frames_accepted == 0
    (lease,) = r.leases._leases.values()
    assert not lease.is_committed
    _until(lambda: lease.writes_may_land_until() is None)  # its commit settled it anyway
    r.assert_still_serving()


def test_a_commit_for_an_expired_lease_is_refused(rx):
    r = rx()

    def expire(stream):
        time.sleep(1.6)
        assert [x.lease_id for x in r.receiver.pop_expired()] == [stream.lease_id]

    with pytest.raises(TransferError, match="unknown lease"):
        r.transfer(r.sender(), "req", [1, 2], [5, 6], ttl_s=1.5, before_commit=expire)
    r.assert_still_serving()


def test_a_peer_without_the_token_gets_nothing(rx, monkeypatch):
    """No cache file name, no layout, no block ids: the handshake fails before the hello."""
    import kv_transfer.shm.transport as shm_transport

    mapped = []
    monkeypatch.setattr(shm_transport, "map_shared", lambda *a: mapped.append(a))
    r = rx()
    for token in (None, "wrong-token"):
        with pytest.raises(HandshakeError):
            r.sender(token=token)
    assert not mapped
    monkeypatch.undo()
    r.assert_still_serving()


def test_no_serving_off_loopback_without_the_token(tmp_path):
    leases = LeaseTable(default_ttl_s=30.0, num_layers=LAYERS)
    with pytest.raises(OpenBindError, match="without a cluster token"):
        start_receiver_server(
            "shm", KVReceiver(kv_cache(True), leases), "0.0.0.0", 0, shm_dir=str(tmp_path)
        )
    assert not os.listdir(tmp_path)  # refused before any file was made


def test_a_lease_counts_its_writer_until_it_settles(rx):
    """Blocks a writer was handed are not reused before it is done: the lease counts its
    writer from the hand-out until its commit, its stream's end without one, or the end of
    its link (DecodeWorker parks a released lease's blocks until then)."""
    r = rx()
    sender = r.sender()
    leases = [r.leases.open(f"req{i}", [1 + i]) for i in range(3)]
    streams = [sender.open_stream(f"req{i}", x.lease_id) for i, x in enumerate(leases)]
    for stream in streams:
        stream.send_layer(0, [3], [0], *r.src[0])
    _until(lambda: all(x.remote_writers for x in leases))  # the sender thread asked for them
    assert leases[0].writes_may_land_until() == leases[0].deadline
    for layer in range(1, LAYERS):
        streams[0].send_layer(layer, [3], [0], *r.src[layer])
    streams[0].commit(timeout=20)
    assert leases[0].writes_may_land_until() is None  # its commit came: it writes no more
    streams[1].abort()
    _until(lambda: leases[1].writes_may_land_until() is None)  # ended without a commit
    assert leases[2].remote_writers == 1
    sender.close()  # the third never ends: its link closing settles it
    _until(lambda: leases[2].writes_may_land_until() is None)


def test_the_decode_worker_reuses_a_released_leases_blocks_only_once_its_writer_settled(
    tmp_path, make_engine
):
    """Through a real decode worker's cache: a lease released while its writer still holds
    its block ids is parked; its blocks come back once the writer's stream ends."""
    from decode_worker.worker import DecodeWorker
    from tests.conftest import tiny_llama_dir

    path, _ = tiny_llama_dir(tmp_path, seed=6)
    worker = DecodeWorker(make_engine(path, num_blocks=16))
    server = start_receiver_server("shm", worker.receiver, "127.0.0.1", 0, token=TOKEN)
    sender = make_sender("shm", server.endpoint, token=TOKEN)
    try:
        total = worker.blocks.num_free
        lease = worker.reserve("req", 20)  # 2 blocks of 16 tokens
        stream = sender.open_stream("req", lease.lease_id)
        k, v = worker.engine.runner.kv_caches[0]
        stream.send_layer(0, [0, 1], [0, 1], torch.randn_like(k), torch.randn_like(v))
        _until(lambda: lease.remote_writers == 1)
        assert worker.release(lease.lease_id)
        worker._expire_leases()
        assert worker.blocks.num_free == total - len(lease.block_ids)  # parked, not reusable
        stream.abort()  # its stream ends: it copies no more
        _until(lambda: lease.remote_writers == 0)
        worker._expire_leases()
        assert worker.blocks.num_free == total
    finally:
        sender.close()
        server.stop()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_sender_cache_on_the_gpu_lands_exactly(rx):
    """The prefill worker's cache on a GPU: its blocks come to the host, are hashed there and
    copied into the shared cache."""
    r = rx()
    r.src = [(k.cuda(), v.cuda()) for k, v in r.src]
    lease, _ = r.transfer(r.sender(), "gpu", [2, 3, 9], [5, 6, 1])
    assert lease.is_committed
    r.src = [(k.cpu(), v.cpu()) for k, v in r.src]
    r.assert_arrived([2, 3, 9], [5, 6, 1])
