"""The nixl KV transport: one-sided WRITEs into the decode worker's leased blocks, a commit
that is a NIXL notification, and everything the other transports promise: exact bytes, a
refused commit for anything wrong (a flipped header bit, bytes that did not land in the
lease, a lease that expired, positions outside the lease), no metadata for a peer without the
cluster token, no notification taken from an agent that never proved it, and the receiver
serving on after each."""

from __future__ import annotations

import time

import pytest
import torch

from kv_transfer.frame import encode_commit_frame
from kv_transfer.lease import LeaseTable
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import TransferError, make_sender, start_receiver_server
from kv_transfer.torch_dist.handshake import HandshakeError
from kv_transfer.transport_faults import FaultPolicy
from tests.transport_params import requires_transport

pytestmark = requires_transport("nixl")

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 3, 16, 4, 2, 8
TOKEN = "nixl-test-token"


def _cache(zero: bool):
    new = torch.zeros if zero else torch.randn
    shape = (BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
    return [(new(shape), new(shape)) for _ in range(LAYERS)]


class Receiver:
    """A decode side's cache, leases and nixl server (with the cluster token)."""

    def __init__(self, **opts):
        transport = "faults" if "inner" in opts else "nixl"  # faults wraps nixl
        self.src, self.dst = _cache(zero=False), _cache(zero=True)
        self.leases = LeaseTable(default_ttl_s=30.0, num_layers=LAYERS)
        self.receiver = KVReceiver(self.dst, self.leases, pending_lease_wait_s=0.2)
        self.server = start_receiver_server(
            transport, self.receiver, "127.0.0.1", 0, token=TOKEN, **opts
        )
        self.senders = []

    def sender(self, token: str | None = TOKEN):
        self.senders.append(
            make_sender("faults" if "#" in self.endpoint else "nixl", self.endpoint, token=token)
        )
        return self.senders[-1]

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def transfer(self, sender, request_id, src_ids, dst_ids, ttl_s=None, before_commit=None):
        lease = self.leases.open(request_id, dst_ids, ttl_s=ttl_s)
        stream = sender.open_stream(request_id, lease.lease_id)
        for layer, (k, v) in enumerate(self.src):
            stream.send_layer(layer, src_ids, range(len(src_ids)), k, v)
        if before_commit is not None:
            before_commit(stream)
        return lease, stream.commit(timeout=20)

    def assert_arrived(self, src_ids, dst_ids) -> None:
        for (k_src, v_src), (k_dst, v_dst) in zip(self.src, self.dst, strict=True):
            assert torch.equal(k_dst[dst_ids], k_src[src_ids])
            assert torch.equal(v_dst[dst_ids], v_src[src_ids])

    def assert_still_serving(self) -> None:
        """A clean sender's transfer lands exactly and commits."""
        lease, stats = self.transfer(self.sender(), f"clean-{time.monotonic_ns()}", [2, 7], [11, 4])
        assert lease.is_committed and stats.frames == LAYERS
        self.assert_arrived([2, 7], [11, 4])
        self.leases.close(lease.lease_id)

    def close(self) -> None:
        for s in self.senders:
            s.close()
        self.server.stop()


@pytest.fixture
def rx():
    opened = []

    def open_one(**opts) -> Receiver:
        opened.append(Receiver(**opts))
        return opened[-1]

    yield open_one
    for r in opened:
        r.close()


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
    assert all(not k[[0, 1, 2]].any() for k, _ in r.dst)  # nothing outside the lease


def test_runs_consecutive_on_both_sides_go_as_one_write_each(rx, monkeypatch):
    """Positions whose source and leased blocks both follow on go as one descriptor per run
    (K and V apart); the bytes land exactly as block by block, nothing outside the lease."""
    r = rx()
    sender = r.sender()
    posted = []
    agent = sender._link.agent
    real_write = agent.write
    monkeypatch.setattr(
        agent,
        "write",
        lambda local, remote, *a: posted.append(local) or real_write(local, remote, *a),
    )
    src, dst = [2, 3, 4, 9, 10, 0], [5, 6, 7, 8, 11, 12]
    lease, _ = r.transfer(sender, "runs", src, dst)
    assert lease.is_committed
    r.assert_arrived(src, dst)
    outside = [b for b in range(BLOCKS) if b not in dst]
    assert all(not k[outside].any() and not v[outside].any() for k, v in r.dst)
    block_bytes = r.src[0][0][0].numel() * 4
    # Per layer: [2-4 -> 5-7], [9 -> 8], [10 -> 11], [0 -> 12], for K and for V.
    runs = [(3, 1, 1, 1) * 2] * LAYERS
    assert [tuple(int(n) // block_bytes for n in d[:, 1]) for d in posted[:LAYERS]] == runs


def test_each_write_is_hashed_as_it_lands_not_again_at_the_commit(rx, monkeypatch):
    """The receiver hashes a layer's blocks on that WRITE's own notification; the commit's
    check reuses those hashes (one hash per write in all), and keeps none once committed."""
    import kv_transfer.nixl.server as nixl_server
    from kv_transfer import one_sided

    r = rx()
    hashed = []
    real = nixl_server.write_hashes
    monkeypatch.setattr(one_sided, "write_hashes", lambda *a: pytest.fail("hashed again"))
    monkeypatch.setattr(
        nixl_server,
        "write_hashes",
        lambda k, v, blocks: hashed.append(list(blocks)) or real(k, v, blocks),
    )
    lease, _ = r.transfer(r.sender(), "early", [1, 2, 3], [9, 4, 5])
    assert lease.is_committed
    r.assert_arrived([1, 2, 3], [9, 4, 5])
    assert hashed == [[9, 4, 5]] * LAYERS
    assert not r.server._early


def test_a_writes_hash_is_of_its_bytes_in_position_order_wherever_they_lie():
    """Each side streams its own stretches of blocks into a write's hash: the same cells in
    the same order hash alike however they lie; another order, or one flipped bit, not."""
    from kv_transfer.nixl.commit import block_rows, write_hashes

    src, dst = _cache(zero=False)[0], _cache(zero=True)[0]
    src_ids, dst_ids = [4, 5, 6, 0, 1, 9], [10, 2, 3, 4, 12, 13]  # other stretches
    for s, d in zip(src, dst):
        d[dst_ids] = s[src_ids]
    src_rows = [block_rows(t) for t in src]
    dst_rows = [block_rows(t) for t in dst]
    assert write_hashes(*src_rows, src_ids) == write_hashes(*dst_rows, dst_ids)
    swapped = [src_ids[1], src_ids[0], *src_ids[2:]]
    assert write_hashes(*src_rows, swapped) != write_hashes(*dst_rows, dst_ids)
    dst[1].view(-1).view(torch.int32)[dst[1][0].numel() * 13 + 5] ^= 1 << 7  # V, block 13
    k_hash, v_hash = write_hashes(*dst_rows, dst_ids)
    assert (k_hash, v_hash) != write_hashes(*src_rows, src_ids)
    assert k_hash == write_hashes(*src_rows, src_ids)[0]


def test_a_rewritten_cell_is_checked_for_its_last_bytes_only(rx):
    """A chunk rewrites the previous chunk's partial last block: the digest covers what each
    position holds at the end, so a stale first copy of it is no mismatch, and a damaged
    rewrite is one."""
    r = rx()
    sender = r.sender()
    for request_id, damaged in (("stale", False), ("damaged", True)):
        lease = r.leases.open(request_id, [9, 3] if damaged else [4, 2])
        stream = sender.open_stream(request_id, lease.lease_id)
        channel, write = stream._channel, stream._channel.write_layer
        # The rewrite's bytes as if a bit flipped on the way (what the faults transport does).
        channel.write_layer = lambda *a, damage=False, w=write, bad=damaged: w(
            *a, damage=bad and a[2] == [1]
        )
        for layer, (k, v) in enumerate(r.src):
            stream.send_layer(layer, [5, 6], [0, 1], k, v)
        for layer, (k, v) in enumerate(r.src):
            stream.send_layer(layer, [8], [1], k, v)
        if damaged:
            with pytest.raises(TransferError, match="digest"):
                stream.commit(timeout=20)
        else:
            stream.commit(timeout=20)
        assert lease.is_committed != damaged
    r.assert_still_serving()


def test_a_write_into_the_leases_cached_blocks_is_refused(rx):
    """The lease's leading blocks came from the prefix cache (shared): never written."""
    r = rx()
    lease = r.leases.open("cached", [3, 4, 5], first_block=1)
    stream = r.sender().open_stream("cached", lease.lease_id)
    stream.send_layer(0, [1, 2], [0, 1], *r.src[0])
    with pytest.raises(TransferError, match="outside lease"):
        stream.commit(timeout=20)
    assert all(not k.any() and not v.any() for k, v in r.dst)
    r.assert_still_serving()


def test_an_incomplete_commit_is_refused(rx):
    r = rx()
    lease = r.leases.open("req", [1, 2])
    stream = r.sender().open_stream("req", lease.lease_id)
    stream.send_layer(0, [3, 4], [0, 1], *r.src[0])  # one layer of three
    with pytest.raises(TransferError, match="incomplete commit"):
        stream.commit(timeout=20)
    assert not lease.is_committed
    r.assert_still_serving()


def test_a_flipped_header_bit_is_refused(rx):
    """The faults transport flips a bit of every commit notification's frame header (and
    damages every write's bytes): refused by the header CRC; the lease stays uncommitted."""
    r = rx(inner="nixl", policy=FaultPolicy(seed=3, corrupt_p=1.0, corrupt_header_share=1.0))
    with pytest.raises(TransferError, match="header checksum mismatch"):
        r.transfer(r.sender(), "req", [1, 2], [5, 6])
    assert r.receiver.frames_rejected == 1 and r.receiver.frames_accepted == 0
    assert not any(lease.is_committed for lease in r.leases._leases.values())
    clean = Receiver.__new__(Receiver)  # the same receiver, reached without the faults
    clean.__dict__.update(r.__dict__)
    clean.server = r.server._inner
    clean.assert_still_serving()


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
