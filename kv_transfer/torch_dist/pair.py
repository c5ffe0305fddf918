"""torch.distributed transport: point-to-point send/recv over a 2-rank group per sender.

Pairs form dynamically, so there is no global ``init_process_group``. The receiver hosts a
TCPStore at host:port as the rendezvous; each new sender takes a pair number with
``store.add("pairs", 1)`` and both sides build ``ProcessGroupGloo(PrefixStore("pair/<n>"),
rank, 2)`` directly (sender rank 0, receiver rank 1), bound to the given host. The backend
follows the cache device ("nccl" for CUDA, else "gloo"); the receiver publishes it in the store.

Messages (all tensors, no pickle) from sender to receiver, in order on tag 0:
    int64 [op, stream_tag, header_len, payload_len], then uint8 header, then uint8 payload.
After a COMMIT the receiver answers on tag 1 with int64 [stream_tag, accepted, rejected,
reasons_len] and, if reasons_len > 0, the utf-8 reasons joined by newlines as uint8.

A gloo recv that times out closes the pair, so an idle sender sends PING every
idle_timeout/4 and the receiver drops a pair silent for idle_timeout (a dead sender).
Only the sender thread talks on a pair, so each message is sent whole under one lock.

Security. With a cluster token the rendezvous is authenticated: for pair n the receiver
writes a random nonce under ``pair/<n>/nonce``, the sender answers HMAC-SHA256(token, nonce)
under ``pair/<n>/proof``, and the receiver builds the pair's group only for a right answer
(``pair/<n>/verdict``), so a sender without the token never gets a pair. The store, gloo and
NCCL themselves carry no authentication or encryption, though: anyone on the network can
reach the store's port. So the receiver refuses to listen off loopback unless the operator
declares the network private (``private_network=True``, config ``kv_private_network``).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac

import torch
import torch.distributed as dist

OP_FRAME, OP_COMMIT, OP_ABORT, OP_PING, OP_CLOSE = 1, 2, 3, 4, 5
TAG_DATA, TAG_ACK = 0, 1
VERDICT_OK, VERDICT_REFUSED = b"ok", b"refused"


def token_proof(token: str, nonce: bytes) -> bytes:
    return hmac.new(token.encode(), nonce, hashlib.sha256).hexdigest().encode()


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
