"""The cluster token on every KV transport that crosses a socket: a stream without it, or with
a wrong one, is refused and lands nothing; with it, the blocks land. No transport listens off
loopback without authentication, and torch_dist (whose data path has none past the
rendezvous) not without the operator's private-network flag. Worker RPCs: tests/test_auth.py."""

from __future__ import annotations

import pytest
import torch

from grpc_plumbing.auth import OpenBindError
from kv_transfer.lease import LeaseTable
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import TransferError, make_sender, start_receiver_server
from kv_transfer.transports import WORKER_TRANSPORTS
from tests.transport_params import transport_params

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

TOKEN = "transport-token"
# every transport a worker can be configured with (nixl skipped where NIXL is not installed)
SOCKET_TRANSPORTS = transport_params(WORKER_TRANSPORTS)
SHAPE = (8, 4, 2, 8)  # blocks, block size, kv heads, head dim


def make_receiver():
    cache = [(torch.zeros(SHAPE), torch.zeros(SHAPE)) for _ in range(2)]
    return KVReceiver(cache, LeaseTable(30.0), pending_lease_wait_s=0.2)


def push_one_block(transport: str, endpoint: str, lease, token: str | None):
    """Send both layers of one block into ``lease`` with ``token`` and commit."""
    src = [(torch.randn(SHAPE), torch.randn(SHAPE)) for _ in range(2)]
    sender = make_sender(transport, endpoint, **({"token": token} if token else {}))
    try:
        stream = sender.open_stream(lease.request_id, lease.lease_id)
        for layer, (k, v) in enumerate(src):
            stream.send_layer(layer, [6], [0], k, v)
        stream.commit(timeout=20)
    finally:
        sender.close()
    return src


@pytest.fixture(params=SOCKET_TRANSPORTS)
def served(request):
    receiver = make_receiver()
    server = start_receiver_server(request.param, receiver, "127.0.0.1", 0, token=TOKEN)
    yield request.param, server, receiver
    server.stop()


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_a_kv_stream_without_the_right_token_is_refused(served, token):
    transport, server, receiver = served
    lease = receiver.leases.open(f"r-{token}", [3])
    with pytest.raises((TransferError, ConnectionError), match="(?i)unauthenticated|token"):
        push_one_block(transport, server.endpoint, lease, token)
    assert lease.frames_received == 0 and not lease.is_committed
    k_cache = receiver.kv_caches[0][0]
    assert not k_cache.any()  # nothing landed


def test_a_kv_stream_with_the_token_lands(served):
    transport, server, receiver = served
    lease = receiver.leases.open("r-good", [3])
    src = push_one_block(transport, server.endpoint, lease, TOKEN)
    assert lease.is_committed
    for layer, (k, v) in enumerate(src):
        assert torch.equal(receiver.kv_caches[layer][0][3], k[6])
        assert torch.equal(receiver.kv_caches[layer][1][3], v[6])


@pytest.mark.parametrize(
    "transport", transport_params(["grpc", "flight", "torch_dist", "nixl", "shm"])
)
def test_no_kv_server_listens_off_loopback_without_a_token(transport):
    with pytest.raises(OpenBindError, match="without a cluster token|torch_dist"):
        start_receiver_server(transport, make_receiver(), "0.0.0.0", 0)


@pytest.mark.parametrize("transport", transport_params(["torch_dist", "nixl"]))
def test_unencrypted_transports_need_the_private_network_flag_off_loopback(transport):
    with pytest.raises(OpenBindError, match="kv_private_network"):
        start_receiver_server(transport, make_receiver(), "0.0.0.0", 0, token=TOKEN)
