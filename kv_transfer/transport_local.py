"""In-process transport for tests: the sender thread calls ``KVReceiver.accept`` directly."""

from __future__ import annotations

import itertools
import threading

from kv_transfer.errors import FrameError
from kv_transfer.interfaces import Channel, Link, ReceiverServer

_registry: dict[str, object] = {}  # name -> KVReceiver
_registry_lock = threading.Lock()
_names = itertools.count()
PREFIX = "local://"


class _LocalChannel(Channel):
    def __init__(self, receiver):
        self._receiver = receiver
        self._errors: list[str] = []

    def push(self, header, payload) -> None:
        # Same contract as gRPC: a rejected frame is reported at commit, later frames still go.
        try:
            self._receiver.accept(header, payload)
        except FrameError as e:
            self._errors.append(e.reason)

    def push_commit(self, header, payload) -> None:
        self.push(header, payload)

    def wait_ack(self, timeout: float) -> list[str]:
        return list(self._errors)

    def cancel(self) -> None:
        pass


class _LocalLink(Link):
    def __init__(self, name: str):
        self._name = name

    def open_channel(self, request_id: str, lease_id: str) -> Channel:
        with _registry_lock:
            receiver = _registry.get(self._name)
        if receiver is None:
            raise ConnectionError(f"no local receiver named {self._name!r}")
        return _LocalChannel(receiver)

    def close(self) -> None:
        pass


class LocalReceiverServer(ReceiverServer):
    def __init__(self, receiver):
        self.name = f"kv-{next(_names)}"
        self.endpoint = PREFIX + self.name
        with _registry_lock:
            _registry[self.name] = receiver

    def stop(self) -> None:
        with _registry_lock:
            _registry.pop(self.name, None)


def connect(endpoint: str, **opts) -> Link:
    if not endpoint.startswith(PREFIX):
        raise ValueError(f"local endpoint must look like {PREFIX}<name>, got {endpoint!r}")
    return _LocalLink(endpoint.removeprefix(PREFIX))


def serve(receiver, host: str, port: int, **opts) -> ReceiverServer:
    return LocalReceiverServer(receiver)
