"""The limits `bench transfer` measures in the same run: loopback TCP, and the bare stacks.

Loopback is a thread writing 4 MiB buffers with ``sendall`` to a thread reading them with
``recv_into`` over 127.0.0.1. The stacks: a bare grpcio client stream of ``bytes`` messages
(identity serializers, a server that only counts them) and a bare Arrow Flight ``DoPut`` of
uint8 record batches: what any transport built on each can reach at best here.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np

MiB = 1024 * 1024


# ---- loopback limit -------------------------------------------------------------------------


def _drain(listener: socket.socket, total: int, chunk: int, done: list[float]) -> None:
    conn, _ = listener.accept()
    with conn:
        buf = bytearray(chunk)
        got = 0
        while got < total:
            n = conn.recv_into(buf)
            if n == 0:
                break
            got += n
    done.append(time.perf_counter())


def loopback_seconds(total_bytes: int, chunk: int = 4 * MiB) -> float:
    """Seconds to move ``total_bytes`` through a 127.0.0.1 TCP connection, thread to thread."""
    listener = socket.create_server(("127.0.0.1", 0))
    done: list[float] = []
    chunks = max(1, total_bytes // chunk)
    reader = threading.Thread(target=_drain, args=(listener, chunks * chunk, chunk, done))
    reader.start()
    try:
        with socket.create_connection(listener.getsockname()) as sock:
            buf = np.random.default_rng(0).bytes(chunk)
            start = time.perf_counter()
            for _ in range(chunks):
                sock.sendall(buf)
            reader.join()
    finally:
        listener.close()
    return done[0] - start


def loopback_mb_s(total_bytes: int, repeats: int) -> list[float]:
    return [total_bytes / loopback_seconds(total_bytes) / 1e6 for _ in range(repeats)]


# ---- the Python gRPC stack's own ceiling -----------------------------------------------------


def grpc_stack_seconds(total_bytes: int, chunk: int = 4 * MiB, calls: int = 3) -> float:
    """Best seconds for a bare grpcio client stream of ``chunk``-byte messages (identity
    serializers, a server that only counts them) to carry ``total_bytes``: what any transport
    built on Python gRPC can reach at best on this machine."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from kv_transfer.transport_grpc import message_options

    def count(messages, context):
        return str(sum(len(m) for m in messages)).encode()

    handler = grpc.method_handlers_generic_handler(
        "bench.Sink", {"Push": grpc.stream_unary_rpc_method_handler(count)}
    )
    server = grpc.server(ThreadPoolExecutor(max_workers=2), options=message_options())
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    payload = np.random.default_rng(0).bytes(chunk)
    n = max(1, total_bytes // chunk)
    best = float("inf")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=message_options()) as channel:
            push = channel.stream_unary("/bench.Sink/Push")
            push(iter([payload]))  # connect
            for _ in range(calls):
                start = time.perf_counter()
                received = int(push(iter([payload] * n)))
                best = min(best, time.perf_counter() - start)
                if received != n * chunk:
                    raise RuntimeError(f"bare gRPC stream lost bytes: {received} of {n * chunk}")
    finally:
        server.stop(None)
    return best * total_bytes / (n * chunk)


def _start_flight_sink():
    """A Flight server on 127.0.0.1 that only counts the bytes of the batches put to it."""
    import pyarrow as pa
    from pyarrow import flight

    class Sink(flight.FlightServerBase):
        def do_put(self, context, descriptor, reader, writer):
            received = sum(chunk.data.column(0).buffers()[1].size for chunk in reader)
            writer.write(pa.py_buffer(str(received).encode()))

    return Sink("grpc+tcp://127.0.0.1:0")


def flight_stack_seconds(total_bytes: int, chunk: int = 4 * MiB, calls: int = 3) -> float:
    """Best seconds for a bare Arrow Flight DoPut of ``chunk``-byte uint8 record batches (the
    flight transport's stack, nothing of ours) to carry ``total_bytes``."""
    import pyarrow as pa
    from pyarrow import flight

    payload = np.frombuffer(np.random.default_rng(0).bytes(chunk), dtype=np.uint8)
    column = pa.Array.from_buffers(pa.uint8(), chunk, [None, pa.py_buffer(payload)])
    batch = pa.RecordBatch.from_arrays([column], names=["kv"])
    n = max(1, total_bytes // chunk)
    server = _start_flight_sink()
    client = flight.FlightClient(f"grpc+tcp://127.0.0.1:{server.port}")

    def put(count: int) -> int:
        writer, acks = client.do_put(flight.FlightDescriptor.for_command(b"bench"), batch.schema)
        for _ in range(count):
            writer.write_batch(batch)
        writer.done_writing()
        received = acks.read()
        writer.close()
        return int(received.to_pybytes())

    best = float("inf")
    try:
        put(1)  # connect
        for _ in range(calls):
            start = time.perf_counter()
            received = put(n)
            best = min(best, time.perf_counter() - start)
            if received != n * chunk:
                raise RuntimeError(f"bare Flight stream lost bytes: {received} of {n * chunk}")
    finally:
        client.close()
        server.shutdown()
    return best * total_bytes / (n * chunk)
