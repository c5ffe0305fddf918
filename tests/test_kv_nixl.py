"""The nixl KV transport: one-sided WRITEs into the decode worker's leased blocks, a commit
that is a NIXL notification, and everything the other transports promise: exact bytes, a
refused commit for anything wrong (a flipped header bit, bytes that did not land in the
lease, a lease that expired, positions outside the lease), no metadata for a peer without the
cluster token, no notification taken from an agent that never proved it, and the receiver
serving on after each."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.sender import TransferError
from tests.one_sided_receiver import BLOCKS, LAYERS, kv_cache, receivers
from tests.transport_params import requires_transport

pytestmark = requires_transport("nixl")


@pytest.fixture
def rx():
    yield from receivers("nixl")


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

    src, dst = kv_cache(zero=False)[0], kv_cache(zero=True)[0]
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
