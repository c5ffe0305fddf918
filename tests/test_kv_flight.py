"""The Arrow Flight KV transport: what arrives that is not a KV frame, and the cluster token."""

from __future__ import annotations

import time

import msgpack
import pyarrow as pa
import pytest
import torch
from pyarrow import flight

from kv_transfer.frame import encode_kv_frame
from kv_transfer.lease import LeaseTable
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import TransferError, make_sender
from kv_transfer.transport_flight import SCHEMA, FlightReceiverServer

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

TOKEN = "s3cret"
SHAPE = (8, 4, 2, 8)  # blocks, block_size, kv heads, head_dim


@pytest.fixture
def receiver():
    cache = [(torch.zeros(SHAPE), torch.zeros(SHAPE)) for _ in range(2)]
    return KVReceiver(cache, LeaseTable(default_ttl_s=30.0), pending_lease_wait_s=0.2)


def serve(receiver, token=None):
    return FlightReceiverServer(receiver, "127.0.0.1", 0, token=token)


def kv_batch(payload: bytes, nulls: bool = False) -> pa.RecordBatch:
    mask = [False] * len(payload)
    mask[0] = nulls
    column = pa.array(list(payload), type=pa.uint8(), mask=pa.array(mask) if nulls else None)
    return pa.RecordBatch.from_arrays([column], schema=SCHEMA)


def raw_put(endpoint: str, messages, schema=SCHEMA) -> dict:
    """DoPut ``messages`` ((batch or None, metadata or None) each); the server's acknowledgement."""
    client = flight.FlightClient(f"grpc+tcp://{endpoint}")
    writer, acks = client.do_put(flight.FlightDescriptor.for_command(b"raw"), schema)
    for batch, metadata in messages:
        meta = pa.py_buffer(metadata) if metadata is not None else None
        if batch is None:
            writer.write_metadata(meta)
        elif meta is None:
            writer.write_batch(batch)
        else:
            writer.write_with_metadata(batch, meta)
    writer.done_writing()
    buf = acks.read()
    writer.close()  # raises the call's error, if the server ended it with one
    client.close()
    return msgpack.unpackb(buf.to_pybytes())


def test_messages_that_are_not_kv_frames_are_rejected_and_the_good_one_lands(receiver):
    server = serve(receiver)
    lease = receiver.leases.open("r", [5])
    kv = torch.randn(2, 1, *SHAPE[1:])
    header, payload = encode_kv_frame("r", lease.lease_id, 1, [0], kv)
    good = kv_batch(bytes(payload))
    try:
        ack = raw_put(
            server.endpoint,
            [
                (None, b"\xc1garbage"),  # metadata only, not a msgpack header
                (good, None),  # a body without a header
                (kv_batch(bytes(payload), nulls=True), bytes(header)),  # nulls in the column
                (good, bytes(header)),
            ],
        )
    finally:
        server.stop()
    assert (ack["accepted"], ack["rejected"]) == (1, 3)
    assert "malformed header" in ack["errors"][0]
    assert "no frame header" in ack["errors"][1]
    assert "not plain uint8" in ack["errors"][2]
    k_cache, v_cache = receiver.kv_caches[1]
    assert torch.equal(k_cache[5], kv[0, 0]) and torch.equal(v_cache[5], kv[1, 0])


def test_a_stream_of_another_schema_is_refused_and_the_server_keeps_serving(receiver):
    server = serve(receiver)
    other = pa.schema([pa.field("x", pa.int32())])
    batch = pa.RecordBatch.from_arrays([pa.array([1, 2], type=pa.int32())], schema=other)
    try:
        with pytest.raises(flight.FlightError, match="schema"):
            raw_put(server.endpoint, [(batch, b"h")], schema=other)
        assert raw_put(server.endpoint, []) == {"accepted": 0, "rejected": 0, "errors": []}
    finally:
        server.stop()


def push_one_block(endpoint: str, receiver, token):
    lease = receiver.leases.open(f"r-{token}", [3])
    src = [(torch.randn(SHAPE), torch.randn(SHAPE)) for _ in range(2)]
    sender = make_sender("flight", endpoint, **({"token": token} if token else {}))
    try:
        stream = sender.open_stream(f"r-{token}", lease.lease_id)
        for layer, (k, v) in enumerate(src):
            stream.send_layer(layer, [6], [0], k, v)
        stream.commit(timeout=10)
    finally:
        sender.close()
    return src, lease


@pytest.mark.parametrize("token", [None, "wrong"])
def test_a_stream_without_the_cluster_token_is_refused(receiver, token):
    server = serve(receiver, token=TOKEN)
    try:
        with pytest.raises(TransferError, match="(?i)unauthenticated|token"):
            push_one_block(server.endpoint, receiver, token)
    finally:
        server.stop()
    assert receiver.frames_accepted == 0
    assert all(torch.count_nonzero(k) == 0 for k, _ in receiver.kv_caches)


def test_a_stream_with_the_cluster_token_lands(receiver):
    server = serve(receiver, token=TOKEN)
    try:
        src, lease = push_one_block(server.endpoint, receiver, TOKEN)
    finally:
        server.stop()
    assert lease.committed.is_set()
    for (k_src, v_src), (k_dst, v_dst) in zip(src, receiver.kv_caches, strict=True):
        assert torch.equal(k_dst[3], k_src[6]) and torch.equal(v_dst[3], v_src[6])


def test_stop_does_not_wait_for_a_stalled_stream(receiver):
    server = serve(receiver)
    lease = receiver.leases.open("r", [1])
    sender = make_sender("flight", server.endpoint)
    stream = sender.open_stream("r", lease.lease_id)
    k, v = torch.randn(SHAPE), torch.randn(SHAPE)
    stream.send_layer(0, [2], [0], k, v)  # no commit: the call stays open
    deadline = time.monotonic() + 5
    while receiver.frames_accepted == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.monotonic()
    server.stop(grace_s=0.5)
    assert time.monotonic() - start < 2.0
    stream.abort()
    sender.close()
