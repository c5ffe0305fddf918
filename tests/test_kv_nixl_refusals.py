"""The nixl transport refuses what is wrong and settles every lease: a write into cached or
foreign blocks, an incomplete commit, a flipped header bit, damaged bytes, an expired lease, a
peer or agent without the cluster token, a dropped write, a damaged notification; acks keyed
per notification; the receiver serving on after each."""

from __future__ import annotations

import time

import pytest

from kv_transfer.frame import encode_commit_frame
from kv_transfer.sender import TransferError
from kv_transfer.torch_dist.handshake import HandshakeError
from kv_transfer.transport_faults import FaultPolicy
from tests.one_sided_receiver import (
    BLOCKS,
    LAYERS,
    receivers,
    refuses_a_write_into_the_leases_cached_blocks,
    refuses_an_incomplete_commit,
)
from tests.transport_params import requires_transport

pytestmark = requires_transport("nixl")


@pytest.fixture
def rx():
    yield from receivers("nixl")


def test_a_write_into_the_leases_cached_blocks_is_refused(rx):
    refuses_a_write_into_the_leases_cached_blocks(rx())


def test_an_incomplete_commit_is_refused(rx):
    refuses_an_incomplete_commit(rx())


def test_a_flipped_header_bit_is_refused(rx):
    """The faults transport flips a bit of every commit notification's frame header (and
    damages every write's bytes): refused by the header CRC; the lease stays uncommitted."""
    r = rx(inner="nixl", policy=FaultPolicy(seed=3, corrupt_p=1.0, corrupt_header_share=1.0))
    with pytest.raises(TransferError, match="header checksum mismatch"):
        r.transfer(r.sender(), "req", [1, 2], [5, 6])
    assert r.receiver.frames_rejected == 1 and r.receiver.frames_accepted == 0
    assert not any(lease.is_committed for lease in r.leases._leases.values())
    r.assert_still_serving()  # the same receiver, reached without the faults


def test_bytes_damaged_on_the_way_fail_the_digest(rx):
    r = rx(inner="nixl", policy=FaultPolicy(seed=3, corrupt_p=0.5, corrupt_header_share=1.0))
    refused = 0
    for i in range(6):  # seed 3: some writes damaged with a clean commit among them
        try:
            lease, _ = r.transfer(r.sender(), f"r{i}", [1, 2], [5, 6])
            r.leases.close(lease.lease_id)
        except TransferError as e:
            assert "digest" in str(e) or "header checksum" in str(e)
            refused += "digest" in str(e)
    assert refused >= 1


def test_a_write_outside_the_lease_is_refused(rx):
    r = rx()
    sender = r.sender()
    # 1. The sender names a position past the lease: nothing is written, the stream fails.
    lease = r.leases.open("past", [1, 2])
    stream = sender.open_stream("past", lease.lease_id)
    stream.send_layer(0, [3], [2], *r.src[0])
    with pytest.raises(TransferError, match="outside lease"):
        stream.commit(timeout=20)
    assert all(not k.any() for k, _ in r.dst)
    # 2. A sender that wrote into another lease's blocks and commits this one: the leased
    #    blocks do not hold what it hashed, so the commit is refused.
    victim, other = r.leases.open("victim", [8, 9]), r.leases.open("other", [13, 14])
    stream = sender.open_stream("victim", victim.lease_id)
    channel = stream._channel  # a hostile sender: it aims at the other lease's addresses
    channel._fetch_addresses()
    other_channel = sender._link.open_channel("other", other.lease_id)
    other_channel._fetch_addresses()
    channel._k, channel._v = other_channel._k, other_channel._v
    for layer, (k, v) in enumerate(r.src):
        stream.send_layer(layer, [4, 5], [0, 1], k, v)
    with pytest.raises(TransferError, match="digest"):
        stream.commit(timeout=20)
    assert not victim.is_committed and victim.commit_refused
    # 3. A commit notification naming positions past its lease is refused.
    lease = r.leases.open("forged", [6, 7])
    stream = sender.open_stream("forged", lease.lease_id)
    for layer, (k, v) in enumerate(r.src):
        stream.send_layer(layer, [4, 5], [0, 1], k, v)
    stream._channel._writes.append((0, [5]))
    with pytest.raises(TransferError, match="outside lease"):
        stream.commit(timeout=20)
    assert not lease.is_committed
    r.assert_still_serving()


def test_a_notification_for_an_expired_lease_is_ignored(rx):
    r = rx()

    def expire(stream):
        time.sleep(1.6)
        assert [x.lease_id for x in r.receiver.pop_expired()] == [stream.lease_id]

    with pytest.raises(TransferError, match="unknown lease"):
        r.transfer(r.sender(), "req", [1, 2], [5, 6], ttl_s=1.5, before_commit=expire)
    r.assert_still_serving()


def test_a_peer_without_the_token_gets_no_metadata(rx):
    r = rx()
    for token in (None, "wrong-token"):
        with pytest.raises(HandshakeError):
            r.sender(token=token)
    r.assert_still_serving()


def test_a_notification_from_an_agent_that_proved_no_token_is_ignored(rx):
    from kv_transfer.nixl.agent import NixlAgent
    from kv_transfer.nixl.commit import encode_notification

    r = rx()
    lease = r.leases.open("req", [1, 2])
    intruder = NixlAgent("intruder")  # holds the receiver's metadata (leaked), not the token
    peer = intruder.add_remote(r.server.agent.metadata())
    header, _ = encode_commit_frame("req", lease.lease_id, 0)
    writes = [(layer, [0, 1]) for layer in range(LAYERS)]
    intruder.notify(peer, encode_notification(header, lease.lease_id, writes, 0, -1))
    deadline = time.monotonic() + 5
    while not r.server.notifications_ignored and time.monotonic() < deadline:
        intruder.progress()  # its notification goes out as its agent progresses
        time.sleep(0.02)
    assert r.server.notifications_ignored == 1
    assert not lease.is_committed and lease.frames_received == 0
    intruder.remove_remote(peer)
    r.assert_still_serving()


def test_a_dropped_write_fails_the_commit_and_a_cut_link_is_replaced(rx):
    r = rx(inner="nixl", policy=FaultPolicy(seed=5, drop_p=1.0))
    with pytest.raises(TransferError, match=f"expected {LAYERS} frames, got 0"):
        r.transfer(r.sender(), "req", [1, 2], [5, 6])
    cut = rx(inner="nixl", policy=FaultPolicy(seed=11, disconnect_p=0.2))
    sender, delivered, failed = cut.sender(), 0, 0
    for i in range(12):
        try:
            lease, _ = cut.transfer(sender, f"r{i}", [i % BLOCKS, (i + 5) % BLOCKS], [0, 1])
        except TransferError as e:
            assert "the link broke" in str(e)
            failed += 1
            continue
        cut.assert_arrived([i % BLOCKS, (i + 5) % BLOCKS], [0, 1])
        cut.leases.close(lease.lease_id)
        delivered += 1
    assert delivered and failed


def _until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_lease_counts_its_writer_until_it_settles(rx):
    """Blocks a one-sided writer holds addresses of are not reused before it is done: the
    lease counts its writer from the address hand-out until its commit notification, its
    stream's end without one, or the end of its link (DecodeWorker parks a released lease's
    blocks until then)."""
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


def test_each_commit_notification_has_its_own_ack_key():
    """Acks fetch their verdict by the notification's key: two streams' notifications must
    not share one. (A notification ends in its own CRC, so its CRC32C is the CRC residue,
    the same for all: keyed by it, a stream took another's verdict and reported a refused
    commit as delivered, and its Decode waited out the lease.)"""
    import crc32c

    from kv_transfer.nixl.commit import encode_notification, notification_key

    messages = [
        encode_notification(
            encode_commit_frame(f"r{i}", f"lease{i}", 2)[0],
            f"lease{i}",
            [(0, [0]), (1, [0])],
            64,
            digest=i,
        )
        for i in range(2)
    ]
    assert len({crc32c.crc32c(m) for m in messages}) == 1  # why CRC32C cannot be the key
    assert len({notification_key(m) for m in messages}) == 2


def test_a_commit_notification_damaged_past_decoding_still_settles_its_lease(rx):
    """A notification whose header no longer decodes names no lease: its sender's ack does,
    so the lease's blocks are not held back until its deadline once it is released."""
    r = rx(inner="nixl", policy=FaultPolicy(seed=3, corrupt_p=1.0, corrupt_header_share=1.0))
    with pytest.raises(TransferError, match="header checksum mismatch"):
        r.transfer(r.sender(), "req", [1, 2], [5, 6])
    (lease,) = r.leases._leases.values()
    assert not lease.is_committed
    _until(lambda: lease.writes_may_land_until() is None)  # the sender's link is still open


def test_a_lease_held_on_two_connections_settles_each_and_all_at_its_commit(rx):
    """A sender that reconnected holds a lease's addresses on two connections: the first
    ending settles only its own writer, and the commit (on the second) settles the rest."""
    r = rx()
    first, second = r.sender(), r.sender()
    lease = r.leases.open("req", [4])
    old = first.open_stream("req", lease.lease_id)
    old.send_layer(0, [3], [0], *r.src[0])
    _until(lambda: lease.remote_writers == 1)
    new = second.open_stream("req", lease.lease_id)
    new.send_layer(0, [3], [0], *r.src[0])
    _until(lambda: lease.remote_writers == 2)
    first.close()  # its connection ends: its writer settles, not the second's
    _until(lambda: lease.remote_writers == 1)
    for layer in range(1, LAYERS):
        new.send_layer(layer, [3], [0], *r.src[layer])
    new.commit(timeout=20)
    assert lease.is_committed and lease.writes_may_land_until() is None


def test_the_decode_worker_reuses_a_released_leases_blocks_only_once_its_writer_settled(
    tmp_path, make_engine
):
    from decode_worker.worker import DecodeWorker
    from tests.conftest import tiny_llama_dir

    path, _ = tiny_llama_dir(tmp_path, seed=6)
    worker = DecodeWorker(make_engine(path, num_blocks=16))
    total = worker.blocks.num_free
    lease = worker.reserve("req", 20)  # 2 blocks of 16 tokens
    lease.remote_writers = 1  # a nixl sender holds its addresses (its server counts it so)
    assert worker.release(lease.lease_id)
    worker._expire_leases()
    assert worker.blocks.num_free == total - len(lease.block_ids)  # parked, not reusable
    lease.remote_writers = 0  # its commit came, or its link went away
    worker._expire_leases()
    assert worker.blocks.num_free == total
    lease = worker.reserve("req2", 20, ttl_s=0.2)
    lease.remote_writers = 1
    worker.release(lease.lease_id)
    time.sleep(0.3)  # past its deadline no writer posts anything
    worker._expire_leases()
    assert worker.blocks.num_free == total
