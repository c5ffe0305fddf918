"""torch_dist pairing handshake: both sides prove the cluster token to each other over the
pairing connection before the receiver gives the pair anything (a thread, a slot, a gloo port).

Messages, fixed-size except the last, all plain bytes (no pickle):

    sender   -> receiver  HELLO     MAGIC (8) | n_s (32 random bytes)
    receiver -> sender    CHALLENGE MAGIC (8) | n_r (32 random bytes) | HMAC(token, "receiver"|n_s|n_r)
    sender   -> receiver  PROOF     HMAC(token, "sender"|n_s|n_r)                  (32)
    receiver -> sender    VERDICT   1 byte: OK, REFUSED or BUSY; after OK one params frame
                                    (kv_transfer.torch_dist.pairstore: MACed, JSON body)

The sender checks the receiver's proof before it sends its own, so a receiver without the
token learns nothing it could replay; the labels keep one side's proof from passing as the
other's, and the nonces from each side keep an old proof from passing again. HMAC-SHA256
throughout, compared with ``hmac.compare_digest``. Both then derive the pair key,
HMAC(token, "pair key"|n_s|n_r), which authenticates every later byte the pair reads from the
connection (its parameters and its gloo/NCCL rendezvous). Without a token (loopback only) the
key is empty and a side with no token checks nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket

MAGIC = b"pdkvpr1\n"  # protocol name and version
NONCE_LEN = MAC_LEN = 32
HELLO_LEN = len(MAGIC) + NONCE_LEN
CHALLENGE_LEN = len(MAGIC) + NONCE_LEN + MAC_LEN
PROOF_LEN = MAC_LEN
OK, REFUSED, BUSY = b"\x00", b"\x01", b"\x02"


class HandshakeError(ConnectionError):
    """The peer broke the handshake or failed to prove the cluster token."""


def _key(token: str | None) -> bytes:
    return token.encode() if token else b""


def mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def receiver_proof(token: str | None, n_s: bytes, n_r: bytes) -> bytes:
    return mac(_key(token), b"pdkv receiver", n_s, n_r)


def sender_proof(token: str | None, n_s: bytes, n_r: bytes) -> bytes:
    return mac(_key(token), b"pdkv sender", n_s, n_r)


def pair_key(token: str | None, n_s: bytes, n_r: bytes) -> bytes:
    return mac(_key(token), b"pdkv pair key", n_s, n_r)


def hello() -> tuple[bytes, bytes]:
    """(the HELLO message, the sender's nonce)."""
    n_s = secrets.token_bytes(NONCE_LEN)
    return MAGIC + n_s, n_s


def parse_hello(data: bytes) -> bytes:
    """The sender's nonce; HandshakeError for anything but a HELLO."""
    if len(data) != HELLO_LEN or not hmac.compare_digest(data[: len(MAGIC)], MAGIC):
        raise HandshakeError("not a torch_dist pairing hello")
    return data[len(MAGIC) :]


def challenge(token: str | None, n_s: bytes) -> tuple[bytes, bytes]:
    """(the CHALLENGE message, the receiver's nonce)."""
    n_r = secrets.token_bytes(NONCE_LEN)
    return MAGIC + n_r + receiver_proof(token, n_s, n_r), n_r


def check_sender(token: str | None, n_s: bytes, n_r: bytes, proof: bytes) -> bool:
    """Whether PROOF shows the token (always true for a receiver without one)."""
    return token is None or hmac.compare_digest(proof, sender_proof(token, n_s, n_r))


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly n bytes from a socket with a timeout; ConnectionError at end of file."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("torch_dist peer closed the pairing connection")
        buf += chunk
    return bytes(buf)


def pair_as_sender(sock: socket.socket, token: str | None) -> bytes:
    """Run the sender's half of the handshake on a connected socket (its timeout bounds every
    read); returns the pair key. HandshakeError if either side fails to prove the token, or
    the receiver is full."""
    message, n_s = hello()
    sock.sendall(message)
    reply = recv_exact(sock, CHALLENGE_LEN)
    if not hmac.compare_digest(reply[: len(MAGIC)], MAGIC):
        raise HandshakeError("torch_dist receiver answered with something else than a challenge")
    n_r, proof = reply[len(MAGIC) : -MAC_LEN], reply[-MAC_LEN:]
    if token is not None and not hmac.compare_digest(proof, receiver_proof(token, n_s, n_r)):
        raise HandshakeError(
            "torch_dist receiver failed to prove the cluster token (its token or this "
            "sender's is wrong, or it is no pdserve receiver): not pairing with it"
        )
    sock.sendall(sender_proof(token, n_s, n_r))
    verdict = recv_exact(sock, 1)
    if verdict == BUSY:
        raise HandshakeError("torch_dist receiver is busy: it holds its maximum of pairs")
    if verdict != OK:
        raise HandshakeError("torch_dist receiver refused the pair: missing or bad cluster token")
    return pair_key(token, n_s, n_r)
