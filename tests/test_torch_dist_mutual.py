"""torch_dist pairing (#46): both sides prove the cluster token before any pair exists (a wrong
sender is refused by the receiver, a wrong receiver by the sender, which tells a fake receiver
nothing past its hello), the pair cap turns senders away with BUSY, the acceptor survives a
client that crashes its code and, should it die, the server says so; the rendezvous store
takes only frames made with the pair's key, in order. Hostile clients:
tests/test_torch_dist_hostile.py."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

from kv_transfer.sender import make_sender
from kv_transfer.torch_dist import acceptor, handshake
from kv_transfer.torch_dist.pairstore import MAX_BODY, PairStore
from tests.test_torch_dist_hostile import PAIR_WITHIN_S, TOKEN, Served

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")


@pytest.fixture
def served():
    s = Served(handshake_timeout_s=1.0)
    yield s
    s.stop()


@pytest.mark.parametrize("token", [None, "not-the-token"])
def test_a_sender_without_the_token_gets_no_pair(served, token):
    """Without a token the sender skips the receiver's proof and is refused on its own; with a
    wrong one it refuses the receiver first (neither side can tell which token is wrong)."""
    with pytest.raises(ConnectionError, match="refused the pair|failed to prove"):
        make_sender("torch_dist", served.server.endpoint, **({"token": token} if token else {}))
    assert served.server.active_pairs == 0
    assert threading.active_count() <= served.threads_before
    assert served.push() < PAIR_WITHIN_S  # the right one still pairs


def test_the_receiver_refuses_a_proof_made_with_the_wrong_token(served):
    """A client that ignores the receiver's proof and answers with a wrong token's."""
    with served.connect() as sock:
        message, n_s = handshake.hello()
        sock.sendall(message)
        reply = handshake.recv_exact(sock, handshake.CHALLENGE_LEN)
        n_r = reply[len(handshake.MAGIC) : -handshake.MAC_LEN]
        sock.sendall(handshake.sender_proof("not-the-token", n_s, n_r))
        assert handshake.recv_exact(sock, 1) == handshake.REFUSED
        assert sock.recv(1) == b""  # and closed
    assert served.server.active_pairs == 0


def test_a_receiver_with_the_wrong_token_is_refused_by_the_sender():
    served = Served(handshake_timeout_s=1.0)  # its token is TOKEN
    try:
        with pytest.raises(ConnectionError, match="receiver failed to prove the cluster token"):
            make_sender("torch_dist", served.server.endpoint, token="the-senders-token")
        assert served.server.active_pairs == 0
    finally:
        served.stop()


def test_the_sender_tells_a_fake_receiver_nothing_but_its_hello():
    """A listener that answers the hello with a made-up proof: the sender refuses it and never
    sends its own proof (nothing a fake receiver could replay or learn from)."""
    listener = socket.create_server(("127.0.0.1", 0))
    got = bytearray()

    def fake_receiver():
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(2.0)
            got.extend(handshake.recv_exact(conn, handshake.HELLO_LEN))
            conn.sendall(handshake.MAGIC + os.urandom(2 * handshake.NONCE_LEN))
            try:
                while chunk := conn.recv(4096):
                    got.extend(chunk)
            except TimeoutError:
                pass

    thread = threading.Thread(target=fake_receiver)
    thread.start()
    port = listener.getsockname()[1]
    with pytest.raises(ConnectionError, match="receiver failed to prove"):
        make_sender("torch_dist", f"127.0.0.1:{port}", token=TOKEN)
    thread.join(5)
    listener.close()
    assert len(got) == handshake.HELLO_LEN and got.startswith(handshake.MAGIC)


def test_past_max_pairs_a_sender_hears_busy_until_a_pair_ends():
    served = Served(max_pairs=2)
    senders = []
    try:
        senders = [make_sender("torch_dist", served.server.endpoint, token=TOKEN) for _ in "ab"]
        started = time.monotonic()
        with pytest.raises(ConnectionError, match="busy"):
            make_sender("torch_dist", served.server.endpoint, token=TOKEN)
        assert time.monotonic() - started < 2.0
        assert served.server.active_pairs == 2
        assert threading.active_count() <= served.threads_before + 4  # 2 pairs, 2 senders
        senders.pop().close()
        deadline = time.monotonic() + 5.0
        while served.server.active_pairs > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        served.threads_before += 2  # the pair still open, and its sender
        assert served.push() < PAIR_WITHIN_S
    finally:
        for sender in senders:
            sender.close()
        served.stop()


def test_a_client_that_crashes_the_handshake_code_is_dropped_alone(served, monkeypatch):
    real = acceptor.parse_hello
    calls = []

    def crash_once(data):
        calls.append(data)
        if len(calls) == 1:
            raise RuntimeError("a bug this client found")
        return real(data)

    monkeypatch.setattr(acceptor, "parse_hello", crash_once)
    with served.connect() as sock:
        sock.sendall(handshake.hello()[0])
        sock.settimeout(2.0)
        assert sock.recv(100) == b""  # closed, no challenge
    assert served.push() < PAIR_WITHIN_S
    served.assert_bounded_and_healthy()


def test_an_acceptor_that_dies_turns_the_server_unhealthy(served):
    def boom():
        raise RuntimeError("the selector broke")

    served.server._acceptor._tick = boom
    deadline = time.monotonic() + 5.0
    while served.server.healthy and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not served.server.healthy
    assert "acceptor died: RuntimeError: the selector broke" in served.server.problem()


def _stores() -> tuple[PairStore, PairStore, socket.socket, socket.socket]:
    a, b = socket.socketpair()
    key = os.urandom(32)
    return PairStore(a, key, 0, 2.0), PairStore(b, key, 1, 2.0), a, b


def test_the_pair_store_carries_keys_both_ways():
    sender, receiver, a, b = _stores()
    sender.set("0/0", b"sender address")
    receiver.set("0/1", b"receiver address")
    assert receiver.get("0/0") == b"sender address"
    assert sender.get("0/1") == b"receiver address"
    a.close()
    assert receiver.peer_closed()
    b.close()


@pytest.mark.parametrize("forgery", ["wrong key", "reflected side", "replayed sequence"])
def test_the_pair_store_refuses_frames_not_from_its_peer(forgery):
    sender, receiver, a, b = _stores()
    sender.set("0/0", b"real")
    assert receiver.get("0/0") == b"real"
    if forgery == "wrong key":
        forger = PairStore(a, os.urandom(32), 0, 2.0)
        forger._sent = 1
    elif forgery == "reflected side":  # the receiver's own side, its key: a reflected frame
        forger = PairStore(a, receiver._key, 1, 2.0)
        forger._sent = 1
    else:
        forger = sender
        forger._sent = 0
    forger.set("0/1", b"attacker address")
    with pytest.raises(ConnectionError, match="authentication|sequence"):
        receiver.get("0/1")
    a.close()
    b.close()


def test_the_pair_store_refuses_an_oversized_frame():
    _sender, receiver, a, b = _stores()
    a.sendall(struct.pack(">I", MAX_BODY + 1))
    with pytest.raises(ConnectionError, match="max"):
        receiver.get("anything")
    a.close()
    b.close()
