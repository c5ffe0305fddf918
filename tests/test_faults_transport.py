"""The fault-injecting KV transport: each fault it injects is caught by the receiver or the
sender, a broken link is replaced on the next stream, and what gets through is exact."""

from __future__ import annotations

import pytest
import torch

from kv_transfer import transport_faults as faults
from kv_transfer.lease import LeaseTable
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import TransferError, make_sender, start_receiver_server
from kv_transfer.transport_faults import FaultPolicy

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 3, 16, 4, 2, 8


def _cache(zero: bool):
    new = torch.zeros if zero else torch.randn
    shape = (BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
    return [(new(shape), new(shape)) for _ in range(LAYERS)]


class Link:
    """A receiver behind the faults transport (over ``inner``), and a sender to it."""

    def __init__(self, inner: str, policy: FaultPolicy):
        self.src, self.dst = _cache(zero=False), _cache(zero=True)
        self.leases = LeaseTable(default_ttl_s=30.0)
        self.receiver = KVReceiver(self.dst, self.leases, pending_lease_wait_s=0.2)
        self.server = start_receiver_server(
            "faults", self.receiver, "127.0.0.1", 0, inner=inner, policy=policy
        )
        self.sender = make_sender("faults", self.server.endpoint)

    def transfer(self, request_id: str, src_ids: list[int], dst_ids: list[int]):
        """Every layer of ``src_ids`` into a new lease over ``dst_ids``; (lease, stats)."""
        self.lease = lease = self.leases.open(request_id, dst_ids)
        stream = self.sender.open_stream(request_id, lease.lease_id)
        for layer, (k, v) in enumerate(self.src):
            stream.send_layer(layer, src_ids, range(len(src_ids)), k, v)
        return lease, stream.commit(timeout=20)

    def assert_arrived(self, src_ids, dst_ids) -> None:
        for (k_src, v_src), (k_dst, v_dst) in zip(self.src, self.dst, strict=True):
            assert torch.equal(k_dst[dst_ids], k_src[src_ids])
            assert torch.equal(v_dst[dst_ids], v_src[src_ids])

    def close(self) -> None:
        self.sender.close()
        self.server.stop()


@pytest.fixture(params=["local", "grpc"])
def open_link(request):
    opened: list[Link] = []

    def open_one(**policy) -> Link:
        opened.append(Link(request.param, FaultPolicy(seed=11, **policy)))
        return opened[-1]

    yield open_one
    for link in opened:
        link.close()


def test_policy_travels_in_the_endpoint():
    policy = FaultPolicy(seed=3, delay_p=0.5, delay_s=0.01, drop_p=0.1, corrupt_p=0.2)
    endpoint = faults.format_endpoint("grpc", policy, "127.0.0.1:5000")
    assert endpoint.startswith("127.0.0.1:5000#")  # where it listens comes first
    assert faults.parse_endpoint(endpoint) == ("grpc", policy, "127.0.0.1:5000")
    with pytest.raises(ValueError, match="not a probability"):
        FaultPolicy(drop_p=1.5)
    with pytest.raises(ValueError, match="bad fault policy item"):
        FaultPolicy.parse("seed=1,explode_p=0.3")
    with pytest.raises(ValueError, match="must look like"):
        faults.parse_endpoint("127.0.0.1:5000")


def test_a_policy_draws_the_same_faults_for_the_same_seed():
    class Quiet:  # an inner link that is never asked to carry anything here
        idle_interval_s = None
        broken = False

    policy = FaultPolicy(seed=5, drop_p=0.3, corrupt_p=0.3)

    def draws(number):
        link = faults._FaultLink(Quiet(), policy, number)
        out = []
        for _ in range(40):
            header, payload = link.disturb(b"h" * 8, memoryview(bytearray(8)), is_commit=False)
            intact = header == b"h" * 8 and bytes(payload) == bytes(8)
            out.append("drop" if header is None else "" if intact else "corrupt")
        return out

    assert draws(0) == draws(0)
    assert draws(0) != draws(1)  # each link of a process draws its own sequence
    assert {"drop", "corrupt", ""} <= set(draws(0))


def test_without_faults_every_block_arrives(open_link):
    link = open_link()
    link.transfer("r", [3, 1, 4, 15], [0, 9, 2, 7])
    link.assert_arrived([3, 1, 4, 15], [0, 9, 2, 7])


def test_corrupt_frames_are_rejected_and_the_lease_stays_open(open_link):
    link = open_link(corrupt_p=1.0)
    before = faults.injected["corrupt"]
    with pytest.raises(TransferError, match="checksum mismatch|malformed header"):
        link.transfer("r", [1, 2], [5, 6])
    assert faults.injected["corrupt"] - before == LAYERS + 1  # every kv frame and the commit
    assert link.receiver.frames_rejected == LAYERS + 1
    assert not link.lease.is_committed  # nothing half-written counts as delivered
    assert all(not k[[5, 6]].any() for k, _ in link.dst)


def test_header_bit_flips_are_rejected_and_the_receiver_keeps_serving(open_link):
    """Every frame's header damaged by one flipped bit (a layer, a block position, a lease
    id, a frame count): each is refused by the header CRC, none lands, and a clean sender to
    the same receiver then delivers exactly."""
    link = open_link(corrupt_p=1.0, corrupt_header_share=1.0)
    before = faults.injected["corrupt_header"]
    with pytest.raises(TransferError, match="header checksum mismatch"):
        link.transfer("r", [1, 2], [5, 6])
    assert faults.injected["corrupt_header"] - before == LAYERS + 1  # kv frames and commit
    assert link.receiver.frames_rejected == LAYERS + 1 and link.receiver.frames_accepted == 0
    assert not link.lease.is_committed and link.lease.frames_received == 0
    assert all(not k.any() and not v.any() for k, v in link.dst)  # not in any block

    inner, _, inner_endpoint = faults.parse_endpoint(link.server.endpoint)
    link.sender.close()
    link.sender = make_sender(inner, inner_endpoint)
    lease, _ = link.transfer("r2", [1, 2], [5, 6])
    assert lease.is_committed
    link.assert_arrived([1, 2], [5, 6])


def test_a_dropped_frame_fails_the_commit(open_link):
    link = open_link(drop_p=1.0)
    with pytest.raises(TransferError, match=f"expected {LAYERS} frames, got 0"):
        link.transfer("r", [1, 2], [5, 6])


def test_delayed_frames_arrive_intact(open_link):
    link = open_link(delay_p=1.0, delay_s=0.01)
    before = faults.injected["delay"]
    link.transfer("r", [0, 8], [1, 2])
    link.assert_arrived([0, 8], [1, 2])
    assert faults.injected["delay"] - before == LAYERS + 1


def test_a_broken_link_is_replaced_on_the_next_stream(open_link):
    """Streams over a link that breaks now and then: each one either arrives whole or fails
    with TransferError, and every break is followed by a fresh link (never a dead sender)."""
    link = open_link(disconnect_p=0.2)
    before = faults.injected["disconnect"]
    delivered, failed = 0, 0
    for i in range(24):
        src, dst = [i % BLOCKS, (i + 5) % BLOCKS], [0, 1]
        try:
            lease, _ = link.transfer(f"r{i}", src, dst)
        except TransferError as e:
            assert "the link broke" in str(e)
            failed += 1
            continue
        assert lease.is_committed
        link.assert_arrived(src, dst)
        delivered += 1
    breaks = faults.injected["disconnect"] - before
    assert failed == breaks and delivered == 24 - breaks
    assert delivered and failed  # seed 11 draws both outcomes
    # A break at stream i's frames is seen by stream i+1's open (unless it was the last).
    assert link.sender.reconnects in (breaks, breaks - 1)
