"""The error a KV receiver answers with: torch-free, so the lease table (and the settings that
read its limits) load without torch."""

from __future__ import annotations


class FrameError(Exception):
    """A frame the receiver refuses; ``reason`` is safe to log and to send back."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class ReceiverFault(ConnectionError):
    """The receiving side failed a KV transfer: its endpoint refused, reset or ended the
    stream, or did not acknowledge the commit. The decode worker that owns the receiver is at
    fault, not the sender (a prefill worker reports it so: prefill_worker/server.py)."""


# What the peer's side of a connection did (the OS says so), as opposed to a plain
# ConnectionError of the sender's own link (the "faults" transport's injected breaks).
_PEER_ERRORS = (
    ConnectionRefusedError,
    ConnectionResetError,
    ConnectionAbortedError,
    BrokenPipeError,
)


def is_receiver_fault(error: BaseException) -> bool:
    """``error`` (raised while connecting or pushing to a receiver) is the receiver's doing."""
    return isinstance(error, (ReceiverFault, *_PEER_ERRORS))
