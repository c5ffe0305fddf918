"""What a KV transport is, and nothing else: the interfaces every transport implements and the
sender and receiver use, torch-free (no torch import here, not even through another module).

A transport is a module with ``connect(endpoint, **opts) -> Link`` and ``serve(receiver, host,
port, **opts) -> ReceiverServer`` (``Transport``); kv_transfer/transports.py maps names to
those modules. On the prefill side a ``Link`` is one sender's connection to one decode worker;
it opens a ``Channel`` per stream (one request's KV, ended by a commit frame). On the decode
side a ``ReceiverServer`` listens and hands each frame to a ``FrameSink`` (the KVReceiver).

Transports and the sender import these from here, not from each other: kv_transfer/sender.py
imports torch and picks a transport by name, so a transport that imported the sender made an
import circle (sender -> transports -> transport_grpc -> sender).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol


class Channel(ABC):
    """One stream's pipe to the receiver. push* and write_layer run on the sender thread."""

    # True: the transport writes each layer's blocks itself, straight from the sender's cache
    # into the receiver's (nixl's one-sided WRITEs): the sender calls ``write_layer`` instead
    # of gathering frames for ``push``, and still ends the stream with ``push_commit``.
    writes_blocks: bool = False

    def write_layer(
        self, layer: int, src: list[int], dst: list[int], k_cache, v_cache, damage: bool = False
    ) -> int:
        """Write ``layer``'s blocks ``src`` of the sender's cache into lease positions ``dst``;
        return the payload bytes written. ``damage``: the faults transport's stand-in for a
        byte damaged in flight (the receiver's check of the commit must catch it)."""
        raise NotImplementedError(f"{type(self).__name__} carries frames, not block writes")

    @abstractmethod
    def push(self, header: bytes, payload) -> None: ...

    @abstractmethod
    def push_commit(self, header: bytes, payload) -> None: ...

    @abstractmethod
    def wait_ack(self, timeout: float) -> list[str]:
        """Block until the receiver acknowledged the commit; return reasons for rejections."""

    @abstractmethod
    def cancel(self) -> None: ...


class Link(ABC):
    """A sender's connection to one receiver endpoint, shared by all its streams."""

    idle_interval_s: float | None = None  # call on_idle when the sender thread idles this long
    # True once the link cannot carry another stream (torch_dist: a half-sent message or a
    # dead peer desynchronizes the pair for good); the sender then connects a new one.
    broken: bool = False

    def on_idle(self) -> None:
        """Keep the link alive (torch_dist pings; a silent gloo pair times out)."""

    @abstractmethod
    def open_channel(self, request_id: str, lease_id: str) -> Channel: ...

    @abstractmethod
    def close(self) -> None: ...


class ReceiverServer(ABC):
    endpoint: str  # what make_sender needs to reach this server

    @abstractmethod
    def stop(self) -> None: ...

    def problem(self) -> str | None:
        """Why this server takes no KV now (None: it does); the decode worker's health
        reports it (torch_dist: its pairing port's acceptor died)."""
        return None

    @property
    def healthy(self) -> bool:
        return self.problem() is None


class FrameSink(Protocol):
    """Where a receiver server delivers frames (kv_transfer.receiver.KVReceiver; torch_dist
    also reads its ``kv_caches`` to put its pair on the cache's device)."""

    def accept(self, header, payload) -> None:
        """Apply one frame; raise kv_transfer.errors.FrameError if it is bad."""


class Transport(Protocol):
    """A transport module, as kv_transfer.transports.transport_module returns it."""

    def connect(self, endpoint: str, **opts) -> Link: ...

    def serve(self, receiver: FrameSink, host: str, port: int, **opts) -> ReceiverServer: ...
