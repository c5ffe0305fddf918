"""One prompt's KV pushed between two processes: the sender in this one, the receiver (its
cache, lease table and transport server) in a child, as between two worker processes. The
child takes commands over a pipe as JSON lines (no pickle): open a lease, close one and say
what it received, hash its cache. Each push is timed from open_stream to the commit's ack,
as ``pdserve.measure.kv_push.measure_transport`` times its in-process pushes.

Also the single-thread memcpy limit: numpy copying the same bytes, one thread, best of N.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time

import crc32c
import numpy as np
import torch

from pdserve.measure.kv_push import KVShape, TransportResult

TOKEN = "bench-transfer"  # the child's server checks it, as a worker's does


def memcpy_mb_s(nbytes: int, repeats: int) -> list[float]:
    """MB/s of one thread copying ``nbytes`` between two buffers (both touched first)."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        rates.append(nbytes / (time.perf_counter() - start) / 1e6)
    return rates


def _cache_crc(cache, block_ids) -> int:
    crc = 0
    for k, v in cache:
        for t in (k, v):
            crc = crc32c.crc32c(t[block_ids].contiguous().view(torch.uint8).numpy(), crc)
    return crc


def _serve(conn, name: str, shape: KVShape) -> None:
    """The child: a receiver on ``name``, driven by ``conn``'s commands."""
    from kv_transfer.lease import LeaseTable
    from kv_transfer.receiver import KVReceiver
    from kv_transfer.sender import start_receiver_server

    dst = shape.make_cache(zero=True)
    leases = LeaseTable(default_ttl_s=300.0, num_layers=shape.num_layers)
    server = start_receiver_server(name, KVReceiver(dst, leases), host="127.0.0.1", token=TOKEN)
    conn.send_bytes(json.dumps({"endpoint": server.endpoint}).encode())
    try:
        while True:
            cmd = json.loads(conn.recv_bytes())
            if cmd["op"] == "open":
                lease = leases.open(cmd["tag"], range(shape.num_blocks))
                reply = {"lease": lease.lease_id}
            elif cmd["op"] == "close":
                lease = leases.close(cmd["lease"])
                reply = {"bytes": lease.bytes_received, "committed": lease.is_committed}
            elif cmd["op"] == "crc":
                reply = {"crc": _cache_crc(dst, list(range(shape.num_blocks)))}
            else:
                break
            conn.send_bytes(json.dumps(reply).encode())
    finally:
        server.stop()


def _reply(conn, proc, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if not proc.is_alive():
            raise RuntimeError(f"the receiver process died (exit {proc.exitcode}) before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the receiver process did not answer {what} within {timeout} s")
    return json.loads(conn.recv_bytes())


def _ask(conn, proc, **cmd) -> dict:
    conn.send_bytes(json.dumps(cmd).encode())
    return _reply(conn, proc, 60, cmd["op"])


def measure_transport_processes(
    name: str, shape: KVShape, repeats: int, loopback_best: float, seed: int = 0
) -> TransportResult:
    """``measure_transport`` with the receiver in a second process."""
    from kv_transfer.sender import make_sender

    torch.manual_seed(seed)
    src = shape.make_cache()
    src_ids = shape.source_ids()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child, name, shape), daemon=True)
    proc.start()
    seconds, ok, frames = [], True, 0
    try:
        endpoint = _reply(parent, proc, 120, "its start")["endpoint"]
        sender = make_sender(name, endpoint, token=TOKEN)
        try:
            for i in range(repeats + 1):  # the first connects and allocates: not timed
                lease_id = _ask(parent, proc, op="open", tag=f"push-{i}")["lease"]
                start = time.perf_counter()
                stream = sender.open_stream(f"push-{i}", lease_id)
                for layer, (k, v) in enumerate(src):
                    stream.send_layer(layer, src_ids, range(shape.num_blocks), k, v)
                stats = stream.commit(timeout=120)
                sec = time.perf_counter() - start
                got = _ask(parent, proc, op="close", lease=lease_id)
                ok &= got["committed"] and stats.bytes == got["bytes"] == shape.bytes_per_push
                if i:
                    seconds.append(sec)
                    frames = stats.frames
        finally:
            sender.close()
        ok &= _ask(parent, proc, op="crc")["crc"] == _cache_crc(src, src_ids)
        parent.send_bytes(json.dumps({"op": "stop"}).encode())
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    rates = [shape.bytes_per_push / s / 1e6 for s in seconds]
    best = max(rates)
    return TransportResult(
        name, shape.kv_dtype, shape.bytes_per_push, seconds, best,
        statistics.median(rates), best / loopback_best, frames, ok,
    )  # fmt: skip
