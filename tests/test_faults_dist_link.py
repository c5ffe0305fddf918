"""A torch_dist (gloo) link whose receiver dies: the next stream on it fails at once instead of
hanging the sender, the broken link is dropped, a reconnect while the peer is still gone fails
fast, and once a receiver is back on the endpoint the same sender reconnects and delivers. And
a receiver that hangs fails its stream's commit at the commit's timeout, not gloo's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from kv_transfer.sender import TransferError, make_sender

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 2, 16, 4, 2, 8
FAST_S = 15.0  # a dead peer is noticed well within this (the gloo timeout is 60 s)

RECEIVER = f"""
import sys, torch
from kv_transfer.lease import LeaseTable
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import start_receiver_server
shape = ({BLOCKS}, {BLOCK_SIZE}, {HEADS}, {HEAD_DIM})
cache = [(torch.zeros(shape), torch.zeros(shape)) for _ in range({LAYERS})]
leases = LeaseTable(default_ttl_s=300)
for i in range(8):
    leases.open(f"r{{i}}", [0, 1], lease_id=f"lease-{{i}}")
receiver = KVReceiver(cache, leases)
server = start_receiver_server("torch_dist", receiver, "127.0.0.1", int(sys.argv[1]))
print("READY", server.endpoint, flush=True)
sys.stdin.read()
"""


def start_receiver(port: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    assert line.startswith("READY "), line
    return proc, line.split()[1]


def transfer(sender, i: int):
    src = [(torch.randn(BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM),) * 2 for _ in range(LAYERS)]
    stream = sender.open_stream(f"r{i}", f"lease-{i}")
    for layer, (k, v) in enumerate(src):
        stream.send_layer(layer, [3, 7], [0, 1], k, v)
    return stream.commit(timeout=30)


def test_a_dead_receiver_is_dropped_and_the_link_comes_back_with_it():
    first, endpoint = start_receiver(0)
    port = int(endpoint.rpartition(":")[2])
    second = None
    sender = make_sender("torch_dist", endpoint)
    try:
        assert transfer(sender, 0).frames == LAYERS
        first.kill()  # kill -9: no goodbye on the pair
        first.wait()

        started = time.monotonic()
        with pytest.raises((TransferError, ConnectionError, OSError)):
            transfer(sender, 1)
        assert time.monotonic() - started < FAST_S
        assert sender._link.broken  # the sender knows, and will not reuse it

        started = time.monotonic()
        with pytest.raises(OSError):  # ConnectionRefusedError: nobody listens there now
            sender.open_stream("r2", "lease-2")
        assert time.monotonic() - started < FAST_S
        assert sender.reconnects == 0

        second, again = start_receiver(port)
        assert again == endpoint
        assert transfer(sender, 3).frames == LAYERS  # same sender, a new pair
        assert sender.reconnects == 1 and not sender._link.broken
        assert transfer(sender, 4).frames == LAYERS
    finally:
        sender.close()
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.stdin.close()
                proc.kill()
                proc.wait()


def test_a_hung_receiver_fails_the_commit_at_its_own_timeout_and_breaks_the_link():
    """A receiver that stops answering (SIGSTOP: alive, its sockets open) leaves the sender
    thread inside a gloo send until the pair's timeout. The commit still fails at the timeout
    its caller gave, with a TransferError, and the link is marked broken for the next stream
    instead of waiting on the stuck pair."""
    receiver, endpoint = start_receiver(0)
    sender = make_sender("torch_dist", endpoint, timeout_s=8.0)
    try:
        assert transfer(sender, 0).frames == LAYERS
        os.kill(receiver.pid, signal.SIGSTOP)
        stream = sender.open_stream("r1", "lease-1")
        k = torch.randn(BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
        for layer in range(LAYERS):
            stream.send_layer(layer, [3, 7], [0, 1], k, k)
        started = time.monotonic()
        with pytest.raises(TransferError, match="commit failed"):
            stream.commit(timeout=1.0)
        assert time.monotonic() - started < 3.0  # its own 1 s, not gloo's 8 s
        assert sender._link.broken
    finally:
        receiver.kill()
        receiver.wait()
        sender.close()
