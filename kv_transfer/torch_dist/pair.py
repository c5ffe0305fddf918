"""torch.distributed transport: point-to-point send/recv over a 2-rank group per sender.

Pairs form dynamically, so there is no global ``init_process_group``. The receiver listens on
host:port, a plain TCP pairing port (kv_transfer.torch_dist.acceptor). A sender connects, both
prove the cluster token to each other (kv_transfer.torch_dist.handshake), and both build
``ProcessGroupGloo(store, rank, 2)`` directly (sender rank 0, receiver rank 1), bound to the
given host, on a store that is the pairing connection itself (kv_transfer.torch_dist.pairstore:
every frame MACed with a key from the handshake). The backend follows the cache device ("nccl"
for CUDA, else "gloo"); the receiver names it in the pair's parameters, its first frame.

Messages (all tensors, no pickle) from sender to receiver, in order on tag 0:
    int64 [op, stream_tag, header_len, payload_len], then uint8 header, then uint8 payload.
After a COMMIT the receiver answers on tag 1 with int64 [stream_tag, accepted, rejected,
reasons_len] and, if reasons_len > 0, the utf-8 reasons joined by newlines as uint8.

A gloo recv that times out closes the pair, so an idle sender sends PING every
idle_timeout/4 and the receiver drops a pair silent for idle_timeout (a dead sender).
Only the sender thread talks on a pair, so each message is sent whole under one lock.

Security. With a cluster token, neither side pairs with a peer that cannot prove it, and a
pair's thread, slot and gloo sockets exist only after both proofs: a client without the token
reaches the handshake only (one thread runs all of them; deadlines, caps, a guarded loop:
see the acceptor). Nothing a pair reads before its group is up (backend, timeouts, the gloo
addresses) comes from anywhere an outsider can write. gloo and NCCL themselves carry no
authentication or encryption, though: anyone on the network can reach their sockets once a
pair is up. So the receiver refuses to listen off loopback unless the operator declares the
network private (``private_network=True``, config ``kv_private_network``).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

OP_FRAME, OP_COMMIT, OP_ABORT, OP_PING, OP_CLOSE = 1, 2, 3, 4, 5
TAG_DATA, TAG_ACK = 0, 1


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def make_pair_group(backend: str, store, rank: int, timeout_s: float, host: str):
    """A 2-rank process group on ``store`` (already prefixed for the pair)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        opts._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, 2, opts)
    # NCCL: untested here (no GPU in CI); a CUDA cache needs the tensors below on its device.
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, 2, opts)


def as_tensor(data, device: torch.device) -> torch.Tensor:
    # bytearray: torch.frombuffer wants a writable buffer; headers are small, payloads
    # arrive as writable views of the gathered tensor and are not copied.
    buf = data if isinstance(data, memoryview) and not data.readonly else bytearray(data)
    return torch.frombuffer(buf, dtype=torch.uint8).to(device)


class Pair:
    """One end of a pair group; sends and receives whole messages."""

    def __init__(self, group, peer: int, device: torch.device):
        self.group, self.peer, self.device = group, peer, device

    def send(self, t: torch.Tensor, tag: int) -> None:
        self.group.send([t], self.peer, tag).wait()

    def recv(self, n: int, dtype: torch.dtype, tag: int) -> torch.Tensor:
        t = torch.empty(n, dtype=dtype, device=self.device)
        self.group.recv([t], self.peer, tag).wait()
        return t.cpu()

    def send_ints(self, values, tag: int) -> None:
        self.send(torch.tensor(values, dtype=torch.int64, device=self.device), tag)
