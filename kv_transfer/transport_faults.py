"""Fault-injecting KV transport for tests: wraps another transport and, per a seeded policy,
delays, drops and corrupts frames and breaks links, on the sender's side of the link.

It is chosen by name ("faults") like any transport. Its server serves the inner transport and
publishes an endpoint that starts with the inner one (the address it listens on) and then
names the inner transport and carries the policy:

    <inner endpoint>#<inner>;<policy>
    127.0.0.1:41000#grpc;seed=7,drop_p=0.05,corrupt_p=0.05,delay_p=0.2,delay_s=0.02

so a sender (a prefill worker, maybe in another process) needs no configuration of its own:
``connect`` reads the policy from the endpoint, connects the inner transport, and injects.

What each fault does, and what must catch it:
- delay: the frame waits up to ``delay_s`` before it goes (a slow link).
- drop: a kv frame is lost; the commit's frame count no longer matches and the receiver
  rejects the commit. (A reliable stream loses no message silently; a lost commit would be a
  lost link, which ``disconnect`` covers.)
- corrupt: one bit of the header is flipped (a field such as the layer, a block position, the
  lease id or a commit's frame count: the header's CRC-32C rejects it), or for a share of kv
  frames (1 - ``corrupt_header_share``) one payload byte (the payload's CRC-32C rejects it).
  Header hits are also counted as ``corrupt_header``.
- disconnect: the link breaks at this frame: the stream fails, the link reports ``broken``,
  and the sender connects a new one for the next stream.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass

from kv_transfer.interfaces import Channel, Link, ReceiverServer
from kv_transfer.transports import transport_module

POLICY_ENV = "PDSERVE_KV_FAULTS"  # a policy string, for workers started as processes
INNER_ENV = "PDSERVE_KV_FAULTS_INNER"  # the transport it wraps in workers (default grpc)

# What this process injected, by fault kind (tests read it; summed over every link).
injected: Counter = Counter()
_injected_lock = threading.Lock()
_link_numbers = itertools.count()


@dataclass(frozen=True)
class FaultPolicy:
    seed: int = 0
    delay_p: float = 0.0  # chance that a frame waits before it goes
    delay_s: float = 0.0  # the longest wait (uniform in [0, delay_s])
    drop_p: float = 0.0  # chance that a kv frame is lost
    corrupt_p: float = 0.0  # chance that a frame's bytes are damaged
    corrupt_header_share: float = 0.5  # of damaged kv frames, those hit in the header
    disconnect_p: float = 0.0  # chance that the link breaks at a frame

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            is_share = f.name.endswith(("_p", "_share"))
            if is_share and not 0.0 <= value <= 1.0:
                raise ValueError(f"{f.name}={value} is not a probability")
        if self.delay_s < 0:
            raise ValueError(f"delay_s={self.delay_s} is negative")

    def encode(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))

    @classmethod
    def parse(cls, text: str) -> FaultPolicy:
        types = {f.name: (int if f.name == "seed" else float) for f in dataclasses.fields(cls)}
        values = {}
        for item in filter(None, text.split(",")):
            name, sep, value = item.partition("=")
            if not sep or name not in types:
                raise ValueError(f"bad fault policy item {item!r}; known: {sorted(types)}")
            values[name] = types[name](value)
        return cls(**values)


def format_endpoint(inner: str, policy: FaultPolicy, inner_endpoint: str) -> str:
    return f"{inner_endpoint}#{inner};{policy.encode()}"


def parse_endpoint(endpoint: str) -> tuple[str, FaultPolicy, str]:
    """(inner transport, policy, inner endpoint) of a faults endpoint."""
    inner_endpoint, sep, tail = endpoint.rpartition("#")
    inner, semi, policy = tail.partition(";")
    if not sep or not semi or not inner or inner == "faults":
        raise ValueError(
            f"faults endpoint must look like <endpoint>#<inner>;<policy>: {endpoint!r}"
        )
    return inner, FaultPolicy.parse(policy), inner_endpoint


def _count(kind: str) -> None:
    with _injected_lock:
        injected[kind] += 1


class _FaultChannel(Channel):
    def __init__(self, inner: Channel, link: _FaultLink):
        self._inner, self._link = inner, link

    def push(self, header, payload) -> None:
        header, payload = self._link.disturb(header, payload, is_commit=False)
        if header is not None:
            self._inner.push(header, payload)

    @property
    def writes_blocks(self) -> bool:
        return self._inner.writes_blocks

    def write_layer(self, layer, src, dst, k_cache, v_cache, damage: bool = False) -> int:
        """A one-sided write (nixl), disturbed like a frame: delayed, lost (the commit then
        misses its cells), damaged (a bit of its bytes as the receiver will hash them), or
        the link breaks here."""
        header, _ = self._link.disturb(b"w", b"", is_commit=False)
        if header is None:
            return 0
        return self._inner.write_layer(layer, src, dst, k_cache, v_cache, damage or header != b"w")

    def push_commit(self, header, payload) -> None:
        header, payload = self._link.disturb(header, payload, is_commit=True)
        self._inner.push_commit(header, payload)

    def wait_ack(self, timeout: float) -> list[str]:
        return self._inner.wait_ack(timeout)

    def cancel(self) -> None:
        self._inner.cancel()


class _FaultLink(Link):
    def __init__(self, inner: Link, policy: FaultPolicy, number: int | None = None):
        self._inner, self.policy = inner, policy
        self.idle_interval_s = inner.idle_interval_s
        # Seeded per link (the process's nth), so a run's links draw the same faults each run.
        number = next(_link_numbers) if number is None else number
        self._rng = random.Random(f"{policy.seed}:{number}")
        self._lock = threading.Lock()
        self._disconnected = False

    @property
    def broken(self) -> bool:
        return self._disconnected or self._inner.broken

    def open_channel(self, request_id: str, lease_id: str) -> Channel:
        if self.broken:
            raise ConnectionError("faults: the link was disconnected")
        return _FaultChannel(self._inner.open_channel(request_id, lease_id), self)

    def on_idle(self) -> None:
        self._inner.on_idle()

    def close(self) -> None:
        self._inner.close()

    def disturb(self, header, payload, is_commit: bool):
        """The frame as the link delivers it: (None, None) when it is dropped; raises
        ConnectionError when the link breaks here."""
        p = self.policy
        with self._lock:  # one draw sequence per link, whichever stream's frame this is
            delay = self._rng.uniform(0, p.delay_s) if self._rng.random() < p.delay_p else 0.0
            disconnect = self._rng.random() < p.disconnect_p
            drop = not is_commit and self._rng.random() < p.drop_p
            corrupt = self._rng.random() < p.corrupt_p
            position = self._rng.random()
        if delay:
            _count("delay")
            time.sleep(delay)
        if disconnect:
            _count("disconnect")
            self._disconnected = True
            raise ConnectionError("faults: the link broke")
        if drop:
            _count("drop")
            return None, None
        if corrupt:
            _count("corrupt")
            return _corrupted(header, payload, position, p.corrupt_header_share)
        return header, payload


def _corrupted(header, payload, position: float, header_share: float):
    """A copy of the frame with one header bit flipped (always when there is no payload), or
    one payload byte. ``position`` in [0, 1) picks which, and where."""
    share = header_share if len(payload) else 1.0
    if position < share:
        _count("corrupt_header")
        bit = int(position / share * len(header) * 8)
        damaged = bytearray(header)
        damaged[bit // 8] ^= 1 << (bit % 8)
        return bytes(damaged), payload
    damaged = bytearray(payload)
    damaged[int((position - share) / (1.0 - share) * len(damaged))] ^= 0xFF
    return header, memoryview(damaged)


class FaultReceiverServer(ReceiverServer):
    def __init__(self, inner: ReceiverServer, inner_name: str, policy: FaultPolicy):
        self._inner = inner
        self.endpoint = format_endpoint(inner_name, policy, inner.endpoint)

    def stop(self) -> None:
        self._inner.stop()


def connect(endpoint: str, **opts) -> Link:
    inner, policy, inner_endpoint = parse_endpoint(endpoint)
    return _FaultLink(transport_module(inner).connect(inner_endpoint, **opts), policy)


def serve(
    receiver,
    host: str,
    port: int,
    inner: str | None = None,
    policy: FaultPolicy | str | None = None,
    **opts,
) -> ReceiverServer:
    """Serve ``receiver`` over the ``inner`` transport (default: $PDSERVE_KV_FAULTS_INNER,
    else grpc); senders inject ``policy`` (default: the policy string in $PDSERVE_KV_FAULTS,
    else no faults)."""
    inner = inner or os.environ.get(INNER_ENV, "grpc")
    if policy is None:
        policy = os.environ.get(POLICY_ENV, "")
    if isinstance(policy, str):
        policy = FaultPolicy.parse(policy)
    server = transport_module(inner).serve(receiver, host, port, **opts)
    return FaultReceiverServer(server, inner, policy)
