"""Network namespaces as hosts: a "switch" namespace holds the bridge, each host namespace has
one veth (``eth0``) into it with an address of 198.51.100.0/24 (TEST-NET-2, documentation only).

Nothing is made in the machine's own namespace: the veth pairs are created inside the switch
namespace with their host ends moved straight into the hosts, so the machine's interfaces,
addresses and routes stay untouched. Every name starts with a per-run prefix; ``cleanup(prefix)``
removes what a crashed run left (the processes inside each namespace first, by their pids).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "198.51.100"
PREFIX_ROOT = "pdsv-"  # every namespace this module makes starts with it
# For every process in the hosts (Ray nodes, so their workers; the link bench's halves): the
# namespaces share one kernel, so UCX (nixl) takes them for one machine and writes by CMA past
# the veth (measured: 1,273 MB/s across a 1 Gbit/s link). TCP over each host's eth0 only.
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no ``ip``, or the kernel refuses)."""


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None if they can (checked by making one)."""
    if os.name != "posix" or not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "openssl", "ss"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2, openssl)"
    probe = f"{PREFIX_ROOT}probe-{os.getpid()}"
    made = subprocess.run(
        ["ip", "netns", "add", probe], check=False, capture_output=True, text=True
    )
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return None


@dataclass
class Host:
    name: str  # short: head, prefill, decode_a, ...
    ns: str  # the namespace
    address: str  # its 198.51.100.x
    port: str  # its veth end in the switch namespace


@dataclass
class Hosts:
    """Hosts on one bridge. ``hosts``: short name -> Host, in the order made."""

    prefix: str
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    @classmethod
    def make(cls, names: list[str], prefix: str | None = None) -> Hosts:
        """The switch namespace with its bridge, then one namespace per name (.10, .11, ...)."""
        reason = unavailable_reason()
        if reason:
            raise NetnsUnavailable(reason)
        made = cls(prefix or f"{PREFIX_ROOT}{os.getpid()}")
        try:
            subprocess.run(["ip", "netns", "add", made.switch], check=True, capture_output=True)
            _ip("link", "set", "lo", "up", ns=made.switch)
            _ip("link", "add", "br0", "type", "bridge", ns=made.switch)
            _ip("link", "set", "br0", "up", ns=made.switch)
            for i, name in enumerate(names):
                made._add_host(name, f"{SUBNET}.{10 + i}", i)
        except BaseException:
            made.destroy()
            raise
        return made

    def _add_host(self, name: str, address: str, index: int) -> None:
        host = Host(name, f"{self.prefix}-{name}", address, f"p{index}")
        self.hosts[name] = host
        subprocess.run(["ip", "netns", "add", host.ns], check=True, capture_output=True)
        # Both ends made inside the switch namespace; the host's end moves into its namespace.
        _ip(
            "link",
            "add",
            host.port,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            host.ns,
            ns=self.switch,
        )
        _ip("link", "set", host.port, "master", "br0", "up", ns=self.switch)
        _ip("addr", "add", f"{address}/24", "dev", "eth0", ns=host.ns)
        _ip("link", "set", "eth0", "up", ns=host.ns)
        _ip("link", "set", "lo", "up", ns=host.ns)

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def exec_args(self, name: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[name].ns, *argv]

    def run(self, name: str, argv: list[str], timeout: float = 120, **kw):
        """Run ``argv`` inside host ``name`` and wait (``timeout``: seconds)."""
        return subprocess.run(
            self.exec_args(name, argv),
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
            **kw,
        )

    def popen(self, name: str, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self.exec_args(name, argv), **kw)

    def shape(self, name: str, rate: str, burst: str = "256kb", latency: str = "50ms") -> None:
        """A token bucket on what host ``name`` sends (tbf; netem is not needed): every byte it
        puts on its link leaves at ``rate`` at most (e.g. "1gbit", "200mbit")."""
        _ip_tc = ["tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate]
        out = self.run(name, [*_ip_tc, "burst", burst, "latency", latency], timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"tc tbf on {name}: {out.stderr.strip()}")

    def set_link(self, name: str, up: bool) -> None:
        """Host ``name``'s cable in or out: its port on the bridge up or down (a partition)."""
        _ip("link", "set", self.hosts[name].port, "up" if up else "down", ns=self.switch)

    def pids(self, name: str) -> list[int]:
        out = subprocess.run(
            ["ip", "netns", "pids", self.hosts[name].ns],
            check=False,
            capture_output=True,
            text=True,
        )
        return [int(p) for p in out.stdout.split()]

    def kill_all(self, name: str, grace_s: float = 5.0) -> None:
        """End every process inside host ``name`` (all of them are this run's): TERM, then KILL
        after ``grace_s``."""
        _kill_ns(self.hosts[name].ns, grace_s)

    def destroy(self) -> None:
        """Every process in every namespace of this run ended, every namespace deleted (their
        veth ends and the bridge go with them), and the run's Ray folder. Exactly this run's:
        "pdsv-12-" must not take "pdsv-123-"'s namespaces with it."""
        cleanup(f"{self.prefix}-")
        shutil.rmtree(Path("/tmp") / self.prefix, ignore_errors=True)


def _kill_ns(ns: str, grace_s: float) -> None:
    _kill_namespaces([ns], grace_s)


def _kill_namespaces(names: list[str], grace_s: float) -> None:
    """TERM every process in every namespace of ``names``, KILL those left after ``grace_s``:
    one grace for all of them, not one a namespace (Ray's processes outlive a TERM by more
    than the grace, so each host of a cluster waited it out: 4 hosts, 21 s a close)."""

    def pids() -> list[int]:
        found = []
        for ns in names:
            out = subprocess.run(
                ["ip", "netns", "pids", ns], check=False, capture_output=True, text=True
            )
            found += [int(p) for p in out.stdout.split()]
        return found

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids() and time.monotonic() < deadline:
            time.sleep(0.1)


def list_namespaces(prefix: str = PREFIX_ROOT) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True)
    names = [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def cleanup(prefix: str = PREFIX_ROOT, grace_s: float = 5.0) -> list[str]:
    """Remove every namespace whose name starts with ``prefix`` (hosts before the switch) after
    ending the processes inside; returns the names removed."""
    names = sorted(list_namespaces(prefix), key=lambda n: n.endswith("-sw"))
    _kill_namespaces(names, grace_s)
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
    # Ray's temp folders of the run (ray_nodes.RayNodes.temp_dir), once nothing runs there.
    for folder in Path("/tmp").glob(f"{prefix}*"):
        if folder.is_dir() and folder.name.startswith(PREFIX_ROOT):
            shutil.rmtree(folder, ignore_errors=True)
    return names


def cleanup_stale() -> list[str]:
    """Remove what runs whose process is gone left behind (a run killed before its cleanup):
    namespaces named ``pdsv-<pid>-...`` whose pid no longer exists."""
    removed = []
    for pid in {n.split("-")[1] for n in list_namespaces() if n.split("-")[1].isdigit()}:
        if not Path(f"/proc/{pid}").exists():
            removed += cleanup(f"{PREFIX_ROOT}{pid}-")
            shutil.rmtree(Path("/tmp") / f"{PREFIX_ROOT}{pid}", ignore_errors=True)
    return removed
