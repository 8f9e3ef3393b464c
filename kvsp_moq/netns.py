"""Several hosts on one machine: network namespaces joined by a bridge.

Deployment tests and fleet benchmarks need servers on real, non-loopback addresses with a
real MTU, without touching the machine's own network. Each `Host` is a network namespace
with its loopback up and one interface, `eth0`, whose other end sits on a bridge inside a
namespace of its own (the "switch"); nothing is created in the machine's namespace, and
everything goes when the `Network` is closed, including processes still running in it.

Addresses come from 198.18.0.0/15, the range set aside for benchmarking (RFC 2544), so
nobody mistakes them for a real network. Creating namespaces needs root (CAP_SYS_ADMIN and
CAP_NET_ADMIN); `unavailable()` says why it cannot be done here.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from kvsp_moq.errors import NamespaceError

__all__ = ["BENCHMARK_NET", "Host", "NamespaceError", "Network", "unavailable"]

#: The benchmarking range (RFC 2544): the default subnet is its first /24.
BENCHMARK_NET = ipaddress.IPv4Network("198.18.0.0/15")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NamespaceError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"kvsp-probe-{os.getpid()}"
    proc = _ip("netns", "add", probe, check=False)
    if proc.returncode != 0:
        return f"cannot create a network namespace: {proc.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    """One namespace with an address on the network."""

    name: str
    netns: str
    address: str
    mtu: int
    processes: list[subprocess.Popen[Any]] = field(default_factory=list)

    def argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def run(self, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
        kw.setdefault("timeout", 120)
        return subprocess.run(self.argv(argv), **kw)

    def start(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """A process left running in the namespace; it is stopped when the network closes."""
        proc = subprocess.Popen(self.argv(argv), start_new_session=True, **kw)
        self.processes.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[Any], timeout: float = 10.0) -> int | None:
        """SIGTERM to the process's group, then SIGKILL after `timeout`; its exit status."""
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout)
        return proc.returncode


class Network:
    """A bridge and the hosts on it; a context manager that removes it all on exit."""

    def __init__(self, *, subnet: str = "198.18.0.0/24", mtu: int = 1500,
                 prefix: str | None = None) -> None:
        self.subnet = ipaddress.ip_network(subnet)
        if not isinstance(self.subnet, ipaddress.IPv4Network) or not self.subnet.subnet_of(BENCHMARK_NET):
            raise ValueError(f"{subnet} is outside {BENCHMARK_NET}, the benchmarking range")
        self.mtu = mtu
        self.prefix = prefix or f"kvsp{os.getpid()}"
        self.switch = f"{self.prefix}-switch"
        self.hosts: dict[str, Host] = {}
        self._addresses = iter(self.subnet.hosts())
        self._made: list[str] = []

    def __enter__(self) -> "Network":
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        reason = unavailable()
        if reason is not None:
            raise NamespaceError(reason)
        self._add_netns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "mtu", str(self.mtu), "up")

    def add_host(self, name: str, *, mtu: int | None = None) -> Host:
        """A new namespace on the bridge, its next address on `eth0` and its loopback up."""
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists")
        netns = f"{self.prefix}-{name}"
        address = str(next(self._addresses))
        port = f"p{len(self.hosts)}"
        mtu = mtu or self.mtu
        self._add_netns(netns)
        _ip("-n", self.switch, "link", "add", port, "mtu", str(mtu), "type", "veth",
            "peer", "name", "eth0", "netns", netns)
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        _ip("-n", netns, "link", "set", "eth0", "mtu", str(mtu), "up")
        _ip("-n", netns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        host = self.hosts[name] = Host(name, netns, address, mtu)
        return host

    def port(self, name: str) -> str:
        """The bridge's end of a host's link (an interface in the switch namespace)."""
        return f"p{list(self.hosts).index(name)}"

    def set_link(self, name: str, up: bool) -> None:
        """Cut (or restore) a host's link to the bridge: a partition, not a closed socket."""
        _ip("-n", self.switch, "link", "set", self.port(name), "up" if up else "down")

    def close(self) -> None:
        for host in self.hosts.values():
            for proc in host.processes:
                host.stop(proc)
        for netns in reversed(self._made):
            self._kill_rest(netns)
            _ip("netns", "del", netns, check=False)
        self._made.clear()
        self.hosts.clear()

    def _add_netns(self, netns: str) -> None:
        _ip("netns", "del", netns, check=False)  # a leftover of a killed run
        _ip("netns", "add", netns)
        self._made.append(netns)

    @staticmethod
    def _kill_rest(netns: str) -> None:
        """Processes a command left behind in the namespace (e.g. a daemonised child)."""
        pids = [int(p) for p in _ip("netns", "pids", netns, check=False).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if os.path.exists(f"/proc/{p}")]
            time.sleep(0.05)
