"""KV transfer end to end over each transport: concurrent streams, bad frames, big layers."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kv_transfer.errors import ReceiverFault
from kv_transfer.frame import MAX_FRAME_BYTES, encode_kv_frame
from kv_transfer.lease import LeaseTable
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import TransferError, make_sender, start_receiver_server
from kv_transfer.transport_grpc import serialize_kv_frame, split_kv_frame
from kv_transfer.transports import TRANSPORTS
from protos import pdserve_pb2
from tests.transport_params import transport_params

# decode_frame views protobuf bytes without copying; torch warns once about read-only buffers.
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 4, 32, 4, 2, 8
PENDING_WAIT_S = 0.5  # how long frames wait for a lease not open yet


def make_cache(blocks=BLOCKS, block_size=BLOCK_SIZE, heads=HEADS, head_dim=HEAD_DIM, zero=False):
    new = torch.zeros if zero else torch.randn
    return [
        (new(blocks, block_size, heads, head_dim), new(blocks, block_size, heads, head_dim))
        for _ in range(LAYERS)
    ]


class Endpoint:
    """A receiver served over one transport, plus a sender connected to it."""

    def __init__(self, transport: str, dst_cache):
        self.events: list[tuple[str, str, int]] = []
        self.leases = LeaseTable(default_ttl_s=30.0)
        self.receiver = KVReceiver(
            dst_cache, self.leases, on_event=self._record, pending_lease_wait_s=PENDING_WAIT_S
        )
        self.server = start_receiver_server(transport, self.receiver, host="127.0.0.1", port=0)
        self.sender = make_sender(transport, self.server.endpoint)
        self._lock = threading.Lock()

    def _record(self, kind: str, lease_id: str, layer: int) -> None:
        with self._lock:
            self.events.append((kind, lease_id, layer))

    def close(self) -> None:
        self.sender.close()  # first, so torch_dist pair threads see the close and exit
        self.server.stop()


@pytest.fixture(params=transport_params(sorted(TRANSPORTS)))
def transport(request):
    return request.param


@pytest.fixture
def endpoints(transport):
    opened: list[Endpoint] = []

    def open_endpoint(dst_cache) -> Endpoint:
        opened.append(Endpoint(transport, dst_cache))
        return opened[-1]

    yield open_endpoint
    for ep in opened:
        ep.close()


def send_all_layers(stream, src_cache, src_ids):
    """Every layer of blocks ``src_ids``, to the lease's blocks in order (position i <- src i)."""
    for layer, (k_cache, v_cache) in enumerate(src_cache):
        stream.send_layer(layer, src_ids, range(len(src_ids)), k_cache, v_cache)


def assert_blocks_equal(src_cache, dst_cache, src_ids, dst_ids):
    for (k_src, v_src), (k_dst, v_dst) in zip(src_cache, dst_cache, strict=True):
        assert torch.equal(k_dst[dst_ids], k_src[src_ids])
        assert torch.equal(v_dst[dst_ids], v_src[src_ids])


def run_concurrently(*fns):
    results: list = [None] * len(fns)

    def call(i):
        try:
            results[i] = fns[i]()
        except Exception as e:  # noqa: BLE001 -- handed back to the test thread
            results[i] = e

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_unknown_transport_lists_known_ones():
    with pytest.raises(ValueError, match="flight, grpc, local, nixl, shm, torch_dist"):
        make_sender("carrier-pigeon", "x")


def test_two_concurrent_streams_arrive_intact(endpoints, transport):
    src = make_cache()
    ep = endpoints(make_cache(zero=True))
    src_a, src_b = torch.randperm(BLOCKS)[:8].tolist(), torch.randperm(BLOCKS)[:5].tolist()
    dst_a, dst_b = [20, 3, 9, 14, 0, 31, 7, 11], [1, 30, 2, 18, 25]
    lease_a, lease_b = ep.leases.open("req-a", dst_a), ep.leases.open("req-b", dst_b)

    def transfer(request_id, lease, src_ids):
        stream = ep.sender.open_stream(request_id, lease.lease_id)
        send_all_layers(stream, src, src_ids)
        return stream.commit(timeout=20)

    stats = run_concurrently(
        lambda: transfer("req-a", lease_a, src_a),
        lambda: transfer("req-b", lease_b, src_b),
    )
    assert all(s.frames == LAYERS for s in stats), stats
    assert lease_a.committed.is_set() and lease_b.committed.is_set()
    assert_blocks_equal(src, ep.receiver.kv_caches, src_a, dst_a)
    assert_blocks_equal(src, ep.receiver.kv_caches, src_b, dst_b)
    for lease in (lease_a, lease_b):
        mine = [e for e in ep.events if e[1] == lease.lease_id]
        assert mine[-1] == ("commit", lease.lease_id, -1)
        assert sorted(layer for kind, _, layer in mine[:-1]) == list(range(LAYERS))


def test_bad_frame_fails_its_stream_and_not_a_concurrent_one(endpoints, transport):
    src = make_cache()
    ep = endpoints(make_cache(zero=True))
    good_lease, bad_lease = ep.leases.open("good", [0, 1, 2]), ep.leases.open("bad", [10, 11])

    def bad_transfer():
        stream = ep.sender.open_stream("bad", bad_lease.lease_id)
        stream.send_layer(0, [4, 5], [0, 1], *src[0])
        stream.send_layer(1, [4, 5], [1, 2], *src[1])  # the lease has no block at position 2
        stream.send_layer(2, [4, 5], [0, 1], *src[2])
        return stream.commit(timeout=20)

    def good_transfer():
        stream = ep.sender.open_stream("good", good_lease.lease_id)
        send_all_layers(stream, src, [7, 8, 9])
        return stream.commit(timeout=20)

    bad, good = run_concurrently(bad_transfer, good_transfer)
    assert isinstance(bad, TransferError), bad
    assert any("outside lease" in r for r in bad.reasons), bad.reasons
    assert not bad_lease.committed.is_set()
    assert good.frames == LAYERS and good_lease.committed.is_set()
    assert_blocks_equal(src, ep.receiver.kv_caches, [7, 8, 9], [0, 1, 2])


def test_layer_bigger_than_a_frame_is_split_and_arrives_intact(endpoints, transport):
    big = (64, 16, 8, 128)  # blocks, block_size, heads, head_dim: 128 KiB per block of K+V
    src, ep = make_cache(*big), endpoints(make_cache(*big, zero=True))
    layer_bytes = 2 * src[0][0].numel() * 4
    assert layer_bytes > 2 * MAX_FRAME_BYTES
    lease = ep.leases.open("big", range(64))
    stream = ep.sender.open_stream("big", lease.lease_id)
    src_ids = torch.randperm(64).tolist()
    stream.send_layer(2, src_ids, list(range(64)), *src[2])
    stats = stream.commit(timeout=20)
    # nixl and shm write the layer's blocks straight into the lease at once: no frames to split
    one_write = transport in ("nixl", "shm")
    assert stats.frames == (1 if one_write else 3) and stats.bytes == layer_bytes
    assert torch.equal(ep.receiver.kv_caches[2][0], src[2][0][src_ids])
    assert torch.equal(ep.receiver.kv_caches[2][1], src[2][1][src_ids])


def test_aborted_stream_leaves_lease_uncommitted_and_sender_usable(endpoints, transport):
    src = make_cache()
    ep = endpoints(make_cache(zero=True))
    dropped, kept = ep.leases.open("drop", [0, 1]), ep.leases.open("keep", [2, 3])
    stream = ep.sender.open_stream("drop", dropped.lease_id)
    send_all_layers(stream, src, [0, 1])
    stream.abort()
    stream = ep.sender.open_stream("keep", kept.lease_id)
    send_all_layers(stream, src, [4, 5])
    assert stream.commit(timeout=20).frames == LAYERS
    assert not dropped.committed.is_set() and kept.committed.is_set()


def test_commit_to_unknown_lease_raises_transfer_error(endpoints, transport):
    ep = endpoints(make_cache(zero=True))
    stream = ep.sender.open_stream("req", "no-such-lease")
    with pytest.raises(TransferError, match="unknown lease"):
        stream.commit(timeout=20)


def test_frames_sent_before_the_lease_opens_wait_for_it(endpoints, transport):
    """The router sends the prefill while the reservation is in flight: early frames wait."""
    src = make_cache()
    ep = endpoints(make_cache(zero=True))
    stream = ep.sender.open_stream("early", "lease-early")
    send_all_layers(stream, src, [6, 2, 9])
    time.sleep(0.1)  # the frames are on their way or waiting at the receiver
    lease = ep.leases.open("early", [30, 4, 17], lease_id="lease-early")
    assert stream.commit(timeout=20).frames == LAYERS and lease.committed.is_set()
    assert_blocks_equal(src, ep.receiver.kv_caches, [6, 2, 9], [30, 4, 17])


def test_a_refused_reservation_fails_its_waiting_frames_at_once(endpoints, transport):
    src = make_cache()
    ep = endpoints(make_cache(zero=True))
    ep.receiver.pending_lease_wait_s = 30.0  # only the refusal can end the wait in time
    stream = ep.sender.open_stream("late", "lease-refused")
    send_all_layers(stream, src, [1, 2])
    time.sleep(0.1)
    started = time.monotonic()
    ep.leases.refuse("lease-refused", "need 2 blocks, 0 free")
    with pytest.raises(TransferError, match="refused: need 2 blocks"):
        stream.commit(timeout=20)
    assert time.monotonic() - started < 10
    assert ep.receiver.kv_caches[0][0].abs().sum() == 0


def test_servers_bind_the_given_address(endpoints, transport):
    ep = endpoints(make_cache(zero=True))
    expected = "local://" if transport == "local" else "127.0.0.1:"
    assert ep.server.endpoint.startswith(expected)


@pytest.mark.parametrize("n_blocks", [1, 40, MAX_FRAME_BYTES // 1024])
def test_grpc_serializer_matches_generated_kv_frame(n_blocks):
    header, payload = encode_kv_frame(
        "r", "l", 0, range(n_blocks), torch.ones(2, n_blocks, 1, 1, 128)
    )
    wire = serialize_kv_frame((header, payload))
    generated = pdserve_pb2.KvFrame(header=header, payload=bytes(payload))
    assert wire == generated.SerializeToString()
    assert len(wire) < 4 * 1024 * 1024


def test_split_kv_frame_reads_what_protobuf_writes_without_copying():
    header, payload = encode_kv_frame("r", "l", 3, [4, 2], torch.randn(2, 2, 1, 1, 8))
    wire = pdserve_pb2.KvFrame(header=header, payload=bytes(payload)).SerializeToString()
    frame = split_kv_frame(wire)
    assert frame.error is None
    assert bytes(frame.header) == header and bytes(frame.payload) == bytes(payload)
    assert isinstance(frame.payload, memoryview) and frame.payload.obj is wire  # a view
    # Any field order, unknown fields of every wire type skipped, last value wins.
    unknown = b"\x18\x07" + b"\x21" + bytes(8) + b"\x2d" + bytes(4) + b"\x32\x01x"
    reordered = b"\x12\x01z" + unknown + serialize_kv_frame((header, payload))
    again = split_kv_frame(reordered)
    assert bytes(again.header) == header and bytes(again.payload) == bytes(payload)
    assert split_kv_frame(b"").error is None  # an empty message is an empty frame


@pytest.mark.parametrize(
    "wire, reason",
    [
        (b"\x0a\x05abc", "past the end"),  # length beyond the message
        (b"\x0a\xff", "truncated varint"),
        (b"\x0b", "wire type 3"),  # groups are not used by KvFrame
        (b"\x09\x00", "past the end"),  # a fixed64 field cut short
    ],
)
def test_split_kv_frame_reports_malformed_messages(wire, reason):
    frame = split_kv_frame(wire)
    assert frame.error is not None and reason in frame.error


def test_a_malformed_message_is_one_rejected_frame_not_a_dead_stream():
    """Raw bytes straight onto PushFrames: the bad message is reported, the good one lands."""
    import grpc

    cache = make_cache(zero=True)
    ep = Endpoint("grpc", cache)
    lease = ep.leases.open("r", [0])
    kv = torch.randn(2, 1, *cache[0][0].shape[1:])
    good = serialize_kv_frame(encode_kv_frame("r", lease.lease_id, 0, [0], kv))
    with grpc.insecure_channel(ep.server.endpoint) as channel:
        push = channel.stream_unary(
            "/pdserve.v1.KvTransfer/PushFrames",
            request_serializer=lambda b: b,
            response_deserializer=pdserve_pb2.PushAck.FromString,
        )
        ack = push(iter([b"\x0a\x05abc", good]), timeout=30)
    ep.close()
    assert (ack.frames_accepted, ack.frames_rejected) == (1, 1)
    assert "malformed KvFrame" in ack.errors[0]
    assert torch.equal(cache[0][0][0], kv[0, 0])


def test_report_loopback_throughput(endpoints, transport, capsys):
    """Prints MB/s for the lead; asserts only correctness (timing on shared CI is noise)."""
    shape = (128, 16, 8, 128)  # blocks, block_size, heads, head_dim: 16 MiB per layer (K+V)
    src, ep = make_cache(*shape), endpoints(make_cache(*shape, zero=True))
    ids = list(range(128))
    best = 0.0
    for attempt in range(2):
        lease = ep.leases.open(f"bench-{attempt}", ids)
        start = time.perf_counter()
        stream = ep.sender.open_stream(f"bench-{attempt}", lease.lease_id)
        send_all_layers(stream, src, ids)
        stats = stream.commit(timeout=30)
        best = max(best, stats.bytes / (time.perf_counter() - start) / 1e6)
        ep.leases.close(lease.lease_id)
    assert_blocks_equal(src, ep.receiver.kv_caches, ids, ids)
    with capsys.disabled():
        print(f"\n[kv throughput] {transport}: {best:.0f} MB/s ({stats.bytes >> 20} MiB/request)")


@pytest.mark.parametrize(
    "transport", transport_params(["grpc", "flight", "torch_dist", "nixl", "shm"])
)
def test_stream_to_a_stopped_server_raises_transfer_error(transport):
    src = make_cache()
    ep = Endpoint(transport, make_cache(zero=True))
    try:
        lease = ep.leases.open("req", [0, 1])
        ep.server.stop()
        try:
            stream = ep.sender.open_stream("req", lease.lease_id)
        except ReceiverFault:  # nixl, shm: their control connection already reads closed
            assert transport in ("nixl", "shm")
            return
        for _ in range(3):  # torch_dist notices on the message after the stop
            send_all_layers(stream, src, [0, 1])
        with pytest.raises(TransferError):
            stream.commit(timeout=10)
    finally:
        ep.sender.close()


def test_torch_dist_pair_survives_idle_periods_via_pings():
    src = make_cache()
    leases = LeaseTable(default_ttl_s=30.0)
    receiver = KVReceiver(make_cache(zero=True), leases)
    server = start_receiver_server("torch_dist", receiver, idle_timeout_s=0.4)
    sender = make_sender("torch_dist", server.endpoint)
    try:
        time.sleep(1.0)  # without pings the receiver's recv would time out and drop the pair
        lease = leases.open("req", [3])
        stream = sender.open_stream("req", lease.lease_id)
        send_all_layers(stream, src, [5])
        assert stream.commit(timeout=10).frames == LAYERS
    finally:
        sender.close()
        server.stop()


def test_a_lease_s_cached_blocks_take_no_writes_and_its_commit_counts_them(endpoints, transport):
    """Reserve by content (issue 51): a lease whose first blocks hold cached KV (shared with
    the decode worker's prefix cache) refuses any frame or write into them, whatever the
    transport, and commits with only the blocks after them sent."""
    src, dst = make_cache(), make_cache(zero=True)
    ep = endpoints(dst)
    ep.leases.num_layers = LAYERS  # commits must cover every layer x block, as a worker's do
    cached_before = [t.clone() for pair in dst for t in pair]
    lease = ep.leases.open("req-c", [3, 4, 5, 6], first_block=2)
    stream = ep.sender.open_stream("req-c", lease.lease_id)
    for layer, (k_cache, v_cache) in enumerate(src):
        stream.send_layer(layer, [10, 11], [2, 3], k_cache, v_cache)  # only past the cached
    stream.commit(timeout=30)
    assert lease.is_committed
    assert_blocks_equal(src, dst, [10, 11], [5, 6])
    after = [t for pair in dst for t in pair]
    assert all(torch.equal(a[[3, 4]], b[[3, 4]]) for a, b in zip(after, cached_before))

    bad = ep.leases.open("req-d", [7, 8, 9], first_block=1)
    stream = ep.sender.open_stream("req-d", bad.lease_id)
    with pytest.raises((TransferError, ValueError)):
        for layer, (k_cache, v_cache) in enumerate(src):
            stream.send_layer(layer, [10, 11, 12], [0, 1, 2], k_cache, v_cache)
        stream.commit(timeout=30)
    assert not bad.is_committed
    assert all(torch.equal(a[7], b[7]) for a, b in zip(after, cached_before))  # untouched
