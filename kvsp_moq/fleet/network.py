"""The links of a fleet made real: `kvsp_moq.netns`'s hosts on a bridge, each link shaped
with `tc` (a token bucket on each end), lossy or partitioned through nftables rules at the
switch, cut with `ip link set down`, and counted from its interface's statistics.

Everything lives in the namespaces the network makes (the switch's included), so nothing in
the machine's own namespace changes, and closing the network removes it all.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import socket
import subprocess
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, TypeVar

from kvsp_moq.errors import NamespaceError
from kvsp_moq.fleet.topology import NFT_TABLE, Link, host_ruleset, switch_ruleset
from kvsp_moq.netns import Host, Network, unavailable

__all__ = ["Counters", "FleetNetwork", "fleet_unavailable"]

T = TypeVar("T")
_CLONE_NEWNET = 0x40000000


def fleet_unavailable() -> str | None:
    """Why a fleet's network cannot be made here (no root, no `ip`, no `tc`), or None."""
    if shutil.which("tc") is None:
        return "the tc command (iproute2) is not installed"
    return unavailable()


def _run(argv: list[str], *, what: str, input: str | None = None, check: bool = True) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, input=input, timeout=30)
    except FileNotFoundError:
        raise NamespaceError(f"{argv[0]}: not installed ({what})") from None
    if check and proc.returncode != 0:
        raise NamespaceError(f"{what}: {' '.join(argv)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


@dataclass(frozen=True)
class Counters:
    """A host interface's counters (octets include the Ethernet header of each frame)."""

    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int

    def __sub__(self, other: "Counters") -> "Counters":
        return Counters(self.tx_bytes - other.tx_bytes, self.rx_bytes - other.rx_bytes,
                        self.tx_packets - other.tx_packets, self.rx_packets - other.rx_packets)


class FleetNetwork(Network):
    """A `Network` whose hosts' links have a rate, a loss rate and a state (`topology.Link`),
    and between whose hosts partitions can be made and healed."""

    def __init__(self, *, subnet: str = "198.18.0.0/24", mtu: int = 1500, prefix: str | None = None) -> None:
        super().__init__(subnet=subnet, mtu=mtu, prefix=prefix or f"kvspfleet{os.getpid()}")
        self.links: dict[str, Link] = {}
        self.partitions: set[frozenset[str]] = set()

    def open(self) -> None:
        reason = fleet_unavailable()
        if reason is not None:
            raise NamespaceError(f"cannot build a fleet here: {reason}")
        super().open()

    def add_host(self, name: str, *, mtu: int | None = None, link: Link | None = None) -> Host:
        """A host on the switch, its link shaped as `link` says (default: unshaped, `mtu`)."""
        link = link or Link(mtu=mtu or self.mtu)
        host = super().add_host(name, mtu=link.mtu)
        self.links[name] = Link(mtu=link.mtu)
        self.apply(name, link)
        return host

    # ------------------------------------------------------------------ changing links

    def apply(self, name: str, link: Link) -> None:
        """Make `name`'s link what `link` says (rate, loss, up or down; the MTU is fixed)."""
        old = self.links[name]
        if link.mtu != old.mtu:
            raise ValueError(f"{name}: a link's MTU is fixed when the host is made")
        if (link.rate_mbit, link.queue_ms) != (old.rate_mbit, old.queue_ms):
            self._shape(name, link)
        self.links[name] = link
        if link.loss_percent != old.loss_percent:
            self._lossy(name, link)
            self._filter()
        if link.up != old.up:
            super().set_link(name, link.up)

    def set_link(self, name: str, up: bool) -> None:
        """Cut (or restore) a host's link at the switch."""
        self.apply(name, replace(self.links[name], up=up))

    def set_rate(self, name: str, rate_mbit: float | None) -> None:
        self.apply(name, replace(self.links[name], rate_mbit=rate_mbit))

    def set_loss(self, name: str, percent: float) -> None:
        """Drop `percent` of the frames to and from `name`, at random, each way."""
        self.apply(name, replace(self.links[name], loss_percent=percent))

    def partition(self, a: str, b: str) -> None:
        """Drop everything between hosts `a` and `b` (both keep their links to the others)."""
        for host in (a, b):
            if host not in self.hosts:
                raise KeyError(host)
        self.partitions.add(frozenset((a, b)))
        self._filter()

    def heal(self, a: str | None = None, b: str | None = None) -> None:
        """End the partition between `a` and `b` (default: every partition)."""
        if a is None or b is None:
            self.partitions.clear()
        else:
            self.partitions.discard(frozenset((a, b)))
        self._filter()

    def _shape(self, name: str, link: Link) -> None:
        host = self.hosts[name]
        for netns, dev in ((host.netns, "eth0"), (self.switch, self.port(name))):
            args = link.shaper(dev)
            # removing a shaper that is not there is not an error
            _run(["tc", "-n", netns, *args], what=f"shaping {name}'s link", check=args[1] != "del")

    @staticmethod
    def _nft(netns: str, script: str, what: str) -> None:
        if shutil.which("nft") is None:
            raise NamespaceError("loss and partitions need the nft command (Debian package nftables; "
                                 "scripts/system-deps.sh installs it)")
        _run(["ip", "netns", "exec", netns, "nft", "-f", "-"], what=what, input=script)

    def _filter(self) -> None:
        ports = {name: self.port(name) for name in self.hosts}
        self._nft(self.switch, switch_ruleset(ports, self.links, self.partitions), "the switch's rules")

    def _lossy(self, name: str, link: Link) -> None:
        """A lossy link's ends send wire frames, not GSO aggregates (so that a loss is one
        frame's), and its host drops its share of what arrives; a link without loss is back
        to aggregates, which cost the CPUs far less."""
        host = self.hosts[name]
        segs = "1" if link.loss_percent > 0 else "65535"
        for netns, dev in ((host.netns, "eth0"), (self.switch, self.port(name))):
            _run(["ip", "-n", netns, "link", "set", "dev", dev, "gso_max_segs", segs],
                 what=f"{name}'s link")
        self._nft(host.netns, host_ruleset(name, link), f"{name}'s rules")

    # ------------------------------------------------------------------ looking

    def counters(self, name: str) -> Counters:
        """`name`'s interface counters, as its namespace sees them."""
        out = _run(["ip", "-n", self.hosts[name].netns, "-s", "-j", "link", "show", "dev", "eth0"],
                   what=f"{name}'s counters")
        stats = json.loads(out)[0]["stats64"]
        return Counters(stats["tx"]["bytes"], stats["rx"]["bytes"], stats["tx"]["packets"],
                        stats["rx"]["packets"])

    def dropped(self, name: str) -> int:
        """Frames to and from `name` that its link's loss rate dropped, since the rules last
        changed (a change of any link's loss, a partition, a heal)."""
        if not self.links[name].loss_percent:
            return 0
        total = 0
        for netns, family in ((self.switch, "bridge"), (self.hosts[name].netns, "netdev")):
            out = _run(["ip", "netns", "exec", netns, "nft", "-j", "list", "table", family, NFT_TABLE],
                       what=f"{name}'s loss counters")
            for item in json.loads(out)["nftables"]:
                rule = item.get("rule")
                if rule is not None and rule.get("comment") == f"loss {name}":
                    total += sum(e["counter"]["packets"] for e in rule["expr"] if "counter" in e)
        return total

    def in_host(self, name: str, fn: Callable[[], T]) -> T:
        """`fn()` run on a thread inside `name`'s namespace: sockets it makes stay there (the
        caller may use them from any thread). Cheaper than a process per probe."""
        path = f"/run/netns/{self.hosts[name].netns}"
        result: dict[str, Any] = {}

        def inside() -> None:
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    libc = ctypes.CDLL(None, use_errno=True)
                    if libc.setns(fd, _CLONE_NEWNET) != 0:
                        raise NamespaceError(f"setns {path}: {os.strerror(ctypes.get_errno())}")
                finally:
                    os.close(fd)
                result["value"] = fn()
            except BaseException as e:  # handed to the caller
                result["error"] = e

        thread = threading.Thread(target=inside, name=f"netns-{name}")
        thread.start()
        thread.join()
        if "error" in result:
            raise result["error"]
        return result["value"]

    def tcp_open(self, name: str, address: str, port: int, timeout: float = 1.0) -> bool:
        """Whether a TCP connection from `name` to address:port is accepted."""
        def probe() -> bool:
            try:
                with socket.create_connection((address, port), timeout=timeout):
                    return True
            except OSError:
                return False

        return self.in_host(name, probe)

    def describe(self) -> dict[str, Any]:
        return {name: {"namespace": host.netns, "address": host.address, "port": self.port(name),
                       **self.links[name].describe()}
                for name, host in self.hosts.items()}
