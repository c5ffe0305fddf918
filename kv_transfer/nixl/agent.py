"""The NIXL library and this process's agents.

NIXL ships as ``nixl`` (a meta wheel) or ``nixl-cu12`` / ``nixl-cu13`` (import names
``nixl_cu12`` / ``nixl_cu13``); whichever is installed is used. ``available()`` says whether
one is, without raising: the registry lists the transport everywhere, and a worker or test
asks before it uses it.

One ``NixlAgent`` per role in a process (a decode worker's receiver server has one, every
sender link of a process shares another): an agent's registered memory and remote agents are
per agent, and a sender and a receiver in one process (tests, the bench) must be two agents.
NIXL's own thread-safety mode is STRICT, and this wrapper also serializes its calls: the
sender threads, the control threads and the notification poller all call in. Agents run
without NIXL's progress thread, which spins about a third of a core even while idle (measured
here: 0.95 CPU-seconds in 3 idle seconds): the sender progresses its agent while it waits for
a WRITE or an ack, the receiver polls its own, fast while a transfer is under way.
"""

from __future__ import annotations

import importlib
import os
import threading
import uuid

import numpy as np

_MODULES = ("nixl_cu12", "nixl_cu13", "nixl._api")
_module = None
_import_error: str | None = None


def nixl_module():
    """The installed NIXL Python API module; ImportError naming the extra when none is."""
    global _module, _import_error
    if _module is not None:
        return _module
    errors = []
    for name in _MODULES:
        try:
            _module = importlib.import_module(name)
            return _module
        except ImportError as e:
            errors.append(f"{name}: {e}")
    _import_error = "; ".join(errors)
    raise ImportError(
        "the nixl KV transport needs NIXL: pip install 'pdserve[nixl]' (nixl-cu12; wheels for "
        f"Linux x86_64 and aarch64) ({_import_error})"
    )


def available() -> bool:
    """Whether NIXL imports here (and has a UCX backend)."""
    try:
        nixl_module()
    except ImportError:
        return False
    return True


def mem_type(tensor) -> tuple[str, int]:
    """NIXL's memory type and device id of a torch tensor: DRAM on CPU, VRAM on a GPU."""
    if tensor.device.type == "cuda":
        return "VRAM", tensor.device.index or 0
    if tensor.device.type != "cpu":
        raise ValueError(f"nixl cannot register {tensor.device.type} memory")
    return "DRAM", 0


class NixlAgent:
    """One NIXL agent (UCX backend) with the memory it registered."""

    def __init__(self, role: str):
        nixl = nixl_module()
        self.name = f"pdserve-{role}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        config = nixl.nixl_agent_config(
            backends=["UCX"],
            sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
            enable_prog_thread=False,
        )
        self._agent = nixl.nixl_agent(self.name, config)
        if "UCX" not in self._agent.backends:
            raise ImportError("NIXL has no UCX backend here: the nixl transport cannot run")
        self._lock = threading.Lock()
        self._registered: dict[tuple[int, int], object] = {}  # (address, bytes) -> reg descs
        self._tensors: list = []  # what is registered, kept alive (see register)

    def register(self, tensor) -> None:
        """Register ``tensor``'s memory once (later calls with the same memory do nothing);
        the tensor must outlive the agent (a KV cache does)."""
        if not tensor.is_contiguous():
            raise ValueError("nixl registers contiguous tensors only")
        key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
        with self._lock:
            if key in self._registered:
                return
            kind, device = mem_type(tensor)
            descs = self._agent.register_memory([(key[0], key[1], device, "")], kind)
            # Held with its registration: freed memory whose address a new tensor took would
            # pass the check above while no registration covers it (seen in the suite, where
            # one process's agent outlives many tests' caches).
            self._registered[key] = descs
            self._tensors.append(tensor)

    def metadata(self) -> bytes:
        with self._lock:
            return self._agent.get_agent_metadata()

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata (only after it proved the cluster token); its agent name."""
        with self._lock:
            name = self._agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else name

    def remove_remote(self, name: str) -> None:
        with self._lock:
            self._agent.remove_remote_agent(name)

    def write(
        self,
        local: np.ndarray,
        remote: np.ndarray,
        kinds: tuple[str, str],
        peer: str,
        notification: bytes = b"",
    ):
        """Post a WRITE of ``local`` descriptors (N x 3: address, bytes, device) into
        ``remote`` ones of agent ``peer``; ``kinds``: their memory types (DRAM, VRAM);
        ``notification``: delivered to the peer once the data is in place. Returns its handle
        (poll with ``state``: polling also moves the write and its notification along)."""
        with self._lock:
            handle = self._agent.initialize_xfer(
                "WRITE",
                self._agent.get_xfer_descs(local, kinds[0]),
                self._agent.get_xfer_descs(remote, kinds[1]),
                peer,
                notification,
            )
            state = self._agent.transfer(handle)
        if state == "ERR":
            self.release(handle)
            raise ConnectionResetError(f"nixl WRITE to {peer} failed to post")
        return handle

    def state(self, handle) -> str:
        """ "DONE", "PROC" or "ERR"."""
        with self._lock:
            return self._agent.check_xfer_state(handle)

    def release(self, handle) -> None:
        with self._lock:
            self._agent.release_xfer_handle(handle)

    def progress(self) -> None:
        """Move this agent's transfers and messages along: without a progress thread (it
        spins a third of a core while idle) nothing moves between this agent's calls."""
        with self._lock:
            stray = self._agent.get_new_notifs()
        if stray:
            raise ConnectionError(f"nixl agent {self.name} got notifications it never expects")

    def notify(self, peer: str, message: bytes) -> None:
        with self._lock:
            self._agent.send_notif(peer, message)

    def notifications(self) -> dict[str, list[bytes]]:
        """New notifications since the last call, by sending agent's name."""
        with self._lock:
            notifs = self._agent.get_new_notifs()
        return {(k.decode() if isinstance(k, bytes) else k): v for k, v in notifs.items()}

    def close(self) -> None:
        with self._lock:
            for descs in self._registered.values():
                self._agent.deregister_memory(descs)
            self._registered.clear()
            self._tensors.clear()
