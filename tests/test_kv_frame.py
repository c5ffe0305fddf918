"""KV frames and leases: round trips, and every malformed frame rejected with a reason."""

from __future__ import annotations

import os
import threading
import time

import msgpack
import pytest
import torch

from kv_transfer.frame import (
    FORMAT_VERSION,
    MAX_FRAME_BYTES,
    FrameError,
    checksum,
    decode_frame,
    encode_commit_frame,
    encode_kv_frame,
    seal_header,
)
from kv_transfer.lease import LeaseTable
from kv_transfer.receiver import KVReceiver

# decode_frame views protobuf bytes without copying; torch warns once about read-only buffers.
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 4, 16, 4, 2, 8


def make_cache(fill: float | None = None, dtype=torch.float32):
    shape = (BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
    new = (lambda: torch.full(shape, fill, dtype=dtype)) if fill is not None else None
    new = new or (lambda: torch.randn(shape).to(dtype))
    return [(new(), new()) for _ in range(LAYERS)]


def kv_for(n_blocks: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(2, n_blocks, BLOCK_SIZE, HEADS, HEAD_DIM).to(dtype)


def repack(header: bytes, **changes) -> bytes:
    """The header with ``changes``, sealed again: its fields, not its CRC, are what is wrong."""
    fields = msgpack.unpackb(header)
    fields.update(changes)
    return seal_header(fields)


@pytest.fixture
def receiver():
    events = []
    rx = KVReceiver(
        make_cache(0.0),
        LeaseTable(default_ttl_s=30.0),
        on_event=lambda *e: events.append(e),
        pending_lease_wait_s=0.05,  # frames for an unknown lease wait this long, then fail
    )
    rx.events = events
    return rx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_frame_round_trips_exactly(dtype):
    kv = kv_for(3, dtype)
    header, payload = encode_kv_frame("req-1", "lease-1", 2, [7, 1, 5], kv)
    h, out = decode_frame(header, bytes(payload))
    assert (h.kind, h.request_id, h.lease_id, h.layer) == ("kv", "req-1", "lease-1", 2)
    assert h.blocks == (7, 1, 5) and h.shape == tuple(kv.shape)
    assert h.dtype == str(dtype).removeprefix("torch.")
    assert h.checksum == checksum(payload)
    assert torch.equal(out, kv)


def test_checksum_is_crc32c():
    # The standard CRC-32C check value (RFC 3720, iSCSI): the receiver of another
    # implementation can verify frames by the spec alone.
    assert checksum(b"123456789") == 0xE3069283
    assert checksum(memoryview(b"123456789")) == 0xE3069283


def test_version_1_frames_are_refused():
    header, payload = encode_kv_frame("r", "l", 0, [0], kv_for(1))
    with pytest.raises(FrameError, match="unsupported frame version 1"):
        decode_frame(repack(header, version=1), bytes(payload))


def test_kv_frame_payload_is_a_view_not_a_copy():
    kv = kv_for(2)
    _, payload = encode_kv_frame("r", "l", 0, [0, 1], kv)
    kv.view(-1)[0] = 123.0
    assert torch.frombuffer(bytearray(payload), dtype=torch.float32)[0] == 123.0


def test_commit_frame_round_trips():
    h, out = decode_frame(*encode_commit_frame("req-1", "lease-1", 12))
    assert (h.kind, h.num_frames, out) == ("commit", 12, None)


def test_decode_accepts_a_uint8_tensor_payload():
    kv = kv_for(1)
    header, payload = encode_kv_frame("r", "l", 0, [3], kv)
    _, out = decode_frame(header, torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    assert torch.equal(out, kv)


def without_header_crc(header: bytes) -> dict:
    return {k: v for k, v in msgpack.unpackb(header).items() if k != "header_crc"}


def sealed_bytes(body: bytes) -> bytes:
    """``body`` followed by its CRC-32C: it passes the header CRC, whatever it holds."""
    return body + checksum(body).to_bytes(4, "little")


def with_crc_first(header: bytes) -> bytes:
    """A map that ends with a valid CRC trailer but names header_crc first, not last."""
    fields = {"header_crc": b"0000", **without_header_crc(header), "pad": b"\0\0\0\0"}
    return sealed_bytes(msgpack.packb(fields)[:-4])


def garbage_headers():
    good, _ = encode_commit_frame("r", "l", 0)
    rng = torch.Generator().manual_seed(0)
    random = bytes(torch.randint(0, 256, (64,), generator=rng, dtype=torch.uint8).tolist())
    return {
        "random bytes": random,
        "empty": b"",
        "truncated msgpack": good[: len(good) // 2],
        "msgpack list": msgpack.packb([1, 2, 3]),
        "msgpack int": msgpack.packb(7),
        "int keys": msgpack.packb({1: 2}),
        "version is str": repack(good, version="1"),
        "version is bool": repack(good, version=True),
        "blocks not ints": repack(good, blocks=["a"]),
        "negative block": repack(good, blocks=[-1]),
        "lease id missing": seal_header({"version": FORMAT_VERSION, "kind": "commit"}),
        "no header crc": msgpack.packb(without_header_crc(good)),
        "header crc not last": with_crc_first(good),
        "sealed non-msgpack": sealed_bytes(b"\xc1garbage\xc4\x04"),
        "not bytes": 12345,
        "huge header": b"\x00" * (65 * 1024),
        "os random": os.urandom(200),
    }


@pytest.mark.parametrize("name", list(garbage_headers()))
def test_garbage_headers_raise_frame_error(name):
    with pytest.raises(FrameError) as err:
        decode_frame(garbage_headers()[name], b"")
    assert err.value.reason


def test_garbage_payload_types_raise_frame_error():
    header, _ = encode_kv_frame("r", "l", 0, [0], kv_for(1))
    for payload in (None, 3.5, torch.zeros(4), object()):
        with pytest.raises(FrameError):
            decode_frame(header, payload)


def reject_reason(rx: KVReceiver, header, payload) -> str:
    before = rx.frames_rejected
    with pytest.raises(FrameError) as err:
        rx.accept(header, payload)
    assert rx.frames_rejected == before + 1
    return err.value.reason


def test_receiver_rejects_each_malformed_frame_then_keeps_serving(receiver):
    leases = receiver.leases
    lease = leases.open("req", [0, 1, 2, 3])
    kv = kv_for(2)
    header, payload = encode_kv_frame("req", lease.lease_id, 1, [2, 3], kv)
    payload = bytes(payload)
    short = leases.open("req-x", [4], ttl_s=0.001)
    time.sleep(0.01)
    cases = {
        "unsupported frame version": (repack(header, version=FORMAT_VERSION + 1), payload),
        "checksum mismatch": (header, payload[:-1] + bytes([payload[-1] ^ 1])),
        "payload is": (header, payload[:-4]),
        "does not match cache": (
            encode_kv_frame("req", lease.lease_id, 1, [2, 3], kv[:, :, :, :1].contiguous())
        ),
        "dtype float16 does not match": (
            encode_kv_frame("req", lease.lease_id, 1, [2, 3], kv.half())
        ),
        "not allowed": (repack(header, dtype="complex64"), payload),
        "unknown lease": encode_kv_frame("req", "no-such-lease", 1, [2, 3], kv),
        "expired": encode_kv_frame("req-x", short.lease_id, 0, [0], kv_for(1)),
        "outside lease": encode_kv_frame("req", lease.lease_id, 1, [3, 9], kv),
        "out of range": encode_kv_frame("req", lease.lease_id, LAYERS, [2, 3], kv),
        "another request": encode_kv_frame("other", lease.lease_id, 1, [2, 3], kv),
        "does not end with its header_crc": (b"\xc1garbage", payload),
    }
    for expected, (bad_header, bad_payload) in cases.items():
        assert expected in reject_reason(receiver, bad_header, bad_payload)
    assert receiver.frames_accepted == 0 and lease.frames_received == 0
    assert torch.count_nonzero(receiver.kv_caches[1][0]) == 0  # nothing bad was written

    other = leases.open("req-2", [5, 6])
    receiver.accept(*encode_kv_frame("req-2", other.lease_id, 0, [1, 0], kv))
    receiver.accept(*encode_commit_frame("req-2", other.lease_id, 1))
    k_cache, v_cache = receiver.kv_caches[0]
    assert torch.equal(k_cache[6], kv[0, 0]) and torch.equal(v_cache[5], kv[1, 1])
    assert other.committed.is_set() and receiver.frames_accepted == 2


def test_commit_with_missing_frames_is_rejected(receiver):
    lease = receiver.leases.open("req", [0, 1])
    receiver.accept(*encode_kv_frame("req", lease.lease_id, 0, [0], kv_for(1)))
    reason = reject_reason(receiver, *encode_commit_frame("req", lease.lease_id, 2))
    assert "expected 2 frames, got 1" in reason
    assert not lease.committed.is_set()


def test_frames_after_commit_are_rejected(receiver):
    lease = receiver.leases.open("req", [0])
    receiver.accept(*encode_commit_frame("req", lease.lease_id, 0))
    frame = encode_kv_frame("req", lease.lease_id, 0, [0], kv_for(1))
    assert "already committed" in reject_reason(receiver, *frame)


def test_events_report_layers_before_commit(receiver):
    lease = receiver.leases.open("req", [0, 1])
    for layer in range(LAYERS):
        receiver.accept(*encode_kv_frame("req", lease.lease_id, layer, [1, 0], kv_for(2)))
    receiver.accept(*encode_commit_frame("req", lease.lease_id, LAYERS))
    expected = [("kv", lease.lease_id, layer) for layer in range(LAYERS)]
    assert receiver.events == expected + [("commit", lease.lease_id, -1)]


def test_max_frame_bytes_fits_under_grpc_default():
    assert MAX_FRAME_BYTES + 64 * 1024 < 4 * 1024 * 1024


def test_lease_expires_after_deadline():
    table = LeaseTable(default_ttl_s=0.05)
    lease = table.open("req", [1, 2])
    assert table.get(lease.lease_id) is lease and table.pop_expired() == []
    assert table.pop_expired(now=lease.deadline + 1.0) == [lease]
    with pytest.raises(FrameError, match="unknown lease"):
        table.get(lease.lease_id)
    assert len(table) == 0


def test_expired_lease_get_fails_before_pop():
    table = LeaseTable(default_ttl_s=0.001)
    lease = table.open("req", [1])
    time.sleep(0.01)
    with pytest.raises(FrameError, match="expired"):
        table.get(lease.lease_id)


def test_a_committed_lease_gets_a_fresh_window_and_then_expires_too():
    table = LeaseTable(default_ttl_s=0.05)
    lease = table.open("req", [1])
    time.sleep(0.06)  # past the first deadline, then committed: the attach window starts now
    lease.mark_committed()
    assert lease.deadline >= lease.committed_at + 0.05
    assert table.pop_expired(now=lease.committed_at + 0.01) == []
    # Nobody attached (router crash, client gone): it expires like any other lease.
    assert table.pop_expired(now=lease.deadline + 0.01) == [lease]
    assert table.close(lease.lease_id) is None


def test_close_is_idempotent():
    table = LeaseTable(default_ttl_s=1.0)
    lease = table.open("req", [1])
    assert table.close(lease.lease_id) is lease
    assert table.close(lease.lease_id) is None


def test_extend_moves_the_deadline():
    table = LeaseTable(default_ttl_s=0.001)
    lease = table.open("req", [1])
    table.extend(lease.lease_id, 60.0)
    assert table.pop_expired() == [] and table.get(lease.lease_id) is lease


def test_a_lease_opened_under_a_chosen_id_ends_a_wait_for_it():
    table = LeaseTable()
    threading.Timer(0.05, lambda: table.open("req", [3, 8], lease_id="mine")).start()
    table.wait_for("mine", timeout=5)
    assert table.get("mine").block_ids == (3, 8) and "mine" in table
    with pytest.raises(ValueError, match="already exists"):
        table.open("req", [4], lease_id="mine")


def test_a_wait_for_a_refused_or_absent_lease_fails():
    table = LeaseTable()
    table.refuse("gone", "need 3 blocks, 1 free")
    with pytest.raises(FrameError, match="refused: need 3 blocks, 1 free"):
        table.wait_for("gone", timeout=5)
    with pytest.raises(FrameError, match="unknown lease"):
        table.wait_for("never", timeout=0.05)
    for i in range(LeaseTable.MAX_REFUSED + 1):  # the memory of refusals is bounded
        table.refuse(f"r{i}", "full")
    with pytest.raises(FrameError, match="unknown lease"):
        table.wait_for("gone", timeout=0.0)


def flipped_bits(header: bytes):
    """Every copy of ``header`` with one bit flipped: (byte index, damaged header)."""
    for i in range(len(header)):
        for bit in range(8):
            damaged = bytearray(header)
            damaged[i] ^= 1 << bit
            yield i, bytes(damaged)


def test_every_flipped_header_bit_is_refused_before_a_field_is_read():
    """The payload CRC cannot see the header: a flipped bit in ``layer``, ``blocks``,
    ``lease_id`` or ``num_frames`` could make another valid header. The header CRC refuses
    every one, for kv and commit frames alike."""
    kv_header, payload = encode_kv_frame("req", "lease-7", 1, [2, 3], kv_for(2))
    commit_header, _ = encode_commit_frame("req", "lease-7", 5)
    for header, body in ((kv_header, bytes(payload)), (commit_header, b"")):
        assert decode_frame(header, body)[0].lease_id == "lease-7"  # intact, it decodes
        for i, damaged in flipped_bits(header):
            with pytest.raises(FrameError, match="header") as err:
                decode_frame(damaged, body)
            assert "checksum mismatch" in err.value.reason or i >= len(header) - 6, i


def test_a_resealed_header_field_decodes_so_only_the_header_crc_guards_it():
    # Why the header needs its own CRC: the payload's checksum passes another layer as well.
    header, payload = encode_kv_frame("req", "lease-7", 1, [2, 3], kv_for(2))
    h, _ = decode_frame(repack(header, layer=0, blocks=[3, 2]), payload)
    assert (h.layer, h.blocks) == (0, (3, 2))


def test_receiver_applies_no_frame_with_a_flipped_header_bit_and_keeps_serving(receiver):
    lease = receiver.leases.open("req", [4, 5, 6, 7])
    kv = kv_for(2)
    header, payload = encode_kv_frame("req", lease.lease_id, 1, [2, 3], kv)
    commit, _ = encode_commit_frame("req", lease.lease_id, 1)
    rejected = 0
    for frame, body in ((header, bytes(payload)), (commit, b"")):
        for _, damaged in flipped_bits(frame):
            reject_reason(receiver, damaged, body)
            rejected += 1
    assert receiver.frames_rejected == rejected and receiver.frames_accepted == 0
    assert lease.frames_received == 0 and not lease.is_committed and receiver.events == []
    assert all(torch.count_nonzero(k) == 0 for k, _ in receiver.kv_caches)  # nothing landed

    receiver.accept(header, payload)  # the intact frames still go where they belong
    receiver.accept(commit, b"")
    k_cache, v_cache = receiver.kv_caches[1]
    assert torch.equal(k_cache[[6, 7]], kv[0]) and torch.equal(v_cache[[6, 7]], kv[1])
    assert lease.is_committed
