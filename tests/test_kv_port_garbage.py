"""Random bytes and truncated frames sent to a decode worker's KV port are rejected, and the
worker stays up: a normal request afterwards gets its exact greedy output, every block back.

Three layers of garbage: raw TCP (random bytes, a cut HTTP/2 preface, an HTTP/2 frame that
promises more than it sends), well-formed calls carrying malformed messages (random bytes
where a KvFrame belongs, cut protobuf fields, cut msgpack headers, payloads cut short), and
streams abandoned in the middle.
"""

from __future__ import annotations

import random
import socket
import struct

import grpc
import pytest
import torch

from kv_transfer.frame import encode_commit_frame, encode_kv_frame
from kv_transfer.transport_grpc import PUSH_FRAMES, serialize_kv_frame
from pdserve.cluster.local import ClusterSpec, LocalCluster
from protos import pdserve_pb2 as pb
from tests.cluster_utils import assert_all_blocks_free, generate_concurrently, worker_statuses
from tests.conftest import tiny_llama_dir
from tests.test_disagg import engine_reference, mixed_prompts

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path, _ = tiny_llama_dir(tmp_path_factory.mktemp("garbage"), num_kv_heads=2, seed=4)
    return path


def _host_port(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def send_raw_garbage(endpoint: str, rng: random.Random) -> None:
    """Bytes that are no protocol at all, and HTTP/2 cut at its every layer; each on its own
    connection, closed by us mid-way."""
    http2_settings = struct.pack(">I", 0)[1:] + b"\x04\x00" + struct.pack(">I", 0)
    big_headers = struct.pack(">I", 16384)[1:] + b"\x01\x04" + struct.pack(">I", 1) + b"x" * 10
    payloads = [
        rng.randbytes(65536),
        HTTP2_PREFACE[:11],
        HTTP2_PREFACE + rng.randbytes(4096),
        HTTP2_PREFACE + http2_settings + big_headers,  # a HEADERS frame cut short
        b"\x00" * 9,
    ]
    for data in payloads:
        with socket.create_connection(_host_port(endpoint), timeout=5) as s:
            try:
                s.sendall(data)
                s.settimeout(0.5)
                s.recv(1024)  # whatever the server answers (a GOAWAY, or nothing)
            except OSError:
                pass  # the server may hang up first: that is a rejection too


def _kv_frame(num_kv_heads: int, head_dim: int, lease_id="no-such-lease"):
    kv = torch.randn(2, 1, BLOCK_SIZE, num_kv_heads, head_dim)
    return encode_kv_frame("garbage", lease_id, 0, [0], kv)


def _flip_a_bit(data: bytes, rng: random.Random) -> bytes:
    damaged = bytearray(data)
    damaged[rng.randrange(len(damaged))] ^= 1 << rng.randrange(8)
    return bytes(damaged)


def malformed_kv_frames(rng: random.Random, heads: int, head_dim: int) -> list[bytes]:
    """KvFrame messages (protobuf bytes) that are wrong in every way the parser sees first."""
    header, payload = _kv_frame(heads, head_dim)
    whole = serialize_kv_frame((header, payload))
    return [
        rng.randbytes(1000),  # not protobuf
        whole[: len(whole) // 2],  # the payload field runs past the message's end
        b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",  # a varint that never ends
        b"\x0b\x00",  # a wire type protobuf does not have (3, start group)
        serialize_kv_frame((rng.randbytes(64), payload)),  # random header bytes
        serialize_kv_frame((header[: len(header) // 2], payload)),  # msgpack cut short
        serialize_kv_frame((_flip_a_bit(header, rng), payload)),  # a header field damaged
        serialize_kv_frame((header, memoryview(bytes(payload)[:-7]))),  # payload cut short
        serialize_kv_frame((b"", b"")),  # nothing at all
        serialize_kv_frame(encode_commit_frame("garbage", "x" * 300, 1)),  # id too long
    ]


def push_raw_grpc(endpoint: str, messages: list[bytes]) -> pb.PushAck:
    with grpc.insecure_channel(endpoint) as channel:
        push = channel.stream_unary(
            PUSH_FRAMES,
            request_serializer=lambda b: b,
            response_deserializer=pb.PushAck.FromString,
        )
        return push(iter(messages), timeout=30)


def abandon_grpc_stream(endpoint: str, messages: list[bytes]) -> None:
    """Start a stream, send some frames, and walk away without finishing it."""

    def frames():
        yield from messages
        raise RuntimeError("the sender dies mid-stream")

    with grpc.insecure_channel(endpoint) as channel:
        push = channel.stream_unary(PUSH_FRAMES, request_serializer=lambda b: b)
        with pytest.raises(grpc.RpcError):
            push(frames(), timeout=30)


def push_flight_garbage(endpoint: str, rng: random.Random, heads: int, head_dim: int) -> dict:
    import msgpack
    import pyarrow as pa
    from pyarrow import flight

    from kv_transfer.transport_flight import SCHEMA

    header, payload = _kv_frame(heads, head_dim)
    client = flight.FlightClient(f"grpc+tcp://{endpoint}")
    try:
        descriptor = flight.FlightDescriptor.for_command(b"garbage")
        wrong = pa.schema([pa.field("kv", pa.float32())])
        writer, _ = client.do_put(descriptor, wrong)
        with pytest.raises(flight.FlightError, match="schema"):
            writer.write_batch(pa.RecordBatch.from_arrays([pa.array([1.0])], schema=wrong))
            writer.close()

        writer, acks = client.do_put(descriptor, SCHEMA)

        def batch(data: bytes):
            return pa.RecordBatch.from_arrays([pa.array(list(data), pa.uint8())], schema=SCHEMA)

        writer.write_batch(batch(rng.randbytes(100)))  # no header at all
        writer.write_with_metadata(batch(rng.randbytes(100)), pa.py_buffer(rng.randbytes(50)))
        writer.write_with_metadata(batch(bytes(payload)[:-9]), pa.py_buffer(header))  # cut
        writer.write_with_metadata(batch(bytes(payload)), pa.py_buffer(header[:20]))  # cut
        writer.write_metadata(pa.py_buffer(rng.randbytes(30)))
        writer.done_writing()
        ack = msgpack.unpackb(memoryview(acks.read()), raw=False)
        writer.close()
        return ack
    finally:
        client.close()


@pytest.mark.parametrize("kv_transport", ["grpc", "flight"])
def test_garbage_on_the_kv_port_is_rejected_and_the_worker_keeps_serving(tiny_model, kv_transport):
    rng = random.Random(1234)
    prompts = [p[:40] for p in mixed_prompts(3, seed=41)]
    reference = engine_reference(tiny_model, prompts, new_tokens=12)
    spec = ClusterSpec(
        model=str(tiny_model), kv_transport=kv_transport, num_blocks=128, max_model_len=256
    )
    with LocalCluster(spec) as cluster:
        (status,) = [s for s in worker_statuses(cluster) if s.role == "decode"]
        kv = status.kv_endpoint
        heads, head_dim = 2, 64 // 4  # tiny_llama_dir: 4 heads of 16, 2 kv heads
        send_raw_garbage(kv, rng)
        if kv_transport == "grpc":
            garbage = malformed_kv_frames(rng, heads, head_dim)
            ack = push_raw_grpc(kv, garbage)
            assert ack.frames_accepted == 0 and ack.frames_rejected == len(garbage)
            assert len(ack.errors) == len(garbage)
            assert any("malformed KvFrame" in e for e in ack.errors)
            assert any("payload is" in e for e in ack.errors)  # the cut payload, by size
            assert any("header checksum mismatch" in e for e in ack.errors)
            abandon_grpc_stream(kv, garbage[:3])  # none parses: none reaches the receiver
            errors = list(ack.errors)
        else:
            ack = push_flight_garbage(kv, rng, heads, head_dim)
            assert ack["accepted"] == 0 and ack["rejected"] == 5, ack
            assert any("no frame header" in e for e in ack["errors"])
            errors = ack["errors"]
        send_raw_garbage(kv, rng)  # and once more after the well-formed calls

        # Frames that got past the message parser were the receiver's to reject and count.
        unparsed = ("malformed KvFrame", "message carries no frame header")
        to_receiver = [e for e in errors if not e.startswith(unparsed)]
        (after,) = [s for s in worker_statuses(cluster) if s.role == "decode"]
        assert after.frames_rejected - status.frames_rejected == len(to_receiver)
        requests = [{"token_ids": p, "max_tokens": 12, "ignore_eos": True} for p in prompts]
        outs = generate_concurrently(cluster, requests)
        assert [o.token_ids for o in outs] == reference
        assert cluster.router.decode.routable()  # never marked lost
        assert_all_blocks_free(cluster)
